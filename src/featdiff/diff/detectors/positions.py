"""Detectors of token ids and positions: the run's batches against the protocol of docs/flow.md
(featdiff.core.phases) and against the reference's same batch, before any value is compared. Each
`detect_<kind>(ref, run)` is pure, reads the two manifests only, and returns the first broken
convention of its kind in flow order, or None; its sentence is written beside it.
(diff/positions.py runs them in the order the run met them.)
"""

from __future__ import annotations

from collections import Counter

from featdiff.core import names
from featdiff.core.names import ROLE_DRAFT, ROLE_TARGET
from featdiff.core.phases import PREFILL_ROUND, ROUND_OPENER, TARGET_PHASES, Phase
from featdiff.diff.align import GroupKey
from featdiff.diff.batches import Batch, batches, decoded_alike, same_token_ids
from featdiff.diff.detectors.base import span
from featdiff.diff.fields import BlockTokenFields, FlowNoteFields, PositionOffsetFields, UnpairedFields
from featdiff.diff.result import Finding
from featdiff.dump.manifest import Manifest

NO_TOKEN = -1  # ModelInfo's value for "no mask token recorded"


# --- the prompt ----------------------------------------------------------------------------------


def detect_unpaired_prompt(ref: Manifest, run: Manifest) -> Finding | None:
    """Hypothesis: run and reference were made from different prompts, so no row after the first
    difference shares a token history. Evidence: the tokens each side decoded before its first
    draft differ. (The last prompt token is the first draft block's anchor: a driver that builds
    the block wrongly changes it, and `detect_block_token` names that, not this.)"""
    a, b = _before_first_draft(run), _before_first_draft(ref)
    if not a or not b or a == b[: len(a)] and not _has_drafts(run) or a == b:
        return None
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    observed = a[i] if i < len(a) else None
    expected = b[i] if i < len(b) else None
    return Finding.of(
        UnpairedFields(
            reason="prompt",
            row=i,
            expected=expected,
            observed=observed,
            rows=tuple(range(i, max(len(a), len(b)))),
            records=0,
            evals=(),
            round=PREFILL_ROUND,
        ),
        tensor="prompt_tokens",
        message=f"the run decoded another prompt than the reference: they differ at token {i} (run "
        f"{observed}, reference {expected}; {len(a)} vs {len(b)} tokens before the first draft), "
        f"so no row from position {i} on can be compared; give `featdiff reference --tokens` the "
        "prompt the program was given (llama-server: the request plus its first sampled token)",
    )


def _has_drafts(m: Manifest) -> bool:
    return any(ev.phase == Phase.DRAFT for ev in m.evals)


def _before_first_draft(m: Manifest) -> tuple[int, ...]:
    """The prompt tokens the side decoded on the target before its first draft: `prompt_tokens`
    less its last token (the first block's anchor) when the side drafted."""
    return m.prompt_tokens[:-1] if _has_drafts(m) else m.prompt_tokens


# --- the draft block's tokens --------------------------------------------------------------------


def mask_token(ref: Manifest, run: Manifest) -> int | None:
    """The drafter's mask token: as the run's manifest states it, else the reference's, else what
    the reference's draft blocks carry after their anchor."""
    for m in (run, ref):
        draft = m.model(ROLE_DRAFT)
        if draft is not None and draft.mask_token_id != NO_TOKEN:
            return draft.mask_token_id
    after_anchor = Counter(t for b in batches(ref).values() if b.key[:2] == ROUND_OPENER for t in b.token_ids[1:])
    return after_anchor.most_common(1)[0][0] if after_anchor else None


def anchor_token(run: Manifest, rnd: int, run_batches: dict[GroupKey, Batch]) -> int | None:
    """The anchor of round `rnd`: the last accepted target token, the first token of that
    round's verify (docs/flow.md); the manifest's round record when the run has no verify."""
    verify = run_batches.get((ROLE_TARGET, Phase.VERIFY, rnd))
    if verify is not None and verify.token_ids:
        return verify.token_ids[0]
    return next((r.anchor for r in run.rounds if r.round == rnd), None)


def detect_block_token(ref: Manifest, run: Manifest) -> Finding | None:
    """Hypothesis: the driver built a draft block other than `[anchor, mask x (B-1)]` (the anchor
    dropped or replaced, another token among the masks, another block length). Evidence: the
    run's draft eval token ids against the anchor (its round's verify row 0), the mask token and
    the reference's block length."""
    mask = mask_token(ref, run)
    run_batches, ref_batches = batches(run), batches(ref)
    for key, block in run_batches.items():
        if key[:2] != ROUND_OPENER:
            continue
        anchor = anchor_token(run, key[2], run_batches)
        for row, observed in enumerate(block.token_ids):
            expected = anchor if row == 0 else mask
            if expected is not None and observed != expected:
                return _block_finding(block, row, expected, observed, mask, anchor)
        ref_block = ref_batches.get(key)
        if (
            ref_block is not None
            and len(ref_block.token_ids) != len(block.token_ids)
            and run.prompt_tokens == ref.prompt_tokens
        ):
            return _block_length_finding(block, ref_block)
    return None


def _block_finding(
    block: Batch, row: int, expected: int, observed: int, mask: int | None, anchor: int | None
) -> Finding:
    what = " (the mask token)" if observed == mask else " (the anchor)" if observed == anchor else ""
    wanted = (
        f"the anchor {expected}, the last accepted target token"
        if row == 0
        else f"the mask token {expected} in every row after the anchor"
    )
    return Finding.of(
        BlockTokenFields(row=row, expected=expected, observed=observed, round=block.key[2], eval=block.eval),
        tensor=names.INP_NOISE_EMBD,
        message=f"row {row} of {block.label} is token {observed}{what}; the flow expects {wanted} "
        f"(docs/flow.md: the block is [anchor, mask x (B-1)])",
    )


def _block_length_finding(block: Batch, ref_block: Batch) -> Finding:
    n_run, n_ref = len(block.token_ids), len(ref_block.token_ids)
    row = min(n_run, n_ref)
    expected = ref_block.token_ids[row] if n_ref > n_run else None
    observed = block.token_ids[row] if n_run > n_ref else None
    return Finding.of(
        BlockTokenFields(row=row, expected=expected, observed=observed, round=block.key[2], eval=block.eval),
        tensor=names.INP_NOISE_EMBD,
        message=f"{block.label} has {n_run} rows where the reference's has {n_ref}; llama.cpp drafts "
        f"--spec-draft-n-max + 1 rows (anchor-first DSpark: n-max): make the reference's block as long as the run's "
        f"(`featdiff reference --run run.npz`, or --block {n_run})",
    )


# --- positions -----------------------------------------------------------------------------------


def detect_position_offset_of_batch(ref: Manifest, run: Manifest, by_flow: bool = True) -> Finding | None:
    """Hypothesis: a batch was placed at positions off by a constant (inject rows one position
    late, the draft block late, n_past drifting after an accept). Evidence, in flow order: the
    run batch's positions against the reference's same batch while both sides decoded the same
    tokens so far, and against the flow itself (inject rows at the positions of the target rows
    they carry; verify at the draft block's start; the first block right after the prefill), unless
    `by_flow` is False (a drafter kind of other rounds: featdiff.kinds). A draft block and its
    verify off by the same k are the target's n_past: named at the verify.
    (One record's values computed at offset positions: rows.detect_position_offset_of_record.)"""
    ref_batches, run_batches = batches(ref), batches(run)
    same_history = run.prompt_tokens == ref.prompt_tokens
    for key, batch in run_batches.items():
        ref_batch = ref_batches.get(key) if same_history else None
        if ref_batch is not None and not same_token_ids(batch, ref_batch):
            ref_batch = None  # other tokens: where they sit says nothing about positions
        found = _batch_offset(batch, ref_batch, run_batches, by_flow) if batch.positions else None
        if found is not None:
            return _at_verify(found, batch, run_batches, ref_batches) or _position_finding(*found)
        same_history = same_history and ref_batch is not None and decoded_alike(batch, ref_batch)
    return None


# (the batch, its offset k, where the flow expects it, what to check): what a finding says
Offset = tuple[Batch, int, str, str]


def _batch_offset(
    batch: Batch, ref_batch: Batch | None, run_batches: dict[GroupKey, Batch], by_flow: bool = True
) -> Offset | None:
    """The batch's offset from the reference's same batch, else from where the flow puts it."""
    from_ref = _offset_from_ref(batch, ref_batch) if ref_batch is not None else None
    return from_ref or (_offset_from_flow(batch, run_batches) if by_flow else None)


def _at_verify(
    found: Offset, block: Batch, run_batches: dict[GroupKey, Batch], ref_batches: dict[GroupKey, Batch]
) -> Finding | None:
    """A draft block off by k whose verify starts where it starts: the target's n_past is off,
    and the block follows it; named at the verify, where n_past is the target's."""
    rnd = block.key[2]
    verify = run_batches.get((ROLE_TARGET, Phase.VERIFY, rnd))
    if (
        block.key[:2] != ROUND_OPENER
        or verify is None
        or not verify.positions
        or verify.positions[0] != block.positions[0]
    ):
        return None
    k = found[1]
    ref_verify = ref_batches.get(verify.key)
    expected = (
        f"the reference's {span(ref_verify.positions)}"
        if ref_verify is not None
        else f"a start at {verify.positions[0] - k}"
    )
    where = f"after the accept of round {rnd - 1}" if rnd > 1 else "after the prefill"
    return _position_finding(
        verify,
        k,
        expected,
        f"n_past drifted {where}: its draft block is off by the same "
        f"{k:+d}; the next block starts at pos0 + accepted + 1",
    )


def _constant_offset(observed: tuple[int, ...], expected: tuple[int, ...]) -> int | None:
    """k when observed = expected + k row by row for one k != 0, else None."""
    if len(observed) != len(expected) or not observed:
        return None
    offsets = {o - e for o, e in zip(observed, expected)}
    k = offsets.pop() if len(offsets) == 1 else 0
    return k or None


def _offset_from_ref(batch: Batch, ref_batch: Batch) -> Offset | None:
    k = _constant_offset(batch.positions, ref_batch.positions)
    if k is None:
        return None
    return batch, k, f"the reference's {span(ref_batch.positions)}", _hint(batch)


def _offset_from_flow(batch: Batch, run_batches: dict[GroupKey, Batch]) -> Offset | None:
    role, phase, rnd = batch.key
    if phase == Phase.INJECT:
        carried = _target_before(batch, run_batches)
        if carried is None:
            return None
        k = _constant_offset(batch.positions, carried.positions)
        if k is None:
            return None
        return batch, k, f"those of the target rows it carries, {span(carried.positions)}", _hint(batch)
    start = _expected_start(batch, run_batches)
    if start is None or batch.positions[0] == start:
        return None
    return batch, batch.positions[0] - start, f"a start at {start}", _hint(batch)


def _expected_start(batch: Batch, run_batches: dict[GroupKey, Batch]) -> int | None:
    """Where the flow puts this batch's first row: a verify at its draft block's start; the first
    draft block right after the prefill (n_past = prompt length - 1)."""
    role, phase, rnd = batch.key
    if phase == Phase.VERIFY:
        block = run_batches.get((*ROUND_OPENER, rnd))
        return block.positions[0] if block is not None and block.positions else None
    if phase == Phase.DRAFT and rnd == PREFILL_ROUND + 1:
        prefill = run_batches.get((ROLE_TARGET, Phase.PREFILL, PREFILL_ROUND))
        return max(prefill.positions) + 1 if prefill is not None and prefill.positions else None
    return None


def _target_before(batch: Batch, run_batches: dict[GroupKey, Batch]) -> Batch | None:
    """The target batch an inject batch carries: the last target prefill/verify decoded before it."""
    before = [
        b for b in run_batches.values() if b.key[0] == ROLE_TARGET and b.key[1] in TARGET_PHASES and b.eval < batch.eval
    ]
    return before[-1] if before else None


def _hint(batch: Batch) -> str:
    role, phase, rnd = batch.key
    if phase == Phase.INJECT:
        return "inject rows sit at the positions of the target rows they carry"
    if rnd > 1:
        return f"check n_past after the accept of round {rnd - 1} (the next block starts at pos0 + accepted + 1)"
    return "the first block starts at n_past = the prompt length - 1"


def _position_finding(batch: Batch, k: int, expected: str, hint: str) -> Finding:
    role, phase, rnd = batch.key
    late = (
        "one position late"
        if k == 1
        else "one position early"
        if k == -1
        else f"{abs(k)} positions " + ("late" if k > 0 else "early")
    )
    return Finding.of(
        PositionOffsetFields(offset=k, role=role, phase=Phase(phase), round=rnd, eval=batch.eval),
        tensor=names.INP_POS,
        message=f"positions of {batch.label} are off by {k:+d} ({late}): the run decoded it at "
        f"{span(batch.positions)} where the flow expects {expected}; {hint}",
    )


# --- what the producer inferred ------------------------------------------------------------------


def detect_flow_note(run: Manifest) -> Finding | None:
    """Hypothesis: the run broke the flow's convention where the producer had to infer phases and
    rounds. Evidence: the sentences the producer wrote in the manifest's `flow_notes`."""
    if not run.flow_notes:
        return None
    more = f" ({len(run.flow_notes) - 1} more notes)" if len(run.flow_notes) > 1 else ""
    return Finding.of(
        FlowNoteFields(notes=tuple(run.flow_notes)),
        tensor="flow_notes",
        message=f"the capture inferred the flow from a run that broke its convention: "
        f"{run.flow_notes[0].rstrip('.')}{more}; phases and rounds there may be wrong",
    )
