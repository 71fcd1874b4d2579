"""Where the run's tokens part from the reference's own greedy choice, and by how much.

Consumes the reference's logits records (`draft_logits` of each draft block, `result_output` of
each verify) and the run's rounds (its drafts and its target argmax tokens); produces one
`Parting` per round whose tokens the reference would not have chosen, on rows both sides
computed from the same tokens. A reference that follows the run (`reference --follow`, or
`--run`, which follows from a parting on: torchref/rounds.py) pairs every round; one that decided
its own tokens pairs up to the first parting. The margin is judged against the noise bound
`tolerance_for` gives that record, scaled to the row's logits (MARGIN_SPREAD).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from featdiff.core import names
from featdiff.core.blocks import first_draft_row
from featdiff.core.phases import CHOOSING_PHASES, Phase
from featdiff.diff.tolerance import TypeInfo, tolerance_for
from featdiff.dump.manifest import Manifest
from featdiff.dump.records import Eval, Record, Round
from featdiff.dump.sampling import Sampler, could_draw

Reader = Callable[[Record], np.ndarray]  # a record's array (compare.evidence.Source.array)

# A margin is the difference of two logits, each off from the reference by up to the tolerated
# relative error of its row (tolerance.py: rms(run - ref) <= rel * rms(ref)); independent errors
# on the two add in quadrature: sqrt(2) * rel * rms(ref row).
MARGIN_SPREAD = math.sqrt(2.0)


@dataclass(frozen=True)
class Parting:
    """One row where the run's token is not the reference's argmax, both computed alike."""

    phase: Phase  # a draft (a drafted token) or a verify (the target's argmax): CHOOSING_PHASES
    round: int
    row: int  # the row of the batch the token was chosen on
    position: int  # that row's position
    eval: int  # the run's eval of that batch; -1 when the run manifest has none
    tensor: str  # the reference record whose row was read
    expected: int  # the reference's argmax
    observed: int  # the run's token
    margin: float  # ref logit(expected) - ref logit(observed), on that row
    bound: float  # the noise bound on that margin
    # a draft block whose drafts are all the reference's argmax read from another first row (the
    # other DSpark reading: plain DFlash's row after the anchor, or anchor-first's row 0): that row
    other_first_row: int | None = None
    # the sampler of a run that sampled its target's tokens (Sampler.describe), whose chain could
    # not draw `observed` from the reference's row; "" when the run chose greedily
    sampler: str = ""
    # a greedy verify whose run kept drafts past the one the target rejected (`observed` is that
    # draft) and decoded the target's own token (`expected`) that many rows later: n_past moved
    # past the accept (kept_past rows); 0 otherwise
    kept_past: int = 0
    # the stages of a sampled run's chain featdiff does not compute (Sampler.unmodelled): the
    # choice is not judged, and says so (an info finding); () otherwise
    unmodelled: tuple[str, ...] = ()
    # a draft row: the token the run's own `draft_logits` row (the logits its sampler read back for
    # that row) puts first, and by how much over `observed` there (inf: `observed` was not among
    # them); None where the run recorded no such row
    own_choice: int | None = None
    own_margin: float = 0.0

    @property
    def is_near_tie(self) -> bool:
        return self.margin <= self.bound


def find_partings(
    ref: Manifest, read: Reader, run: Manifest, types: TypeInfo, read_run: Reader | None = None
) -> tuple[Parting, ...]:
    """The first parting of each round's draft block and of its verify, in flow order, while
    the two sides' rounds start alike and the reference decoded the run's tokens. `read` reads
    the reference's records, `read_run` the run's (a draft parting then says what the run's own
    row put first: `Parting.own_choice`)."""
    if ref.prompt_tokens != run.prompt_tokens:
        return ()
    ref_rounds = {r.round: r for r in ref.rounds}
    ref_evals = {(e.phase, e.round): e for e in ref.evals if e.phase in CHOOSING_PHASES}
    run_evals: dict[tuple[str, int], int] = {
        (e.phase, e.round): e.eval for e in run.evals if e.phase in CHOOSING_PHASES
    }
    first = next((row for row in map(_first_draft_row, (ref, run)) if row is not None), 1)
    sampler = run.sampler(run.flow_ids()[0])
    found: list[Parting] = []
    for rr in run.rounds:
        rf = ref_rounds.get(rr.round)
        if rf is None or (rf.pos0, rf.anchor) != (rr.pos0, rr.anchor):
            break
        for parting in (
            _draft_parting(ref, read, ref_evals.get((Phase.DRAFT, rr.round)), rr, first, types),
            _verify_parting(ref, read, ref_evals.get((Phase.VERIFY, rr.round)), rr, rf, types, sampler),
        ):
            if parting is not None:
                found.append(_own_choice(_at_run_eval(parting, run_evals), run, read_run))
        if (rf.drafts, rf.accepted) != (rr.drafts, rr.accepted):
            break  # the reference decided otherwise and did not follow: later rounds share no history
    return tuple(found)


def _first_draft_row(m: Manifest) -> int | None:
    """The block row the first draft is read from, as the manifest's drafter says; None: unknown."""
    draft = m.model("draft")
    if draft is None or not draft.architecture:
        return None
    dspark = draft.dspark
    return first_draft_row(dspark is not None, bool(dspark and dspark.get("sample_from_anchor", True)))


def _at_run_eval(p: Parting, run_evals: dict[tuple[str, int], int]) -> Parting:
    return replace(p, eval=run_evals.get((p.phase, p.round), -1))


def _own_choice(p: Parting, run: Manifest, read_run: Reader | None) -> Parting:
    """A draft parting with what the run's own read-back row of that draft (`draft_logits` of the
    run's eval, the same rows as the reference's) put first."""
    if p.phase != Phase.DRAFT or p.eval < 0 or read_run is None:
        return p
    ev = next((e for e in run.evals if e.eval == p.eval), None)
    logits = _logits(run, read_run, ev, names.DRAFT_LOGITS)
    if logits is None or p.row >= len(logits) or not np.isfinite(logits[p.row]).any():
        return p
    row = logits[p.row]
    own = int(np.argmax(row))
    observed = row[p.observed] if 0 <= p.observed < len(row) else -math.inf
    margin = float(row[own] - observed) if np.isfinite(observed) else math.inf
    return replace(p, own_choice=own, own_margin=margin)


def _logits(ref: Manifest, read: Reader, ev: Eval | None, name: str) -> np.ndarray | None:
    """The reference's `name` record of eval `ev` as (rows, n_vocab), or None."""
    if ev is None:
        return None
    record = next((r for r in ref.records if r.eval == ev.eval and r.name == name), None)
    if record is None:
        return None
    a = np.asarray(read(record), dtype=np.float64)
    return a.reshape(-1, a.shape[-1]) if a.ndim >= 1 and a.size else None  # (rows, n_vocab)


def _draft_parting(
    ref: Manifest, read: Reader, ev: Eval | None, rr: Round, first: int, types: TypeInfo
) -> Parting | None:
    """The first draft of the run's block that is not the reference's argmax on its row. Only
    the first: a DSpark row's logits depend on the token drafted before it (the Markov head)."""
    logits = _logits(ref, read, ev, names.DRAFT_LOGITS)
    if logits is None or ev is None:
        return None
    for i, token in enumerate(rr.drafts):
        row = first + i
        if row >= len(logits):
            break
        p = _parting(Phase.DRAFT, rr.round, row, ev.positions[row], names.DRAFT_LOGITS, logits[row], token, types)
        if p is not None:
            return replace(p, other_first_row=_read_from(logits, rr.drafts, 1 - first))
    return None


def _read_from(logits: np.ndarray, drafts: tuple[int, ...], row: int) -> int | None:
    """`row` when every draft is the argmax of `logits` (rows, n_vocab) read from that row on."""
    if row < 0 or not drafts or row + len(drafts) > len(logits):
        return None
    read = tuple(int(t) for t in np.argmax(logits[row : row + len(drafts)], axis=-1))
    return row if read == tuple(drafts) else None


def _verify_parting(
    ref: Manifest, read: Reader, ev: Eval | None, rr: Round, rf: Round, types: TypeInfo, sampler: Sampler | None
) -> Parting | None:
    """The first row of the run's verify whose target token (`target_tokens`) is not the
    reference's argmax, among the rows both verified after the same drafts; where the run
    sampled (`sampler`), the first whose token its sampler could not draw (`sampled_parting`)."""
    logits = _logits(ref, read, ev, names.RESULT_OUTPUT)
    if logits is None or ev is None:
        return None
    shared = next(
        (k for k, (a, b) in enumerate(zip(rr.drafts, rf.drafts)) if a != b), min(len(rr.drafts), len(rf.drafts))
    )
    for j, token in enumerate(rr.target_tokens[: min(shared + 1, len(logits))]):
        p = _parting(Phase.VERIFY, rr.round, j, ev.positions[j], names.RESULT_OUTPUT, logits[j], token, types)
        p = p if sampler is None or p is None else sampled_parting(p, logits[j], sampler)
        if p is not None:
            return replace(p, kept_past=_kept_past(rr, j, p.expected)) if sampler is None else p
    return None


def _kept_past(rr: Round, row: int, expected: int) -> int:
    """How many rows past `row` the run's round `rr` kept, where its token on `row` is the draft
    there and the reference's argmax (`expected`) comes as the token after the kept drafts: the
    run's n_past moved past what its target accepted and it decoded the target's token late. 0
    when the run's tokens say otherwise."""
    kept = rr.accepted - row
    if row >= len(rr.drafts) or kept < 1 or len(rr.target_tokens) <= rr.accepted:
        return 0
    return kept if rr.target_tokens[row] == rr.drafts[row] and rr.target_tokens[rr.accepted] == expected else 0


def sampled_parting(p: Parting, logits: np.ndarray, sampler: Sampler) -> Parting | None:
    """A sampled choice judged as a sample: None when the run's token is one its sampler could draw
    from the reference's row `logits` (n_vocab,), its logit raised by the noise bound on a margin
    (sampling.could_draw); the parting marked not judged (`unmodelled`) when the chain has a stage
    featdiff does not compute (penalties, ...: `Sampler.unmodelled`); else the parting, naming the
    sampler."""
    if sampler.unmodelled:
        return replace(p, sampler=sampler.describe(), unmodelled=sampler.unmodelled)
    if could_draw(logits, p.observed, sampler, p.bound):
        return None
    return replace(p, sampler=sampler.describe())


def _parting(
    phase: Phase, rnd: int, row: int, position: int, tensor: str, logits: np.ndarray, token: int, types: TypeInfo
) -> Parting | None:
    """A Parting when `token` is not the argmax of the reference's row `logits` (n_vocab,)."""
    expected = int(np.argmax(logits))
    if token == expected:
        return None
    observed_logit = logits[token] if 0 <= token < len(logits) else -math.inf
    margin = float(logits[expected] - observed_logit) if np.isfinite(observed_logit) else math.inf
    finite = logits[np.isfinite(logits)]  # a reduced vocabulary's rows are -inf off its tokens
    rms = float(np.sqrt(np.mean(finite * finite))) if finite.size else 0.0
    bound = MARGIN_SPREAD * tolerance_for(tensor, False, types).rel * rms
    return Parting(phase, rnd, row, position, -1, tensor, expected, int(token), margin, bound)
