"""Where a fault lives (DESIGN.md, "Where a fault lives"; docs/findings.md, `where`): every error
finding placed in the export, the graph or the driver by the evidence, or `unknown` with what would
decide it. Consumes the findings, the export evidence (diff/export.py) and the names of the run's
graph inputs; produces the findings with `where` and `where_reason`. Pure: no I/O.

* driver: what the graph was given is wrong (rows, positions, tokens, states, a graph input's
  values) while the weights and keys that decide it agree with the reference's;
* export: the run's GGUF differs from what the reference read (the checkpoint's converted keys,
  another GGUF's keys or tensors) where a node diverges with its inputs agreeing;
* graph: a node whose inputs agree with the reference and whose output does not, computed from
  the same keys and tensors the reference read.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

from featdiff.core import names
from featdiff.core.names import ROLES, Role
from featdiff.diff.detectors.chain import CHAIN_STATE_SOURCE
from featdiff.diff.detectors.choices import ANOTHER_ROW_SAMPLED, DRAFT_ROWS_SOURCE
from featdiff.diff.detectors.kvcache import KEPT_ROW_SOURCE, RESTORED_SOURCE
from featdiff.diff.detectors.numeric import STALE_PENDING_SOURCE
from featdiff.diff.detectors.readback import SOURCE_ANOTHER_OUTPUT_ROW
from featdiff.diff.detectors.steps import ANOTHER_SEQUENCE_SOURCE, SEED_STATE_SOURCE
from featdiff.diff.export import Export
from featdiff.diff.fields import Where, WhereFields
from featdiff.diff.result import Finding
from featdiff.kinds import registry as kinds

# Kinds about what the graph was handed (rows, positions, tokens, the flow): the driver's
FED_KINDS: tuple[str, ...] = ("row_shift", "misplaced_rows", "position_offset", "stale", "duplicate_rows")
FED_KINDS += ("block_token", "unpaired", "flow_note", "not_conditioned")
# Kinds that name which target layers or slots a graph input holds: a GGUF key decides them
LAYER_KINDS = ("layer_offset", "slot_permutation", "layout_transpose")
# the field those kinds rest on: diff/export.CONVERTED_FIELDS' and the GGUF keys' (`dflash.target_layers`)
LAYER_FIELD = "target_layers"
# wrong_source sources that name another row, eval, request or state, not another weight or node
FED_SOURCES = (
    SOURCE_ANOTHER_OUTPUT_ROW,
    ANOTHER_ROW_SAMPLED,
    STALE_PENDING_SOURCE,
    RESTORED_SOURCE,
    KEPT_ROW_SOURCE,
    SEED_STATE_SOURCE,
    ANOTHER_SEQUENCE_SOURCE,
    CHAIN_STATE_SOURCE,
    names.HYP_H_BATCH_LAST.partition("=")[2],  # a hypothesis' value is the source
    names.HYP_RECURRENT_KEPT.partition("=")[2],
)
FED_SOURCE_PREFIXES = (DRAFT_ROWS_SOURCE.format(row=""),)

# Faults GGUF keys decide that no manifest field states: the RoPE (divergence `rope`), a sliding
# window run as full attention (wrong_source `full`, names.HYP_FULL_ATTENTION), an MoE block routed
# by the other gating function (wrong_source `softmax` / `sigmoid`, expert_gating_func)
KEYED_DETAILS = ("rope",)
KEYED_SOURCES = tuple(
    h.partition("=")[2] for h in (names.HYP_FULL_ATTENTION, names.HYP_ROUTING_SOFTMAX, names.HYP_ROUTING_SIGMOID)
)

FED = "the graph computed right from what it was given; what it was given ({what}) is not what the flow prescribes"
UNCHECKED_INPUTS = (
    "the reference read the same weights, but {tensor}'s inputs were not captured (a node the graph leaves "
    "unnamed lies between them), so a wrong input (rows or a state the driver handed over) and a wrong node "
    "look the same here; the graph naming the nodes before it (its cb() names) would decide it"
)
# The layer a graph-handed input holds (a kind's `graph_handed`: an MTP head's hidden) is its target
# graph's choice: no GGUF key names it, and the driver copies the rows the graph exposes (t_h_nextn,
# read by llama_get_embeddings_nextn)
HANDED_LAYER = (
    "the head is handed the rows its target's graph exposes as t_h_nextn (the driver copies them, no GGUF key "
    "names the layer), and the reference read the same weights: the target graph chose that layer"
)
NOT_CHECKED = "export not checked: the reference did not record which model it read; pass the checkpoint with --model"


def attributed(
    findings: tuple[Finding, ...],
    export: Export,
    inputs: Collection[str],
    roles: Mapping[str, Role] | None = None,
    unchecked: Collection[str] = (),
) -> tuple[Finding, ...]:
    """Every error finding with `where` and `where_reason` (those that carry them already keep
    theirs); info findings unchanged. `inputs`: the run's graph inputs (leaves) among the records;
    `roles`: the role of each record name of one role only, whose model's evidence places it;
    `unchecked`: the records whose inputs were not captured (a divergence there is not the graph's
    on that evidence: UNCHECKED_INPUTS)."""
    roles = roles or {}
    return tuple(
        _with_where(f, _unless_unchecked(f, place(f, export.of_role(_role(f, roles)), inputs), unchecked))
        if _needs_where(f)
        else f
        for f in findings
    )


def _unless_unchecked(f: Finding, where: WhereFields, unchecked: Collection[str]) -> WhereFields:
    """A plain divergence placed in the graph, at a record whose inputs were not captured: unknown,
    since a wrong input (rows, states the driver handed over) would look the same."""
    if f.kind != "divergence" or where.where != "graph" or f.tensor not in unchecked:
        return where
    return WhereFields("unknown", UNCHECKED_INPUTS.format(tensor=f.tensor))


def _role(f: Finding, roles: Mapping[str, Role]) -> Role | None:
    role = f.fields.get("role")
    return role if isinstance(role, str) and role in ROLES else roles.get(f.tensor)


def _needs_where(f: Finding) -> bool:
    return f.severity == "error" and "where" not in f.fields


def _with_where(f: Finding, where: WhereFields) -> Finding:
    return replace(f, fields={**f.fields, **where.to_json()})


def place(f: Finding, export: Export, inputs: Collection[str]) -> WhereFields:
    """Where one error finding's fault lives, by the rules of the module docstring."""
    if f.kind in FED_KINDS or _fed_source(f) or _fed_zeros(f):
        return WhereFields("driver", FED.format(what=_what_fed(f)))
    if f.kind in LAYER_KINDS and f.tensor in kinds.ALL_GRAPH_HANDED:
        return _handed_layer_place(export)
    if f.tensor in inputs and f.kind != "wrong_source":  # another node's state handed over: the graph chose it
        return _input_place(f, export)
    return weights_place(export, keyed=_keyed(f))


def _keyed(f: Finding) -> bool:
    """A fault GGUF keys decide that the manifests do not state (the RoPE, a sliding window)."""
    return f.fields.get("detail") in KEYED_DETAILS or str(f.fields.get("source", "")) in KEYED_SOURCES


def _fed_source(f: Finding) -> bool:
    source = str(f.fields.get("source", ""))
    return f.kind == "wrong_source" and (source in FED_SOURCES or source.startswith(FED_SOURCE_PREFIXES))


def _fed_zeros(f: Finding) -> bool:
    """Zeros in the state a draft step is fed: a row the driver handed over (set_embd), never written."""
    return f.kind == "zeros" and kinds.is_step_state(f.tensor)


def _what_fed(f: Finding) -> str:
    if f.kind == "position_offset":
        return "positions"
    if f.kind in ("block_token", "unpaired", "not_conditioned"):
        return "tokens or evals"
    if f.kind == "wrong_source":
        return f"a state or row: {f.fields.get('source')}"
    if f.kind == "zeros":
        return "a state row never written"
    return "rows"


def _input_place(f: Finding, export: Export) -> WhereFields:
    """A graph input's values are wrong: the driver staged them, unless the GGUF key that says
    which layers to stage differs from the reference's (export)."""
    keyed = [d for d in export.differs if LAYER_FIELD in d] if f.kind in LAYER_KINDS else []
    if keyed:
        return WhereFields("export", f"the run's GGUF differs from what the reference read: {'; '.join(keyed)}")
    if f.kind in LAYER_KINDS and not _layers_known(export):
        return WhereFields("unknown", NOT_CHECKED)
    return WhereFields("driver", FED.format(what=f"the values of the graph input {f.tensor}"))


def _handed_layer_place(export: Export) -> WhereFields:
    """Another layer handed to an MTP head (`mtp_h_input`, a graph input since issue 42): the
    target graph's, where the weights place a node's fault in the graph (HANDED_LAYER)."""
    where = weights_place(export)
    return WhereFields("graph", HANDED_LAYER) if where.where == "graph" else where


def _layers_known(export: Export) -> bool:
    return any(e.origin != "unknown" for e in export.roles.values())


def weights_place(export: Export, keyed: bool = False) -> WhereFields:
    """Where a node that diverges with its inputs agreeing lives: the export when the run's GGUF
    differs from what the reference read, the graph when the reference read the same tensors (and,
    for a fault keys decide, `keyed`, the same keys), else unknown with what would decide it."""
    roles = export.roles.values()
    if export.differs:
        return WhereFields(
            "export", f"the run's GGUF differs from what the reference read: {'; '.join(export.differs)}"
        )
    if keyed and roles and all(e.complete for e in roles) and not all(e.keys_complete for e in roles):
        return WhereFields(
            "unknown",
            "the GGUF's tensors agree with the checkpoint's, but the keys that decide this (RoPE, sliding window, "
            "expert gating) "
            "were not compared with it: check them against its config.json, or make a second reference from the "
            "run's own GGUF (if the run agrees with that one, the export is wrong, else the graph)",
        )
    if roles and all(e.complete for e in roles):
        same = all(e.origin == "same_file" for e in roles)
        read = "the run's own GGUF (same sha256)" if same else "the same tensors (compared by value) and converted keys"
        return WhereFields(
            "graph", f"the reference read {read}, and the node's inputs agree with it while its output does not"
        )
    if any(e.origin == "checkpoint" for e in roles):
        gguf = next((p for p in export.gguf.values() if p), "the GGUF")
        return WhereFields(
            "unknown",
            f"the checkpoint's keys agree with the GGUF's, its tensors were not compared: make a second reference "
            f"from {gguf} itself (featdiff reference --model {gguf}); if the run agrees with that one, the export "
            "is wrong, else the graph",
        )
    return WhereFields("unknown", NOT_CHECKED)


def where_of(export: Export) -> Where:
    """weights_place's `where`: what a detector's fix sentence follows."""
    return weights_place(export).where
