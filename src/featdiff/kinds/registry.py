"""The drafter kinds featdiff models, in one registry: what tells a drafter GGUF's kind, and where
each stage keeps that kind's code (STYLE §10: a kind is one seam, as gguf-py keeps `MODEL_ARCH` ->
`MODEL_TENSORS` in one table and transformers maps a `model_type` to its classes in one mapping).

A kind names its stage modules by dotted path, resolved when a stage needs them
(`driver_module`, `reference_module`), so this table sits on the bottom floor and each stage
imports only its own code. Adding a kind is its own modules plus one `DrafterKind` line here:

* `driver`: a module of `featdiff.driver` with `flow_config(model, draft_max, p_min)` (the settings
  upstream's driver reads from the drafter), `enable(tgt, dft, cfg)` (what its constructor switches
  on) and `run_flow(tgt, dft, prompt, rounds, cfg, recorder, on_round)` (the in-process flow);
* `reference`: a module of `featdiff.torchref` with `reference(target, model, output, ...)`, the
  `featdiff reference` command for that kind (the options of torchref.run.reference), and the
  accept probe's `load_pair_draft(target, model, numerics)` and `probe_round(target, draft,
  prompt, numerics, block_rows)` (one round after a prompt);
* `wiring`: the drafter's records a capture keeps and compare expects on both sides (globs);
* `checks`: `module:name` in `featdiff.kinds` of its lint checks, a tuple of (check(d, t) -> list of
  problem texts, severity) in lint's order, in the kind's own module (featdiff.kinds.preflight runs
  them; `check_table`);
* `unmodelled(keys, tensors)`: the GGUF keys (`<arch>.*` ones, name -> value) and tensors the reference
  does not model (lint lists them, the reference refuses them, a capture records them);
* `unread`: `module:name` in `featdiff.torchref` of a function (gguf -> sentences) naming what of
  the GGUF the kind's reference does not read and so refuses, for lint to list (`unread_problems`;
  None: the kind's `unmodelled` table says it);
* `is_checkpoint(config)`: whether a HF checkpoint's config.json is this kind's, as the pinned
  converter tells it (None: the DFlash graph's, what a checkpoint no kind claims is taken for);
* `refuses(gguf)`: why featdiff refuses a GGUF of this kind's family that no kind models (an MTP
  head of an architecture it does not replay), one sentence; None where it does not (`refused`);
* `first_draft_row(gguf)`: a block kind's row of its block that llama.cpp reads the first draft from
  (None for a step kind);
* `modelled_doc()`: its section of docs/modelled.md, lines (`render_markdown` joins each section once,
  in this table's order; None: the kind's reference says what it reads elsewhere).

DFlash, DFlash2 and DSpark share the `dflash` graph (llama.cpp runs one arch with the heads a
file carries), so they share its modules; EAGLE3 is its own arch and flow.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import GgufModel
from featdiff.kinds.dflash.dspark import gguf_first_draft_row
from featdiff.kinds.dflash.modelled import unmodelled_in
from featdiff.kinds.dflash.modelled_doc import markdown_section as dflash_markdown
from featdiff.kinds.eagle3 import EAGLE3_WIRING, is_eagle3_config, unmodelled_eagle3
from featdiff.kinds.eagle3 import markdown_section as eagle3_markdown
from featdiff.kinds.mtp import ARCH_WIRING, MTP, MTP_TARGET_WIRING, MTP_WIRING, is_mtp_checkpoint, refused_head
from featdiff.kinds.mtp import markdown_section as mtp_markdown
from featdiff.kinds.problems import CheckTable


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter: how its GGUF is told, how llama.cpp runs it, where featdiff models it."""

    name: str
    arch: str  # general.architecture of its GGUF
    spec_type: str  # llama.cpp's --spec-type that runs it
    marker: str | None  # a tensor whose presence tells this kind from its arch's others; None: the arch's plain kind
    doc: str
    driver: str  # module of featdiff.driver: the in-process flow
    reference: str  # module of featdiff.torchref: weights and the replayed flow
    wiring: tuple[str, ...]  # the drafter's records (globs)
    layer_key: str  # GGUF key of its target layer ids (layer inputs)
    # its rounds are docs/flow.md's block protocol ([anchor, mask x (B-1)] at n_past, inject rows at
    # their target rows' positions): compare also checks a run's batches against those rules;
    # otherwise against the reference's batches only
    block_flow: bool = True
    # what its layer ids must be, in a sentence after "<layer_key> must be the checkpoint's ..."
    layer_rule: str = f"{names.HF_TARGET_LAYER_IDS} + 1"
    # what a capture keeps of the target besides the tapped layers' inputs
    target_wiring: tuple[str, ...] = names.TARGET_WIRING
    # its GGUF is a drafter only (dflash, eagle3); False: a target's own arch whose file carries
    # the heads (MTP), a drafter only where a run drafts with it
    standalone: bool = True
    more_archs: tuple[str, ...] = ()  # other GGUF archs of this kind (MTP: each target arch with heads)
    # a step drafter's cache row at position p is decoded with the token at p + row_token (EAGLE3: 1,
    # its (token p+1, g p) pairs; MTP: 0, token p with the hidden of p - 1); None: a block
    # drafter's inject rows hold features only
    row_token: int | None = None
    # it runs on the target's own model (an MTP head: one load with its MTP layers where the head is
    # in the target's GGUF, an MTP context, --spec-type alone says it drafts); False: its own model
    shares_target_model: bool = False
    # its lint checks (the module docstring); the DFlash graph's by default
    checks: str = "dflash.checks:CHECKS"
    # its GGUF's unmodelled keys and tensors (the module docstring); None: no table of kinds/ says
    # (an MTP head's unread keys and tensors are its reference's: `unread`)
    unmodelled: Callable[[Mapping[str, Any], Iterable[str]], tuple[str, ...]] | None = unmodelled_in
    # what of its GGUF its reference does not read (the module docstring); None: `unmodelled` says
    unread: str | None = None
    # whether a HF config.json is its checkpoint's (the module docstring)
    is_checkpoint: Callable[[Mapping[str, Any]], bool] | None = None
    # why a GGUF this kind does not model is refused (the module docstring); None: it refuses none
    refuses: Callable[[GgufModel], str | None] | None = None
    # a block kind's first draft row (the module docstring): the DFlash graph's rule by default
    first_draft_row: Callable[[GgufModel], int] | None = gguf_first_draft_row
    # its section of docs/modelled.md (the module docstring); the DFlash graph's by default
    modelled_doc: Callable[[], list[str]] | None = dflash_markdown
    # graph inputs whose rows the target's graph chooses and the driver only copies (an MTP head's
    # handed hidden, t_h_nextn): another layer there is the target graph's (diff/attribution.py)
    graph_handed: tuple[str, ...] = ()
    # the records holding the state a one-token draft step is fed (a name, or a prefix ending in "-"
    # for a per-layer record): what the step-state detectors judge (diff/detectors/steps.py)
    step_state: tuple[str, ...] = ()
    # the drafter records of an architecture of this kind whose graph is its own, not the kind's
    # (Gemma 4's assistant: kinds.mtp.ARCH_WIRING); every other architecture's are `wiring`
    arch_wiring: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False, compare=False)

    def wiring_of(self, arch: str | None) -> tuple[str, ...]:
        """The drafter records of this kind's architecture `arch`: its own graph's, else the kind's."""
        return self.arch_wiring.get(arch or "", self.wiring)

    @property
    def archs(self) -> tuple[str, ...]:
        return (self.arch, *self.more_archs)

    def driver_module(self) -> ModuleType:
        return importlib.import_module(f"featdiff.driver.{self.driver}")

    def reference_module(self) -> ModuleType:
        return importlib.import_module(f"featdiff.torchref.{self.reference}")

    def unread_problems(self, g: GgufModel) -> list[str]:
        """What of the GGUF `g` its reference does not read (`unread`), one sentence each."""
        if self.unread is None:
            return []
        problems: list[str] = _resolved("featdiff.torchref", self.unread)(g)
        return problems

    def check_table(self) -> CheckTable:
        """Its lint checks (`checks`), each with the severity of its problems."""
        table: CheckTable = _resolved("featdiff.kinds", self.checks)
        return table


def _resolved(package: str, spec: str) -> Any:
    """The object a `module:name` field names in `package`, imported when first asked for."""
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(f"{package}.{module}"), attr)


KINDS: tuple[DrafterKind, ...] = (
    DrafterKind(
        "dflash",
        names.ARCH_DFLASH,
        "draft-dflash",
        None,
        "block diffusion: target features staged into the drafter's KV cache",
        "dflash",
        "dflash.run",
        names.DRAFT_WIRING,
        names.KEY_TARGET_LAYERS,
    ),
    DrafterKind(
        "dflash2",
        names.ARCH_DFLASH,
        "draft-dflash",
        "selector_hidden.weight",
        "DFlash with local convolutions and a candidate lattice",
        "dflash",
        "dflash.run",
        names.DRAFT_WIRING,
        names.KEY_TARGET_LAYERS,
    ),
    DrafterKind(
        "dspark",
        names.ARCH_DFLASH,
        "draft-dspark",
        names.T_MARKOV_W1,
        "DFlash with Markov and confidence heads",
        "dflash",
        "dflash.run",
        names.DRAFT_WIRING,
        names.KEY_TARGET_LAYERS,
    ),
    DrafterKind(
        "eagle3",
        names.ARCH_EAGLE3,
        "draft-eagle3",
        None,
        "three target layers through an fc into one decoder layer, one token per step",
        "eagle3",
        "eagle3.run",
        EAGLE3_WIRING,
        names.KEY_EAGLE3_TARGET_LAYERS,
        block_flow=False,
        layer_rule="eagle_aux_hidden_state_layer_ids as they are (the EAGLE3 converter adds no +1)",
        row_token=1,
        checks="eagle3_checks:CHECKS",
        unmodelled=unmodelled_eagle3,
        is_checkpoint=is_eagle3_config,
        first_draft_row=None,
        modelled_doc=eagle3_markdown,
        step_state=(f"{names.EAGLE3_G_NORM}-",),  # g, normed as its first layer reads it
    ),
    DrafterKind(
        MTP,
        names.ARCH_QWEN35,
        "draft-mtp",
        None,
        "the target's own next-token-prediction block: its final hidden state and the next token",
        "mtp",
        "mtp.run",
        MTP_WIRING,
        names.KEY_NEXTN_LAYERS,
        block_flow=False,
        layer_rule="the checkpoint's mtp_num_hidden_layers (GLM-4.5's num_nextn_predict_layers; MiMo-V2's first head)",
        target_wiring=MTP_TARGET_WIRING,
        standalone=False,
        more_archs=(
            names.ARCH_QWEN35MOE,
            names.ARCH_GLM4MOE,
            names.ARCH_MIMO2,
            names.ARCH_QWEN3NEXT,
            names.ARCH_DEEPSEEK2,
            names.ARCH_DEEPSEEK32,
            names.ARCH_GLM_DSA,
            names.ARCH_STEP35,  # chained heads (torchref/mtp/step35.py)
            names.ARCH_NEMOTRON_H_MOE,
            names.ARCH_HY_V3,
            names.ARCH_COHERE2MOE,
            names.ARCH_BAILINGMOE3,
            names.ARCH_GEMMA4_ASSISTANT,  # a separate drafter over the target's KV cache (torchref/mtp/gemma4_assistant.py)
        ),
        row_token=0,
        shares_target_model=True,
        checks="mtp_checks:CHECKS",
        unmodelled=None,
        unread="mtp.head:unread_problems",
        is_checkpoint=is_mtp_checkpoint,
        refuses=refused_head,
        first_draft_row=None,
        modelled_doc=mtp_markdown,
        graph_handed=(names.MTP_H_INPUT,),
        step_state=(names.MTP_H_INPUT, f"{names.MTP_HNORM}-"),  # the head's hidden input and its norm
        arch_wiring=ARCH_WIRING,
    ),
)
# the architectures whose GGUFs are drafters only: a file of any other is a target (or carries MTP
# heads, a drafter only where the run drafts with it)
DRAFTER_ARCHS: tuple[str, ...] = tuple(dict.fromkeys(a for k in KINDS if k.standalone for a in k.archs))
# every architecture a drafter of some kind has
ALL_DRAFTER_ARCHS: tuple[str, ...] = tuple(dict.fromkeys(a for k in KINDS for a in k.archs))
# every kind's drafter records: what a capture around a program keeps before it knows the drafter
ALL_DRAFT_WIRING: tuple[str, ...] = tuple(dict.fromkeys(g for k in KINDS for g in k.wiring))
# every kind's graph-handed inputs (`graph_handed`)
ALL_GRAPH_HANDED: tuple[str, ...] = tuple(dict.fromkeys(r for k in KINDS for r in k.graph_handed))
# every kind's step-state records (`step_state`)
ALL_STEP_STATE: tuple[str, ...] = tuple(dict.fromkeys(r for k in KINDS for r in k.step_state))


def is_step_state(record: str) -> bool:
    """Whether `record` holds the state a one-token draft step is fed, in some kind (`step_state`)."""
    return any(record == s or (s.endswith("-") and record.startswith(s)) for s in ALL_STEP_STATE)


def kind_of(arch: str, tensors: object = (), where: str = "the drafter") -> DrafterKind:
    """The kind of a drafter of architecture `arch` carrying `tensors` (names; anything with `in`);
    InputError naming `where` when featdiff models no drafter of that architecture."""
    of_arch = [k for k in KINDS if arch in k.archs]
    if not of_arch:
        raise InputError(
            f"{where}: architecture {arch!r} is no drafter featdiff models; it models "
            f"{', '.join(k.name for k in KINDS)} ({', '.join(ALL_DRAFTER_ARCHS)} GGUFs)"
        )
    return next((k for k in of_arch if k.marker is not None and k.marker in tensors), of_arch[0])  # type: ignore[operator]


def of_arch(arch: str | None) -> DrafterKind:
    """The plain kind of a drafter architecture; DFlash's when `arch` is unknown or unsaid (dumps
    written before the registry)."""
    return next((k for k in KINDS if arch in k.archs), KINDS[0])


def of_checkpoint(config: Mapping[str, Any]) -> DrafterKind:
    """The kind of a HF checkpoint from its config.json: the first kind whose `is_checkpoint` claims
    it, a head inside a target's checkpoint first (its config is a whole target's, which may look
    like another kind's); DFlash's when none does."""
    told = sorted((k for k in KINDS if k.is_checkpoint is not None), key=lambda k: not k.shares_target_model)
    return next((k for k in told if k.is_checkpoint is not None and k.is_checkpoint(config)), KINDS[0])


def refused(g: GgufModel) -> str | None:
    """Why featdiff refuses the GGUF `g` (a kind's `refuses`: an MTP head it does not replay), in
    one sentence without the file's name; None when no kind refuses it."""
    return next((why for k in KINDS if k.refuses is not None and (why := k.refuses(g)) is not None), None)


def by_name(name: str) -> DrafterKind:
    return next(k for k in KINDS if k.name == name)


def is_drafter_arch(arch: str) -> bool:
    return arch in DRAFTER_ARCHS


def wiring_names(arch: str | None) -> tuple[str, ...]:
    """The records compare expects on both sides of a run whose drafter has architecture `arch`
    (names.WIRING_NAMES for the DFlash graph, also when the dump does not say): the kind's drafter
    wiring and every target layer, without the API read-backs (older dumps lack them)."""
    wiring = dict.fromkeys(of_arch(arch).wiring_of(arch) + names.TARGET_ALL_LAYERS)
    return tuple(n for n in wiring if n not in names.READBACK_RECORDS)


def render_markdown() -> str:
    """docs/modelled.md: each kind's section (`modelled_doc`), once, in KINDS' order."""
    sections = dict.fromkeys(k.modelled_doc for k in KINDS if k.modelled_doc is not None)
    lines = [
        "# What the reference models of a drafter",
        "",
        "Generated from each kind's table by `featdiff.kinds.registry.render_markdown` (the DFlash graph's:",
        "`src/featdiff/kinds/dflash/modelled.py`); do not edit by hand.",
    ]
    for section in sections:
        lines += ["", *section()]
    return "\n".join(lines) + "\n"
