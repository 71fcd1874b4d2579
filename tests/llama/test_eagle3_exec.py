"""EAGLE3 around unmodified upstream programs (issue 32): llama-speculative-simple and
llama-server with `--spec-type draft-eagle3` under the preload. The drafter context is told by its
arch (featdiff.kinds), its encoder calls placed at the rows they encode, the decoder batch that
outputs nothing taken as the inject and the seed and steps as one round's draft; the dump compares
clean against the reference that follows it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from featdiff.diff import compare_dumps
from featdiff.dump.reader import read_dump
from featdiff.programs import exec as exec_capture
from featdiff.programs.phases import flow_evals, prompt_from_evals, with_encoder_rows
from featdiff.programs.run_log import ExecContext, ExecEval, ExecLog
from featdiff.torchref.kind import reference

TOKENS = "7,21,3,99,140,5,260,33,18,402,77,9"
SPEC_ARGS = ["--spec-type", "draft-eagle3", "--spec-draft-n-max", "3", "-c", "256", "-t", "1", "-td", "1"]
RUN_TIMEOUT_S = 120


def test_eagle3_phases_from_the_preloads_notes():
    """Prefill, the encoder at placeholder positions in sequence 0, the decoder batch that outputs
    nothing, the seed and two steps, the verify, and the next process."""
    e = -1  # an embedding row
    ctxs = (ExecContext(0, "target", "qwen3", "T.gguf", True), ExecContext(1, "draft", "eagle3", "D.gguf", True))
    calls = [
        (0, [5, 6, 7], [0, 1, 2], 2, [0, 0, 0], "decode"),  # prefill of sequence 2
        (1, [e, e, e], [0, 1, 2], 0, [1, 1, 1], "encode"),  # encoder: placeholders, sequence 0
        (1, [6, 7], [0, 1], 2, [0, 0], "decode"),  # decoder: (t+1, g t), no output
        (1, [8], [2], 2, [1], "decode"),  # seed: id_last at the pending position
        (1, [9], [3], 2, [1], "decode"),  # step 1
        (1, [10], [4], 2, [1], "decode"),  # step 2
        (0, [8, 9, 10, 11], [3, 4, 5, 6], 2, [1, 1, 1, 1], "decode"),  # verify
        (1, [e, e, e, e], [3, 4, 5, 6], 0, [1, 1, 1, 1], "encode"),
        (1, [9, 10, 11], [3, 4, 5], 2, [0, 0, 0], "decode"),
    ]
    evs = tuple(
        ExecEval(i, c, tuple(t), tuple(p), (s,) * len(p), tuple(o), 0, call)
        for i, (c, t, p, s, o, call) in enumerate(calls)
    )
    got = flow_evals(with_encoder_rows(ExecLog("libllama.so", ctxs, evs, (), (), 0)))
    assert [(ev.phase, ev.round) for ev in got] == [
        ("prefill", 0),
        ("inject", 0),
        ("inject", 0),
        ("draft", 1),
        ("draft", 1),  # a step: the round stays open until its verify
        ("draft", 1),
        ("verify", 1),
        ("inject", 1),
        ("inject", 1),
    ]
    assert got[1].positions == (0, 1, 2) and got[1].seq_ids == (2, 2, 2)  # the rows it encodes
    assert got[7].positions == (3, 4, 5, 6) and got[7].call == "encode"
    assert {ev.flow for ev in got} == {0}
    assert prompt_from_evals(got) == (5, 6, 7, 8)


@pytest.fixture(scope="module")
def pair(eagle3_pairs) -> Path:
    return eagle3_pairs("eagle3")


@pytest.mark.slow
@pytest.mark.parametrize("n_predict", [16, 11])
def test_a_correct_eagle3_run_compares_clean_against_a_reference_of_its_tokens(tools, pair, n_predict, tmp_path):
    """Issue 42, item 3: -n cuts the run's last verify short; the reference made from the run's
    prompt and drafted rounds (not --follow) pairs every one-token draft step by its token history."""
    cmd = _command(tools, "llama-speculative-simple", pair)
    cmd[cmd.index("-n") + 1] = str(n_predict)
    run = exec_capture.capture_exec(cmd, tmp_path / "run.npz", timeout_s=RUN_TIMEOUT_S)
    import featdiff_process

    featdiff_process.compares_clean_against_its_tokens(
        run, pair / "target.gguf", pair / "draft.gguf", tmp_path / "ref.npz"
    )


def _command(tools, program: str, d: Path) -> list[str]:
    cmd = [str(tools.program(program)), "-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf"), *SPEC_ARGS]
    if program == "llama-speculative-simple":
        cmd += ["-p", "The quick brown fox", "-n", "16", "--temp", "0"]
    return cmd


@pytest.mark.slow
@pytest.mark.parametrize("program", ["llama-speculative-simple", "llama-server"])
def test_eagle3_around_the_program_compares_clean(tools, pair, program, tmp_path):
    tokens = TOKENS if program == "llama-server" else None
    run = exec_capture.capture_exec(
        _command(tools, program, pair), tmp_path / "run.npz", tokens=tokens, timeout_s=RUN_TIMEOUT_S
    )
    with read_dump(run) as dump:
        m = dump.manifest
    assert m.models["draft"]["architecture"] == "eagle3"
    assert m.rounds and any(r.drafts for r in m.rounds)
    assert {e.phase for e in m.evals} >= {"prefill", "inject", "draft", "verify"}
    assert any(r.name == "fc_out" for r in m.records) and any(r.name == "eagle3_prenorm-0" for r in m.records)
    ref = reference(
        pair / "target.gguf", pair / "draft.gguf", tmp_path / "ref.npz", prompt=None, tokens=None, rounds=0,
        dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None, follow=run,
    )  # fmt: skip
    c = compare_dumps(ref, run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]
    expected = (
        "a warm-up or probe decode",
        "output no rows",
    )  # llama-server samples its prefill's last row; the reference outputs none
    unexpected = [s for s in c.skipped if not any(e in s for e in expected)]
    assert not unexpected, unexpected


@pytest.fixture(scope="module")
def planted(tools, pair, tmp_path_factory):
    """FEATDIFF_FAULT -> a dump around llama-speculative-simple of the patched build (None: none)."""
    made: dict[str | None, Path] = {}

    def get(fault: str | None, variant_dir: Path | None = None) -> Path:
        d = variant_dir or pair
        key = (fault, str(d))
        if key not in made:
            out = tmp_path_factory.mktemp(f"eagle3-{fault or 'none'}") / "run.npz"
            with pytest.MonkeyPatch.context() as mp:
                if fault:
                    mp.setenv("FEATDIFF_FAULT", fault)
                else:
                    mp.delenv("FEATDIFF_FAULT", raising=False)
                made[key] = exec_capture.capture_exec(
                    _command(tools, "llama-speculative-simple", d), out, timeout_s=RUN_TIMEOUT_S
                )
        return made[key]

    return get


def _first_error(ref: Path, run: Path):
    c = compare_dumps(ref, run)
    return next(f for f in c.findings if f.severity == "error")


def _user_reference(run: Path, d: Path, tmp_path: Path) -> Path:
    """The reference a user makes of the (planted) run: its prompt, rounds and drafts, followed
    (compare refuses a reference that followed another run: diff/provenance.py)."""
    return reference(
        d / "target.gguf", d / "draft.gguf", tmp_path / "ref.npz", prompt=None, tokens=None, rounds=0,
        dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None, follow=run,
    )  # fmt: skip


@pytest.mark.slow
def test_eagle3_token_paired_with_its_own_row_is_a_row_shift(planted, pair, tmp_path):
    run = planted("eagle3-no-shift")
    first = _first_error(_user_reference(run, pair, tmp_path), run)
    assert (first.kind, first.tensor) == ("row_shift", "inp_embd"), first.message
    assert first.fields["shift"] == -1


@pytest.mark.slow
def test_eagle3_slots_staged_in_reverse_are_a_slot_permutation(planted, pair, tmp_path):
    run = planted("slots-reversed")
    first = _first_error(_user_reference(run, pair, tmp_path), run)
    assert first.kind == "slot_permutation", first.message
    assert first.fields["permutation"] == [2, 1, 0]


@pytest.mark.slow
def test_eagle3_layers_tapped_one_deeper_are_a_layer_offset(planted, eagle3_pairs, tmp_path):
    d = eagle3_pairs("eagle3-default-layers")  # [2, 3, 3]
    run = planted("layers-plus1", d)
    first = _first_error(_user_reference(run, d, tmp_path), run)
    assert first.kind == "layer_offset", first.message
    assert first.fields["observed_layers"] == [3, 4, 4] and "eagle3.target_layers" in first.message


@pytest.mark.slow
@pytest.mark.parametrize("backend_sampling", [True, False])
def test_two_slots_at_once_and_the_backend_samplers_read_back(tools, pair, backend_sampling, tmp_path):
    """Two requests at once on two slots: each decode is split per sequence, the encoder's rows
    with them. With the draft's backend sampling (llama.cpp's default) the pinned build samples
    both slots' draft steps from one slot's candidates, though its graph computed each row right:
    named at draft_logits of the other flow, the flow it read from clean. Sampling on the CPU, both
    flows compare clean."""
    import featdiff_process

    command = [*_command(tools, "llama-server", pair), "-np", "2"]
    command += [] if backend_sampling else ["--no-spec-draft-backend-sampling"]
    proc, out, err, port = featdiff_process.capture_server(command, tmp_path, 2, RUN_TIMEOUT_S)
    featdiff_process.complete_together(port, ["hello world and more words", "The quick brown fox"], 24, RUN_TIMEOUT_S)
    assert proc.wait(timeout=RUN_TIMEOUT_S) == 0, err.read_text()[-3000:]
    c = featdiff_process.two_flows_compared(pair / "target.gguf", pair / "draft.gguf", out, tmp_path)
    errors = [f for f in c.findings if f.severity == "error"]
    check = subprocess.run(
        [*featdiff_process.FEATDIFF, "check", "--target", pair / "target.gguf", "--model", pair / "draft.gguf", "--run", out],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert check.returncode == (1 if backend_sampling else 0), check.stdout[-3000:] + check.stderr[-2000:]
    if not backend_sampling:
        assert not errors, [f.message for f in errors]
        return
    assert len(errors) == 1, [f.message for f in errors]
    (e,) = errors
    assert (e.kind, e.tensor, e.fields["source"]) == ("wrong_source", "draft_logits", "another_output_row"), e.message
    assert e.message.startswith("flow ")  # one flow's drafts read the other's; that flow compares clean


@pytest.mark.slow
def test_probe_through_the_server_agrees_with_the_reference_on_the_trained_drafter(tools, eagle3_pairs):
    """`probe --exec` of llama-server with the trained EAGLE3 drafter, one request per prompt:
    the run accepts what the reference drafter accepts at the same places (its block: the run's
    longest verify, the drafts being one decode each)."""
    from featdiff.verdict.probe import probe

    d = eagle3_pairs("trained-eagle3")
    result = probe(
        d / "target.gguf", d / "draft.gguf", prompts=d / "prompts.txt", ref_target=d / "target.gguf",
        ref_model=d / "draft.gguf", command=_command(tools, "llama-server", d),
    )  # fmt: skip
    assert result.run.accepted > 0 and not result.has_gap, [(p.label, p.run, p.ref) for p in result.prompts]
