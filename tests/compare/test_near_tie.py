"""Near-ties: where run and reference choose different tokens on a row whose two candidates the
numerics cannot tell apart, compare says so as information and the rest is still compared; a
parting beyond the noise, or a wiring fault beside the near-tie, stays an error.

The synthetic pair (synth.py) is given the reference's logits: `draft_logits` of each draft block
and `result_output` of each verify, whose argmax is the run's token everywhere except one planted
row, where the reference prefers another token by a chosen margin. The real test runs the
reference (PyTorch, the fixture's HF checkpoint) guided by a run that drafted another token.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from featdiff.core.names import DRAFT_LOGITS, RESULT_OUTPUT
from featdiff.diff import compare_dumps, exit_code
from featdiff.diff.detectors import detect_divergence_by_margin, detect_near_tie
from featdiff.diff.partings import MARGIN_SPREAD, Parting, find_partings
from featdiff.diff.tolerance import TypeInfo, tolerance_for, type_info
from featdiff.dump.reader import read_dump
from featdiff.dump.records import record_key
from featdiff.dump.writer import DumpWriter, record_from_array

import synth

N_VOCAB = 128  # synth.weights' table rows
LOGIT_SCALE = 1.0  # rms of the planted logits rows
F16 = TypeInfo(kv_type="f16", quant_types=(), ref_dtype="float32")
Q8_0 = replace(F16, kv_type="q8_0")
NEAR_TIE_ROUND, NEAR_TIE_ROW = 2, 1  # the planted parting: round 2, draft row 1 (the first draft)
OTHER_TOKEN = 117  # the reference's choice there (never a synth draft: those are 10..59)


def _parting(margin: float, bound: float) -> Parting:
    return Parting("draft", 2, 1, 10, 5, DRAFT_LOGITS, expected=414, observed=181, margin=margin, bound=bound)


# --- the detector ---------------------------------------------------------------------------------


def test_near_tie_found_when_the_margin_is_within_the_bound():
    f = detect_near_tie(_parting(0.01, 0.05))
    assert f is not None and f.kind == "near_tie" and f.severity == "info" and f.tensor == DRAFT_LOGITS
    assert f.fields == {
        "phase": "draft",
        "round": 2,
        "row": 1,
        "position": 10,
        "eval": 5,
        "expected": 414,
        "observed": 181,
        "margin": 0.01,
        "bound": 0.05,
    }
    assert "near-tie at round 2, row 1" in f.message and "0.01 <= noise bound 0.05" in f.message
    assert detect_divergence_by_margin(_parting(0.01, 0.05)) is None


def test_parting_beyond_the_bound_is_no_near_tie_but_a_divergence_by_margin():
    assert detect_near_tie(_parting(0.5, 0.05)) is None
    f = detect_divergence_by_margin(_parting(0.5, 0.05))
    assert f is not None and f.kind == "divergence" and f.severity == "error"
    assert (f.fields["metric"], f.fields["value"], f.fields["tolerance"]) == ("margin", 0.5, 0.05)


def test_a_margin_at_the_bound_is_still_a_near_tie():
    assert detect_near_tie(_parting(0.05, 0.05)) is not None


# --- the synthetic pair ---------------------------------------------------------------------------


def _row(token: int, rng: np.random.Generator, margin: float | None = None, other: int = OTHER_TOKEN) -> np.ndarray:
    """A logits row (N_VOCAB,) of rms ~LOGIT_SCALE whose argmax is `token`; with `margin`, `other`
    beats `token` by exactly that much."""
    row = 0.5 * LOGIT_SCALE * rng.standard_normal(N_VOCAB)
    row[token] = 3.0 * LOGIT_SCALE
    if margin is not None:
        row[other] = row[token] + margin
    return row.astype(np.float32)


def _with_logits(src: Path, dst: Path, margin: float | None, sign: float = 1.0) -> Path:
    """The synthetic dump `src` plus its `draft_logits` and verify `result_output`: the argmax of
    each row is the run's token (synth's rounds), except draft row NEAR_TIE_ROW of round
    NEAR_TIE_ROUND, where OTHER_TOKEN leads by `margin` (None: no parting); `sign` -1 (the run's
    side): OTHER_TOKEN trails by it there, so the run's logits choose the run's token."""
    rng = np.random.default_rng(7)
    with read_dump(src) as dump:
        m = dump.manifest
        rounds = {r.round: r for r in m.rounds}
        writer = DumpWriter(dst)
        for r in dump.records():
            writer.add(r, np.array(dump.array(r)))
        for ev in m.evals:
            if ev.phase not in ("draft", "verify"):
                continue
            rnd = rounds[ev.round]
            if ev.phase == "draft":  # row 0 is the anchor's; row 1 + i drafts drafts[i] (DFlash)
                tokens = (synth.MASK, *rnd.drafts)
                planted = {NEAR_TIE_ROW: sign * margin} if ev.round == NEAR_TIE_ROUND and margin is not None else {}
                rows = [_row(t, rng, planted.get(i)) for i, t in enumerate(tokens)]
                name = DRAFT_LOGITS
            else:  # the target takes target_tokens, then anything
                tokens = (*rnd.target_tokens, *(synth.MASK,) * (ev.n_tokens - len(rnd.target_tokens)))
                rows = [_row(t, rng) for t in tokens[: ev.n_tokens]]
                name = RESULT_OUTPUT
            record, array = record_from_array(
                record_key(ev.eval, ev.role, name, 0), ev.role, ev.phase, ev.eval, name, 0, np.stack(rows)
            )  # (n_tokens, N_VOCAB)
            writer.add(record, array)
        return writer.close(replace(m, records=()))


def _q8_0(build: dict | None = None) -> dict:
    """A run build with q8_0 K/V caches (docs/dump.md `build.kv_types`)."""
    q8 = {"k": "q8_0", "v": "q8_0"}
    return {**(build or {}), "kv_types": {"target": q8, "draft": q8}}


def _bound(ref: Path, run: Path) -> float:
    with read_dump(ref) as r, read_dump(run) as u:
        return MARGIN_SPREAD * tolerance_for(DRAFT_LOGITS, False, type_info(r.manifest, u.manifest)).rel


@pytest.fixture
def near_tie_pair(synth_ref, synth_run, tmp_path):
    """`near_tie_pair(fraction, run_sign, **run_kwargs)`: (ref, run) with the parting's margin at
    `fraction` of the noise bound of a q8_0 run (rms of the row ~LOGIT_SCALE); the run's logits
    there flipped (`run_sign` -1: its token wins on its own logits) or the reference's (+1: the run
    drafted a token its own logits do not choose, a driver fault)."""

    def make(fraction: float, run_sign: float = -1.0, **run_kwargs) -> tuple[Path, Path]:
        run = synth_run(build=_q8_0(), **run_kwargs)
        with read_dump(run) as d:
            m = d.manifest
        bound = MARGIN_SPREAD * tolerance_for(DRAFT_LOGITS, False, type_info(m, m)).rel * LOGIT_SCALE
        ref = _with_logits(synth_ref, tmp_path / f"ref-{fraction}.npz", fraction * bound)
        return ref, _with_logits(run, tmp_path / f"run-{fraction}.npz", fraction * bound, sign=run_sign)

    return make


def test_q8_0_near_tie_compares_clean_with_the_near_tie_as_information(near_tie_pair):
    ref, run = near_tie_pair(0.3)
    c = compare_dumps(ref, run)
    assert exit_code(c) == 0, [f.message for f in c.findings]
    (f,) = [f for f in c.findings if f.kind == "near_tie"]
    assert f.severity == "info" and f.tensor == DRAFT_LOGITS
    assert (f.fields["round"], f.fields["row"], f.fields["phase"]) == (NEAR_TIE_ROUND, NEAR_TIE_ROW, "draft")
    assert f.fields["expected"] == OTHER_TOKEN and f.fields["observed"] != OTHER_TOKEN
    assert 0 < f.fields["margin"] <= f.fields["bound"]
    assert f.fields["position"] == 10 and f.fields["eval"] == 5  # round 2's block starts at 9; eval 5 is its draft
    assert f"near-tie at round {NEAR_TIE_ROUND}, row {NEAR_TIE_ROW}" in f.message


def test_the_same_parting_under_an_f16_bound_is_an_error(near_tie_pair, synth_ref, synth_run, tmp_path):
    """A margin within q8_0's noise but beyond f16's: the bound follows the run's KV type. (The
    f16 run's logits are the reference's: its token is not their argmax, so the draft was not
    sampled from its own row: wrong_source another_row_sampled, in the driver.)"""
    ref, q8_run = near_tie_pair(0.3)
    margin = 0.3 * _bound(ref, q8_run) * LOGIT_SCALE
    f16_run = _with_logits(synth_run(), tmp_path / "f16-run.npz", margin)
    assert _bound(ref, f16_run) * LOGIT_SCALE < 0.3 * _bound(ref, q8_run) * LOGIT_SCALE
    c = compare_dumps(ref, f16_run)
    assert exit_code(c) == 1
    (f,) = [f for f in c.findings if f.severity == "error"]
    assert (f.kind, f.fields["source"], f.fields["where"]) == ("wrong_source", "another_row_sampled", "driver")
    assert f"round {NEAR_TIE_ROUND}, row {NEAR_TIE_ROW}" in f.message


def test_a_parting_well_outside_the_noise_stays_an_error(near_tie_pair):
    ref, run = near_tie_pair(20.0, run_sign=1.0)  # the run's logits agree: its token does not
    c = compare_dumps(ref, run)
    assert exit_code(c) == 1
    assert not [f for f in c.findings if f.kind == "near_tie"]
    (f,) = [f for f in c.findings if f.severity == "error"]
    # the run's own row puts the reference's token first: the draft came from elsewhere (the driver)
    assert (f.kind, f.tensor, f.fields["source"]) == ("wrong_source", DRAFT_LOGITS, "another_row_sampled")
    assert f"put token {OTHER_TOKEN} first (the reference's argmax too)" in f.message


def test_a_parting_the_runs_own_logits_make_is_a_divergence_by_margin(near_tie_pair):
    """The run's logits flipped with its token (it chose what its own row puts first), beyond the
    noise from the reference's: the numbers part, not the driver's choice."""
    ref, run = near_tie_pair(20.0, run_sign=-1.0)
    c = compare_dumps(ref, run)
    errors = [f for f in c.findings if f.severity == "error" and f.tensor == DRAFT_LOGITS]
    assert errors and not [f for f in errors if f.fields.get("source") == "another_row_sampled"], [
        f.message for f in errors
    ]


def test_a_row_shift_beside_a_near_tie_is_still_named(near_tie_pair):
    def shifted(ev, name, a):  # the first inject's feature rows one row late: the anchor row dropped
        return np.roll(a, -1, axis=0) if (ev.eval, name) == (1, "inp_target_features") else a

    ref, run = near_tie_pair(0.3, mutate=shifted)
    c = compare_dumps(ref, run)
    assert exit_code(c) == 1
    errors = [f for f in c.findings if f.severity == "error"]
    assert errors[0].kind == "row_shift" and errors[0].fields["shift"] == 1
    assert [f.kind for f in c.findings if f.kind == "near_tie"] == ["near_tie"]


def test_no_parting_no_finding(synth_ref, synth_run, tmp_path):
    ref = _with_logits(synth_ref, tmp_path / "ref.npz", None)
    c = compare_dumps(ref, _with_logits(synth_run(build=_q8_0()), tmp_path / "run.npz", None))
    assert exit_code(c) == 0 and not [f for f in c.findings if f.kind in ("near_tie", "divergence")]


def test_partings_stop_where_a_reference_that_decided_itself_parts(synth_ref, tmp_path):
    """A reference that did not follow the run (other drafts in round 1) pairs no later round:
    only round 1 is read."""
    ref = _with_logits(synth_ref, tmp_path / "ref.npz", 0.01)
    with read_dump(ref) as d:
        m = d.manifest
        read = d.array
        own = replace(m.rounds[0], drafts=(OTHER_TOKEN, *m.rounds[0].drafts[1:]))
        run = replace(m, rounds=(own, *m.rounds[1:]), source="llama.cpp")
        partings = find_partings(m, read, run, Q8_0)
    assert [(p.phase, p.round, p.row, p.expected, p.observed) for p in partings] == [
        ("draft", 1, 1, m.rounds[0].drafts[0], OTHER_TOKEN)
    ]
    assert partings[0].margin > partings[0].bound  # the planted near-tie of round 2 is never reached


# --- the reference, guided by a run (`reference --run`) -------------------------------------------


def test_reference_guided_by_a_run_decodes_the_run_tokens_after_a_parting(fixture_models, tmp_path):
    """A run that drafted another first token in round 1 and accepted none: the reference given
    it (`--run`) verifies the run's drafts, keeps its accept, and goes on from where the run went;
    compare reads the parting from the reference's own logits, with its margin."""
    from real_flow import DEFAULT_TOKENS, reference_of
    from transform import rewrite

    d = fixture_models("clean")
    kw = {"tokens": DEFAULT_TOKENS, "rounds": 2}
    own = reference_of(d / "target-hf", d / "draft-hf", tmp_path / "own.npz", **kw)
    with read_dump(own) as dump:
        first = dump.manifest.rounds[0]
    other = next(t for t in range(3, 500) if t not in first.drafts)
    parted = replace(first, drafts=(other, *first.drafts[1:]), accepted=0, target_tokens=first.target_tokens[:1])
    run = rewrite(own, tmp_path / "run.npz", rounds=(parted,))  # the run's decisions; its records do not matter

    guided = reference_of(d / "target-hf", d / "draft-hf", tmp_path / "guided.npz", run=run, **kw)
    with read_dump(guided) as g, read_dump(run) as r:
        rounds = g.manifest.rounds
        assert (rounds[0].drafts, rounds[0].accepted) == (parted.drafts, 0)
        assert (rounds[1].pos0, rounds[1].anchor) == (first.pos0 + 1, first.target_tokens[0])
        partings = find_partings(g.manifest, g.array, r.manifest, F16)
    assert [(p.phase, p.round, p.row, p.expected, p.observed) for p in partings] == [
        ("draft", 1, 1, first.drafts[0], other)
    ]
    assert partings[0].margin > 0 and partings[0].bound > 0
