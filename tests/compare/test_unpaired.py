"""Nothing is skipped silently: a run whose wiring records cannot pair with the reference's (the
draft block without its anchor, one position late, rounds one side lacks, another prompt) fails
with the finding that says why, and the coverage says what was and was not compared."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.diff import compare_dumps, exit_code, verdict
from featdiff.diff.result import (
    ERROR_SKIPS,
    EXPECTED_SKIPS,
    EXPLAINABLE_SKIPS,
    INFO_SKIPS,
    QUIET_SKIPS,
    SKIP_REASONS,
)
from featdiff.dump.reader import read_dump
from featdiff.dump.records import record_key
from featdiff.dump.writer import DumpWriter, record_from_array

import synth
from transform import rewrite

FIRST_DRAFT = 2  # the draft eval of round 1 (synth.flow)


def run_with(tmp_path, name: str, eval_fn=None, array_fn=None, **manifest_fields):
    """A clean synthetic run, its evals passed through `eval_fn` and arrays through `array_fn`."""
    run = synth.write(tmp_path / "clean-run.npz", side="run")
    with read_dump(run) as d:
        evals = tuple(eval_fn(e) if eval_fn else e for e in d.manifest.evals)
    return rewrite(run, tmp_path / name, array_fn, evals=evals, **manifest_fields)


def compare_json(ref, run) -> tuple[int, dict]:
    result = CliRunner().invoke(app, ["compare", str(ref), str(run), "--json", "-"])
    return result.exit_code, json.loads(result.stdout)


def errors(data: dict) -> list[dict]:
    return [f for f in data["findings"] if f["severity"] == "error"]


def _anchorless(e):
    return replace(e, token_ids=(synth.MASK,) * e.n_tokens) if e.eval == FIRST_DRAFT else e


def _embedded_anchorless(r, a):
    """inp_noise_embd of the anchorless block: the mask row's embedding in every row."""
    if r.name == "inp_noise_embd" and r.eval == FIRST_DRAFT:
        return synth.weights(synth.Spec()).draft_emb[[synth.MASK] * a.shape[0]].astype(np.float32)  # (B, n_embd)
    return a


def test_draft_block_without_its_anchor_fails_with_block_token_then_unpaired(synth_ref, tmp_path):
    run = run_with(tmp_path, "anchorless.npz", _anchorless, _embedded_anchorless)
    code, data = compare_json(synth_ref, run)
    assert code == 1 and data["ok"] is False
    first = data["findings"][0]
    assert (first["kind"], first["row"], first["expected"], first["observed"], first["round"]) == (
        "block_token",
        0,
        synth.Spec().prompt[-1],
        synth.MASK,
        1,
    )
    unpaired = next(f for f in data["findings"] if f["kind"] == "unpaired")
    assert unpaired["reason"] == "token_history" and unpaired["tensor"] == "inp_noise_embd"
    assert unpaired["rows"] == [7, 8, 9, 10] and unpaired["round"] == 1
    skipped = [s for s in data["coverage"]["skipped"] if s["name"] == "inp_noise_embd" and s["round"] == 1]
    assert skipped and skipped[0]["reason"] == "token_history" and skipped[0]["whole"] is True


def test_draft_block_one_position_late_fails_with_position_offset(synth_ref, tmp_path):
    def late(e):
        return replace(e, positions=tuple(p + 1 for p in e.positions)) if e.eval == FIRST_DRAFT else e

    code, data = compare_json(synth_ref, run_with(tmp_path, "late.npz", late))
    assert code == 1
    first = data["findings"][0]
    assert (first["kind"], first["offset"], first["phase"], first["round"], first["eval"]) == (
        "position_offset",
        1,
        "draft",
        1,
        FIRST_DRAFT,
    )
    reasons = {f["reason"] for f in data["findings"] if f["kind"] == "unpaired"}
    assert reasons <= {"token_history", "position"} and reasons


def test_unpaired_rows_alone_are_an_error(synth_ref, tmp_path):
    """Another token history that no finding explains still fails: an OK never rests on it."""

    def other_drafts(e):
        return replace(e, token_ids=(e.token_ids[0], 77, 78, 79)) if e.phase == "verify" and e.round == 1 else e

    c = compare_dumps(synth_ref, run_with(tmp_path, "other.npz", other_drafts), None)
    (f,) = [f for f in c.findings if f.severity == "error"]
    assert (f.kind, f.fields["reason"], f.fields["phase"], f.fields["round"]) == (
        "unpaired",
        "token_history",
        "verify",
        1,
    )
    assert f.fields["rows"] == [8, 9, 10] and "the verify batch of round 1" in f.message
    assert exit_code(c) == 1 and verdict(c).endswith("; 11 record sets skipped, 71 rows left out")
    assert (c.coverage.pairs_skipped, c.coverage.rows_skipped) == (11, 71)


def test_a_round_the_reference_lacks_says_how_to_rerun_it(synth_ref, tmp_path):
    run = synth.write(tmp_path / "run3.npz", side="run", spec=synth.Spec(rounds=3))
    c = compare_dumps(synth_ref, run, None)
    f = next(f for f in c.findings if f.kind == "unpaired")
    assert (f.severity, f.fields["reason"], f.fields["side"], f.fields["round"]) == ("error", "missing_eval", "run", 3)
    assert "the reference has no draft eval of round 3" in f.message
    assert "rerun `featdiff reference` with --rounds 3" in f.message


def test_a_round_the_run_lacks_says_so(tmp_path, synth_run):
    ref = synth.write(tmp_path / "ref3.npz", spec=synth.Spec(rounds=3))
    c = compare_dumps(ref, synth_run(), None)
    f = next(f for f in c.findings if f.kind == "unpaired")
    assert (f.severity, f.fields["reason"], f.fields["side"], f.fields["round"]) == ("error", "missing_eval", "ref", 3)
    assert "the run has no draft eval of round 3" in f.message and "--rounds 3" in f.message


def test_another_prompt_is_said_first(synth_ref, tmp_path):
    prompt = synth.Spec().prompt
    c = compare_dumps(synth_ref, run_with(tmp_path, "prompt.npz", prompt_tokens=prompt[:2] + (11,) + prompt[3:]), None)
    f = c.findings[0]
    assert (f.kind, f.severity, f.fields["reason"], f.fields["row"]) == ("unpaired", "error", "prompt", 2)


def test_flow_notes_alone_do_not_let_the_verdict_be_ok(synth_ref, tmp_path):
    note = "eval 5: the drafter decoded a token batch while a draft awaited its verify; taken as a new round"
    c = compare_dumps(synth_ref, run_with(tmp_path, "notes.npz", flow_notes=(note,)), None)
    f = next(f for f in c.findings if f.kind == "flow_note")
    assert f.severity == "error" and not c.ok and note.rstrip(".") in f.message


def test_flow_notes_are_info_when_another_error_explains_the_run(synth_ref, tmp_path):
    run = run_with(tmp_path, "notes.npz", _anchorless, flow_notes=("a note",))
    c = compare_dumps(synth_ref, run, None)
    assert next(f for f in c.findings if f.kind == "flow_note").severity == "info"
    assert c.findings[0].kind == "block_token"


def test_stale_draft_cache_from_memory_ops_fails_the_run(synth_ref, tmp_path):
    from featdiff.dump.records import MemoryOp

    ops = (MemoryOp("draft", FIRST_DRAFT, 0, 7, -1),)  # the accept of round 1 never removes 9..10
    c = compare_dumps(synth_ref, run_with(tmp_path, "stale.npz", memory_ops=ops), None)
    f = next(f for f in c.findings if f.severity == "error")
    assert (f.kind, f.fields["rows"], f.fields["round"]) == ("stale", [9, 10], 2)


def test_the_server_prefill_row_is_an_expected_skip(tmp_path):
    """llama-server's prefill outputs its last row; the reference's outputs none: info, still OK."""

    def with_prefill_logits(side: str, rows: int):
        path = synth.write(tmp_path / f"{side}.npz", side=side)
        w = DumpWriter(tmp_path / f"{side}-logits.npz")
        with read_dump(path) as d:
            for r in d.records():
                w.add(r, np.array(d.array(r)))
            rec, arr = record_from_array(
                record_key(0, "target", "result_output", 0),
                "target",
                "prefill",
                0,
                "result_output",
                0,
                np.ones((rows, 16), np.float32),
            )
            w.add(rec, arr)
            return w.close(d.manifest)

    c = compare_dumps(with_prefill_logits("ref", 0), with_prefill_logits("run", 1), None)
    assert c.ok and exit_code(c) == 0
    (skip,) = c.coverage.skips
    assert (skip.reason, skip.side, skip.is_expected, skip.name) == ("no_rows", "run", True, "result_output")
    info = next(f for f in c.findings if f.kind == "unpaired")
    assert info.severity == "info" and info.fields["reason"] == "no_rows"
    assert verdict(c).endswith("; 0 skipped (1 record set left out as expected: no_rows)")
    assert (c.coverage.pairs_skipped, c.coverage.rows_skipped) == (0, 0)


def test_clean_pair_compares_everything(synth_ref, synth_run):
    c = compare_dumps(synth_ref, synth_run(), None)
    assert c.ok and c.coverage.skips == () and c.coverage.pairs == len(c.pairs)
    assert c.coverage.rows == sum(len(a.positions) for a in c.alignments) > 0
    assert not any(f.kind in ("unpaired", "block_token", "duplicate_rows", "flow_note") for f in c.findings)


def test_a_verify_cut_short_by_the_length_budget_is_an_expected_skip(synth_ref, tmp_path):
    """llama.cpp drafts no more tokens than are left to generate: the last verify (and its
    inject) may be a prefix of the reference's. Info, and the rows that exist are compared."""
    last_verify, last_inject = 6, 7  # round 2 (synth.flow)

    def shorter(e):
        if e.eval not in (last_verify, last_inject):
            return e
        return replace(e, n_tokens=3, positions=e.positions[:3], token_ids=e.token_ids[:3], seq_ids=e.seq_ids[:3])

    run = run_with(tmp_path, "short.npz", shorter, lambda r, a: a[:3] if r.eval in (last_verify, last_inject) else a)
    c = compare_dumps(synth_ref, run, None)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]
    skips = [s for s in c.coverage.skips if s.round == 2]
    assert skips and all(s.reason == "fewer_drafts" and s.rows == (12,) and not s.whole for s in skips)
    f = next(f for f in c.findings if f.kind == "unpaired")
    assert (f.severity, f.fields["reason"]) == ("info", "fewer_drafts")
    assert "verified fewer drafts than the reference in round 2" in f.message


def test_dumps_of_other_prompts_that_share_nothing_say_so_and_exit_2(synth_ref, tmp_path):
    def other_tokens(e):
        return replace(e, token_ids=tuple(t + 1 for t in e.token_ids))

    prompt = tuple(t + 1 for t in synth.Spec().prompt)
    run = run_with(tmp_path, "other-prompt.npz", other_tokens, prompt_tokens=prompt)
    result = CliRunner().invoke(app, ["compare", str(synth_ref), str(run)])
    assert result.exit_code == 2
    assert (
        "the run decoded another prompt than the reference: they differ at token 0 (run 6, reference 5" in result.output
    )


def test_each_skip_reason_is_judged_one_way():
    """Every skip reason is in exactly one class (result.py, one home): an error another error
    finding may explain, always an error, expected with an info line, or expected and quiet."""
    classes = (EXPLAINABLE_SKIPS, ERROR_SKIPS, INFO_SKIPS, QUIET_SKIPS)
    assert sorted(r for c in classes for r in c) == sorted(SKIP_REASONS)
    assert EXPECTED_SKIPS == INFO_SKIPS + QUIET_SKIPS


def _two_flows(src, dst, second=None):
    """`src`'s one flow served twice, on sequences 0 and 1, one after the other: flow 1's evals
    and records follow flow 0's; `second(eval)` rewrites each eval of flow 1 (None: as it was),
    and a flow-1 eval with rc != 0 keeps no record (llama.cpp refused the batch)."""
    from featdiff.dump.records import FlowInfo

    with read_dump(src) as d:
        m = d.manifest
        n = len(m.evals)
        again = [replace(e, eval=e.eval + n, flow=1, seq_ids=(1,) * len(e.seq_ids)) for e in m.evals]
        again = [second(e) if second else e for e in again]
        refused = {e.eval for e in again if e.rc != 0}
        writer = DumpWriter(dst)
        for r in d.records():
            a = np.array(d.array(r))
            writer.add(r, a)
            if r.eval + n not in refused:
                writer.add(replace(r, eval=r.eval + n, key=record_key(r.eval + n, r.role, r.name, r.occurrence)), a)
        flows = (FlowInfo(0, 0, m.prompt_tokens), FlowInfo(1, 1, m.prompt_tokens))
        rounds = m.rounds + tuple(replace(r, flow=1) for r in m.rounds)
        return writer.close(replace(m, evals=m.evals + tuple(again), records=(), rounds=rounds, flows=flows))


def test_a_flow_whose_request_failed_is_named_as_information_and_the_other_flow_is_judged(synth_ref, tmp_path):
    ref = _two_flows(synth_ref, tmp_path / "ref2.npz")
    run = _two_flows(synth.write(tmp_path / "run.npz", side="run"), tmp_path / "run2.npz", lambda e: replace(e, rc=-1))
    c = compare_dumps(ref, run, None)
    notes = [f for f in c.findings if f.kind == "flow_note"]
    assert len(notes) == 1 and notes[0].severity == "info" and notes[0].fields["flow"] == 1, c.findings
    assert "llama.cpp refused" in notes[0].message and "the request failed" in notes[0].message
    assert c.ok and not [f for f in c.findings if f.severity == "error"]
    with read_dump(run) as d:
        assert c.pairs and max(p.eval for p in c.pairs) < len(d.manifest.evals) // 2  # flow 0's evals only
    twice = _two_flows(synth.write(tmp_path / "again.npz", side="run"), tmp_path / "again2.npz")
    both = compare_dumps(ref, twice, None)  # both flows paired: both judged, nothing set aside
    assert both.ok and not [f for f in both.findings if f.kind == "flow_note"] and len(both.pairs) == 2 * len(c.pairs)
