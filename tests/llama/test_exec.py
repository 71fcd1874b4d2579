"""Capture around unmodified upstream programs (llama-speculative-simple, llama-server) built
from the pinned source: the preload sees every context and decode, the flow's phases come out
right, the program behaves as without featdiff, and compare reads these dumps like any other."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.dump.reader import read_dump
from featdiff.factory import pairs
from featdiff.programs import exec as exec_capture
from featdiff.programs.phases import argmax_notes, derive_rounds, flow_evals, flow_notes, prompt_from_evals
from featdiff.programs.preload import preload, preload_library
from featdiff.programs.run_log import ExecContext, ExecEval, ExecLog

from real_flow import DEFAULT_TOKENS

TOKENS = DEFAULT_TOKENS  # the server request
PROMPT = "The quick brown fox"
SPEC_ARGS = ["--spec-type", "draft-dflash", "--spec-draft-n-max", "3", "-c", "256", "-t", "1", "-td", "1"]
RUN_TIMEOUT_S = 120
FLOW_PHASES = ("prefill", "inject", "draft", "verify")


def _command(tools, program: str, d: Path) -> list[str]:
    cmd = [str(tools.program(program)), "-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf"), *SPEC_ARGS]
    if program == "llama-speculative-simple":
        cmd += ["-p", PROMPT, "-n", "16", "--temp", "0"]
    return cmd


@pytest.fixture(scope="session")
def exec_captured(tmp_path_factory, fixture_models, tools):
    """(program, variant) -> a dump captured around that upstream program (made once)."""
    made: dict[tuple[str, str], Path] = {}

    def get(program: str, variant: str = "clean") -> Path:
        if (program, variant) not in made:
            out = tmp_path_factory.mktemp(f"exec-{program}-{variant}") / "run.npz"
            tokens = TOKENS if program == "llama-server" else None
            made[(program, variant)] = exec_capture.capture_exec(
                _command(tools, program, fixture_models(variant)), out, tokens=tokens, timeout_s=RUN_TIMEOUT_S
            )
        return made[(program, variant)]

    return get


@pytest.fixture(scope="session")
def reference_for(referenced):
    """A run dump -> the reference (trained HF checkpoint) on the tokens and rounds the run decoded."""

    def get(run: Path, variant: str) -> Path:
        with read_dump(run) as dump:
            m = dump.manifest
            drafted = sum(1 for r in m.rounds if r.drafts)  # the reference drafts every round
            tokens = ",".join(map(str, m.prompt_tokens))
        return referenced(variant, target="target-hf", tokens=tokens, rounds=drafted)

    return get


def _real_evals(dump):
    return [e for e in dump.manifest.evals if e.phase != "warmup"]


# ---------------------------------------------------------------- the flow, as the programs ran it


@pytest.mark.parametrize("program", ["llama-speculative-simple", "llama-server"])
def test_capture_holds_both_models_in_the_flow_phases(exec_captured, program):
    B, mask = pairs.BLOCK_SIZE, pairs.MASK_TOKEN_ID
    with read_dump(exec_captured(program)) as dump:
        m = dump.manifest
        evals = _real_evals(dump)
        assert [(e.role, e.phase) for e in evals[:2]] == [("target", "prefill"), ("draft", "inject")]
        assert {r.role for r in m.records} == {"target", "draft"}
        assert {e.phase for e in evals} == set(FLOW_PHASES)
        for rnd in (r for r in m.rounds if r.drafts):
            draft, verify, inject = (e for e in evals if e.round == rnd.round)
            assert (draft.phase, verify.phase, inject.phase) == ("draft", "verify", "inject")
            assert draft.token_ids == (rnd.anchor,) + (mask,) * (B - 1)
            assert draft.positions == tuple(range(rnd.pos0, rnd.pos0 + B))
            assert verify.token_ids == (rnd.anchor, *rnd.drafts) and inject.positions == verify.positions
            assert set(verify.seq_ids) == set(draft.seq_ids)
        for prev, nxt in zip(m.rounds, m.rounds[1:]):
            assert nxt.pos0 == prev.pos0 + prev.accepted + 1 and nxt.anchor == prev.target_tokens[-1]


@pytest.mark.parametrize("program", ["llama-speculative-simple", "llama-server"])
def test_positions_and_tokens_are_what_the_program_decoded(exec_captured, program):
    with read_dump(exec_captured(program)) as dump:
        m = dump.manifest
        prefill = next(e for e in m.evals if e.phase == "prefill")
        assert m.prompt_tokens[:-1] == prefill.token_ids and prefill.positions == tuple(range(prefill.n_tokens))
        for ev in _real_evals(dump):
            pos = next(r for r in m.records if r.eval == ev.eval and r.name == "inp_pos")
            assert tuple(dump.array(pos).reshape(-1)) == ev.positions  # the graph's own positions


def test_server_prompt_is_the_request_plus_its_first_sampled_token(exec_captured):
    with read_dump(exec_captured("llama-server")) as dump:
        m = dump.manifest
        server = m.build["server"]
        assert m.prompt_tokens[:-1] == tuple(int(t) for t in TOKENS.split(","))
        assert m.prompt_tokens[-1] == server["tokens"][0]
        assert server["draft_n"] == sum(len(r.drafts) for r in m.rounds)
        assert server["draft_n_accepted"] == sum(r.accepted for r in m.rounds)


def test_warmup_and_probe_decodes_are_kept_apart(exec_captured):
    with read_dump(exec_captured("llama-speculative-simple")) as dump:
        warm = [e for e in dump.manifest.evals if e.phase == "warmup"]
        first_real = _real_evals(dump)[0].eval
        assert warm and all(e.eval < first_real for e in warm)
        assert any(r.phase == "warmup" for r in dump.manifest.records)


# ---------------------------------------------------------------- compare reads these dumps


def test_speculative_simple_capture_compares_clean_against_the_reference(exec_captured, reference_for):
    from featdiff.diff import compare_dumps

    run = exec_captured("llama-speculative-simple")
    comparison = compare_dumps(reference_for(run, "clean"), run)
    assert comparison.ok, [f.message for f in comparison.findings]


def test_server_capture_compares_clean_against_the_reference(exec_captured, reference_for):
    from featdiff.diff import compare_dumps

    run = exec_captured("llama-server")
    comparison = compare_dumps(reference_for(run, "clean"), run)
    assert comparison.ok, [f.message for f in comparison.findings]


def test_layers_off_by_one_around_llama_server_is_a_layer_offset(exec_captured, reference_for):
    from featdiff.diff import compare_dumps, exit_code

    run = exec_captured("llama-server", "layers-plus1")
    comparison = compare_dumps(reference_for(run, "layers-plus1"), run)
    offsets = [f for f in comparison.findings if f.kind == "layer_offset"]
    assert offsets, [f.message for f in comparison.findings]
    f = offsets[0].to_json()
    assert (f["slot"], f["expected_layer"], f["observed_layer"], f["delta"]) == (0, 2, 3, 1)
    assert exit_code(comparison) == 1


# ---------------------------------------------------------------- the program is left alone


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, timeout=RUN_TIMEOUT_S)


def test_host_program_stdout_and_exit_code_are_the_same_with_the_preload(tools, fixture_models, tmp_path):
    # llama-simple prints with printf: its stdout is exact (the spec tools leak their async logger)
    cmd = [str(tools.program("llama-simple")), "-m", str(fixture_models("clean") / "target.gguf"), "-n", "12", PROMPT]
    prefix = tmp_path / "run.spool"
    plain, captured = _run(cmd), _run(cmd, preload(prefix).environ())
    assert (captured.returncode, captured.stdout) == (plain.returncode, plain.stdout) and plain.returncode == 0
    assert b'"kind":"record"' in Path(f"{prefix}.index").read_bytes()
    missing = [*cmd[:2], str(tmp_path / "missing.gguf"), *cmd[3:]]
    assert _run(missing, preload(tmp_path / "miss.spool").environ()).returncode == _run(missing).returncode != 0


def test_speculative_simple_exit_code_and_output_survive_the_preload(tools, fixture_models, tmp_path):
    cmd = _command(tools, "llama-speculative-simple", fixture_models("clean"))
    plain, captured = _run(cmd), _run(cmd, preload(tmp_path / "run.spool").environ())
    assert captured.returncode == plain.returncode == 0
    # the tool's logger is cut off at exit at a random point: both outputs are prefixes of one text
    shorter, longer = sorted((plain.stdout, captured.stdout), key=len)
    assert len(shorter) > 0 and longer.startswith(shorter)


def test_preload_library_is_compiled_once_and_links_no_llama():
    first = preload_library()
    stamp = first.stat().st_mtime_ns
    assert preload_library() == first and first.stat().st_mtime_ns == stamp
    if shutil.which("ldd"):  # llama/ggml symbols stay undefined: the program's own libraries answer
        assert "libllama" not in subprocess.run(["ldd", str(first)], capture_output=True, text=True).stdout


# ---------------------------------------------------------------- phases from the preload's notes


def _log(evals: list[tuple[int, list[int], list[int]]], clears=(), rc=None) -> ExecLog:
    """A synthetic preload log: evals as (ctx, token_ids, positions); ctx 0 target, 1 draft."""
    ctxs = (ExecContext(0, "target", "qwen3", "T.gguf", True), ExecContext(1, "draft", "dflash", "D.gguf", True))
    rcs = rc or {}
    evs = tuple(
        ExecEval(i, c, tuple(t), tuple(p), (0,) * len(p), (1,) * len(p), rcs.get(i, 0))
        for i, (c, t, p) in enumerate(evals)
    )
    return ExecLog("libllama.so", ctxs, evs, tuple(clears), (), 0)


def test_phases_follow_the_flow_and_warmups_are_set_apart():
    e = -1  # an embedding row
    log = _log(
        [
            (0, [1], [0]),  # warm-up, cleared below
            (0, [5, 6, 7], [0, 1, 2]),  # prefill
            (1, [e, e, e], [0, 1, 2]),  # inject
            (1, [8, 9, 9, 9], [3, 4, 5, 6]),  # draft
            (0, [8, 11, 12, 13], [3, 4, 5, 6]),  # verify
            (1, [e, e, e, e], [3, 4, 5, 6]),  # inject
            (0, [14], [4]),  # verify of no drafts (no budget left to draft)
            (0, [2, 3], [0, 1]),
        ],  # a new request: prefill
        clears=[(0, 0)],
    )
    got = [(ev.phase, ev.round) for ev in flow_evals(log)]
    assert got == [
        ("warmup", 0),
        ("prefill", 0),
        ("inject", 0),
        ("draft", 1),
        ("verify", 1),
        ("inject", 1),
        ("verify", 2),
        ("prefill", 0),  # the sequence's next request: a flow of its own, its rounds counted afresh
    ]
    assert [ev.flow for ev in flow_evals(log)] == [0] * 7 + [1]
    assert prompt_from_evals(flow_evals(log)) == (5, 6, 7, 8)


def test_a_failed_decode_is_not_part_of_the_flow():
    log = _log([(0, [5, 6], [0, 1]), (0, [5, 6], [0, 1])], rc={0: 1})
    assert [ev.phase for ev in flow_evals(log)] == ["warmup", "prefill"]


# ---------------------------------------------------------------- the command line


def test_capture_exec_without_a_command_exits_2(tmp_path):
    result = CliRunner().invoke(app, ["capture", "--exec", "-o", str(tmp_path / "r.npz")])
    assert result.exit_code == 2 and "needs a command after `--`" in result.output


def test_capture_exec_of_a_missing_program_exits_2(tmp_path):
    result = CliRunner().invoke(app, ["capture", "--exec", "-o", str(tmp_path / "r.npz"), "--", "no-such-llama-tool"])
    assert result.exit_code == 2 and "no-such-llama-tool: no such program" in result.output


def test_llama_server_with_both_a_prompt_and_tokens_exits_2(tools, fixture_models, tmp_path):
    cmd = _command(tools, "llama-server", fixture_models("clean"))
    args = ["capture", "--exec", "-o", str(tmp_path / "r.npz"), "--prompt", "hi", "--tokens", "1,2", "--", *cmd]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "give one, not both" in result.output


def test_a_failing_program_exits_2_naming_its_exit_code(tools, tmp_path):
    cmd = [str(tools.program("llama-simple")), "-m", str(tmp_path / "missing.gguf"), "-n", "4", "hi"]
    result = CliRunner().invoke(app, ["capture", "--exec", "-o", str(tmp_path / "r.npz"), "--", *cmd])
    assert result.exit_code == 2 and "exited with code" in result.output
    assert not list(tmp_path.glob("r.npz.spool*"))


def test_flow_notes_name_refused_decodes_and_n_past_drift_but_not_a_new_prompt():
    e = -1  # an embedding row
    log = _log(
        [
            (0, [5, 6, 7], [0, 1, 2]),  # prefill
            (1, [e, e, e], [0, 1, 2]),  # inject
            (1, [8, 9, 9, 9], [3, 4, 5, 6]),  # draft
            (0, [8, 11, 12, 13], [3, 4, 5, 6]),  # verify: the target takes none of the drafts
            (1, [e, e, e, e], [3, 4, 5, 6]),  # inject
            (1, [20, 9, 9, 9], [5, 6, 7, 8]),  # draft, refused below
            (0, [20], [5]),  # verify at 5 = 3 + 1 + 1: n_past one too far
            (0, [2, 3], [0, 1]),
        ],  # a new prompt
        rc={5: -1},
    )
    evals = flow_evals(log)
    greedy = {3: (30, 31, 32, 33)}  # the verify's argmax rows: no draft matches
    rounds = derive_rounds(evals, greedy)
    notes = flow_notes(evals, rounds)
    assert any(n.startswith("eval 5 (drafter's draft, round 2, positions 5..8) failed with rc -1") for n in notes)
    assert not any("outside the verified block" in n for n in notes)  # the prefill at 0 is a new prompt
    # against the target's argmax (a greedy flow's only: programs/pack.py)
    assert [n for n in argmax_notes(evals, rounds, greedy) if "accepted 0 of 3 drafts" in n and "drifted by 1" in n]
    assert flow_notes(flow_evals(_log([(0, [5, 6], [0, 1])])), ()) == ()
