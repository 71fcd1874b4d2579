"""Where compare's two dumps came from, checked before any record is: a reference and a run of
the same models and prompt. Consumes the two manifests (`source`, `models`, the reference's
`build.follow`, `prompt_tokens`, `rounds`); produces the one sentence that refuses a pair no
comparison can judge (compare raises it as an input error, exit 2), naming the command that
makes the right reference, or None. It refuses only what the manifests prove: a HF checkpoint
and its GGUF differ in sha256 but are the same model, so files are told apart by what a
conversion or a quantization keeps (docs/findings.md "Before comparing").
"""

from __future__ import annotations

from pathlib import Path

from featdiff.core.names import ROLE_DRAFT, ROLE_TARGET, Role
from featdiff.diff.export import GGUF_SUFFIX
from featdiff.dump.manifest import Manifest
from featdiff.dump.manifest_fields import ModelInfo

REFERENCE_SOURCE = "reference"  # `source` of a `featdiff reference` dump (docs/dump.md)
FOLLOW_KEY = "follow"  # a reference's `build.follow`: the run dump it replayed (torchref/dflash/run.py)
COMMAND_KEY = "command"  # a `capture --exec` dump's `build.command`: the program run around
# ModelInfo fields a conversion (HF -> GGUF) or a quantization of one model keeps, per role; the
# depth is left out (a GGUF's block_count counts an MTP target's nextn layers, its HF config does
# not), and so is the drafter's vocabulary (an EAGLE3 GGUF may draft a reduced one)
KEPT_FIELDS: dict[Role, tuple[str, ...]] = {ROLE_TARGET: ("n_vocab", "n_embd"), ROLE_DRAFT: ("n_embd",)}
SHOWN_TOKENS = 8  # prompt tokens a sentence quotes around the first difference
SHA_CHARS = 12  # of a sha256 in a sentence


def provenance_problem(ref: Path, run: Path, ref_m: Manifest, run_m: Manifest) -> str | None:
    """Why `ref` and `run` are not a reference and a run of the same models and prompt, as one
    sentence with the command to run instead; None when nothing proves them mismatched."""
    if ref_m.source != REFERENCE_SOURCE and run_m.source == REFERENCE_SOURCE:
        return (
            f"{ref} is a capture (source {ref_m.source!r}) and {run} a reference: the reference comes "
            f"first; run `featdiff compare {run} {ref}`"
        )
    for role in (ROLE_TARGET, ROLE_DRAFT):
        found = _other_model(ref, run, ref_m, run_m, role)
        if found:
            return found
    return _other_run(ref, run, ref_m, run_m)


def _other_model(ref: Path, run: Path, ref_m: Manifest, run_m: Manifest, role: Role) -> str | None:
    """The sentence when the two sides loaded different models for `role`: a field a conversion
    keeps differs, or both loaded a GGUF and their architectures differ."""
    a, b = ref_m.model(role), run_m.model(role)
    if a is None or b is None or (a.sha256 and a.sha256 == b.sha256):
        return None
    differs = [f"{k} {getattr(a, k)} vs {getattr(b, k)}" for k in KEPT_FIELDS[role] if _known_and_differ(a, b, k)]
    if _is_gguf(a) and _is_gguf(b) and a.architecture and b.architecture and a.architecture != b.architecture:
        differs.insert(0, f"architecture {a.architecture} vs {b.architecture}")
    if not differs:
        return None
    fix = _follow_command(ref, run, ref_m, run_m, **{role: b.path})
    return (
        f"{ref} was made from the {role} {a.path} ({_sha(a)}) but {run} ran {b.path} ({_sha(b)}): "
        f"different models ({', '.join(differs)}); make the reference from the run's {role}: `{fix}`"
    )


def _known_and_differ(a: ModelInfo, b: ModelInfo, field: str) -> bool:
    x, y = getattr(a, field), getattr(b, field)
    return bool(x) and bool(y) and x != y  # 0: a producer that did not say


def _is_gguf(m: ModelInfo) -> bool:
    return m.path.endswith(GGUF_SUFFIX)


def _sha(m: ModelInfo) -> str:
    return f"sha256 {m.sha256[:SHA_CHARS]}" if m.sha256 else "no sha256 recorded"


def _other_run(ref: Path, run: Path, ref_m: Manifest, run_m: Manifest) -> str | None:
    """The sentence when the reference followed another run, or replayed another prompt, than
    `run` (a run of one flow: the flows of several each have their own prompt)."""
    followed = ref_m.build.get(FOLLOW_KEY)
    fix = _follow_command(ref, run, ref_m, run_m)
    if isinstance(followed, str) and followed:
        ref_starts = {(r.flow, r.pos0) for r in ref_m.rounds}
        one_flow = len(run_m.flow_ids()) == 1  # several: each flow has its own prompt (docs/flow.md)
        other_prompt = one_flow and ref_m.prompt_tokens != run_m.prompt_tokens
        if other_prompt or not ref_starts <= {(r.flow, r.pos0) for r in run_m.rounds}:
            return (
                f"{ref} followed another run ({followed}): its prompt and rounds are not {run}'s "
                f"({_prompt_difference(ref_m.prompt_tokens, run_m.prompt_tokens)}); make the reference "
                f"that follows this run: `{fix}`"
            )
        return None
    if COMMAND_KEY not in run_m.build or len(ref_m.flow_ids()) > 1 or len(run_m.flow_ids()) > 1:
        return None  # an in-process capture's other prompt is compare's `unpaired` finding (reason prompt)
    a, b = _before_first_draft(ref_m), _before_first_draft(run_m)
    if not _known(a, b) or a == b or a[: len(b)] == b:
        # the same, or the run's a beginning of the reference's: a driver fault can make a run draft
        # (or stop) early (inject-twice), and compare judges what it decoded
        return None
    # a program decodes its own prompt (a chat template, a BOS, llama-server's first sampled token)
    return (
        f"{ref} replayed another prompt than {run} decoded ({_prompt_difference(a, b, 'tokens before the first draft')}); make the "
        f"reference that follows the program's run: `{fix}`"
    )


def _before_first_draft(m: Manifest) -> tuple[int, ...]:
    """The prompt a side decoded before its first draft's anchor: the prompt's last token is that
    anchor, which a driver fault changes (compare's `block_token`), so it is left out on both
    sides, drafted or not (a run a fault stopped before its first draft is still that prompt's)."""
    return m.prompt_tokens[:-1]


def _known(*prompts: tuple[int, ...]) -> bool:
    """Both prompts recorded, with every token known (a cached position is negative: dump/records.py)."""
    return all(p and min(p) >= 0 for p in prompts)


def _prompt_difference(ref: tuple[int, ...], run: tuple[int, ...], what: str = "prompt tokens") -> str:
    at = next((i for i, (a, b) in enumerate(zip(ref, run)) if a != b), min(len(ref), len(run)))
    if ref == run:
        return f"the same {len(ref)} prompt tokens, other rounds"
    lo = max(0, at - SHOWN_TOKENS // 2)
    return (
        f"{len(ref)} vs {len(run)} {what}, first different at position {at}: "
        f"{list(ref[lo : lo + SHOWN_TOKENS])} vs {list(run[lo : lo + SHOWN_TOKENS])}"
    )


def _follow_command(ref: Path, run: Path, ref_m: Manifest, run_m: Manifest, **models: str) -> str:
    """`featdiff reference ... --follow RUN -o REF`: the reference's own models (the checkpoint the
    user chose), a role's replaced by the run's where `models` names it."""
    target, draft = (models.get(role) or _path(ref_m, role) or _path(run_m, role) for role in (ROLE_TARGET, ROLE_DRAFT))
    return f"featdiff reference --target {target} --model {draft} --follow {run} -o {ref}"


def _path(m: Manifest, role: Role) -> str:
    info = m.model(role)
    return info.path if info is not None else ""
