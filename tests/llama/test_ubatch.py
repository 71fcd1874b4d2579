"""A decode computed as several graphs (a batch larger than n_ubatch) becomes one eval per graph."""

from __future__ import annotations

import pytest

from featdiff.dump.records import Eval, MemoryOp
from featdiff.llama.spool_index import RecordEvent
from featdiff.llama.ubatch import chunks, split_ubatches


def _eval(i: int, n: int, role="target", phase="prefill", seqs=None) -> Eval:
    return Eval(
        eval=i,
        role=role,
        phase=phase,
        n_tokens=n,
        positions=tuple(range(n)),
        token_ids=tuple(range(100, 100 + n)),
        seq_ids=tuple(seqs or (0,) * n),
    )


def _record(ev: int, ubatch: int, name: str, occurrence: int = 0, role: str = "target") -> RecordEvent:
    return RecordEvent(eval=ev, role=role, name=name, occurrence=occurrence, op="", ggml_type="f32", ne=(4, 1, 1, 1),
                       nb=(), srcs=(), dtype="float32", offset=0, nbytes=16, ubatch=ubatch)  # fmt: skip


def test_chunks_are_consecutive_rows_of_n_ubatch():
    assert chunks(10, 4) == ((0, 4), (4, 8), (8, 10))
    assert chunks(4, 4) == ((0, 4),)


def test_a_three_graph_prefill_becomes_three_evals_with_their_rows():
    evals = (_eval(0, 10), _eval(1, 10, role="draft", phase="inject"))
    records = (
        _record(0, 0, "l_out-1"),
        _record(0, 1, "l_out-1"),
        _record(0, 2, "l_out-1"),
        _record(1, 0, "inp_target_features", role="draft"),
    )
    split = split_ubatches(evals, records, {0: 4, 1: 10}, (MemoryOp("target", 0, 0, 5, -1),))
    assert [(e.eval, e.ubatch, e.positions[0], e.n_tokens) for e in split.evals] == [
        (0, 0, 0, 4),
        (1, 1, 4, 4),
        (2, 2, 8, 2),
        (3, None, 0, 10),
    ]
    assert split.evals[2].token_ids == (108, 109)
    assert [(r.eval, r.occurrence) for r in split.records] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert split.memory_ops[0].after_eval == 2  # after the call: after its last graph
    assert split.notes == ()


def test_one_graph_per_eval_is_left_as_it_was():
    evals = (_eval(0, 3), _eval(1, 3))
    records = (_record(0, 0, "embd"), _record(1, 0, "embd"))
    split = split_ubatches(evals, records, {0: 512, 1: None})
    assert split.evals == evals
    assert [r.eval for r in split.records] == [0, 1]


def test_a_batch_of_several_sequences_is_kept_whole_and_said_so():
    evals = (_eval(0, 8, seqs=(0,) * 4 + (1,) * 4),)
    records = (_record(0, 0, "embd"), _record(0, 1, "embd"))
    split = split_ubatches(evals, records, {0: 4})
    assert len(split.evals) == 1 and split.evals[0].ubatch is None
    assert [r.occurrence for r in split.records] == [0, 1]  # unique keys: occurrences count on
    assert "2 sequences" in split.notes[0]


def test_an_unknown_n_ubatch_keeps_a_multi_graph_eval_whole():
    split = split_ubatches((_eval(0, 8),), (_record(0, 0, "embd"), _record(0, 1, "embd")), {0: None})
    assert len(split.evals) == 1
    assert "n_ubatch is unknown" in split.notes[0]


def test_more_graphs_than_the_rows_make_is_kept_whole():
    records = tuple(_record(0, u, "embd") for u in range(3))
    split = split_ubatches((_eval(0, 8),), records, {0: 4})
    assert len(split.evals) == 1
    assert "more than its 8 rows" in split.notes[0]


# ---------------------------------------------------------------- real runs


def _long_tokens(n: int) -> str:
    return ",".join(str(7 + (i * 37) % 500) for i in range(n))


def _capture_and_compare(models, tmp_path, tokens: str, run_args: list[str], rounds: int = 3):
    from featdiff.diff import compare_dumps
    from featdiff.driver.capture import capture
    from featdiff.llama.options import parse_run_options

    from real_flow import reference_of

    run = capture(models / "target.gguf", models / "draft.gguf", tmp_path / "run.npz", tokens=tokens, rounds=rounds,
                  options=parse_run_options(run_args))  # fmt: skip
    ref = reference_of(models / "target.gguf", models / "draft-hf", tmp_path / "ref.npz", tokens=tokens,
                       rounds=rounds, run=run)  # fmt: skip
    return run, compare_dumps(ref, run)


def _assert_clean(c):
    errors = [f"{f.kind} at {f.tensor}: {f.message}" for f in c.findings if f.severity == "error"]
    assert c.ok and not errors, errors
    assert c.coverage.pairs_skipped == 0 and c.coverage.rows_skipped == 0, c.coverage.skipped_phrase()


def test_a_prompt_longer_than_ub_4_compares_clean_row_for_row(fixture_models, tmp_path):
    """-ub 4 and an 18-token prompt: the target prefill is computed as 5 graphs and the drafter's
    inject as 5 chunks (common/speculative.cpp); every graph's rows pair with the reference's."""
    from featdiff.dump.reader import read_dump

    run, c = _capture_and_compare(fixture_models("clean"), tmp_path, _long_tokens(18), ["-ub", "4"])
    with read_dump(run) as d:
        prefill = [e for e in d.manifest.evals if e.phase == "prefill"]
        injects = [e for e in d.manifest.evals if e.phase == "inject" and e.round == 0]
        assert [e.n_tokens for e in prefill] == [4, 4, 4, 4, 1]
        assert [e.ubatch for e in prefill] == [0, 1, 2, 3, 4]
        assert [e.n_tokens for e in injects] == [4, 4, 4, 4, 1]
        embd = [r for r in d.manifest.records if r.name == "embd"]
        assert sorted(r.occurrence for r in embd) == [0] * len(embd)  # one per graph
    _assert_clean(c)


def test_a_prompt_longer_than_the_default_ubatch_compares_clean(fixture_models, tmp_path):
    """A 600-token prompt at llama.cpp's default -ub (512): two graphs, two inject chunks."""
    from featdiff.dump.reader import read_dump

    run, c = _capture_and_compare(fixture_models("clean"), tmp_path, _long_tokens(600), [], rounds=2)
    with read_dump(run) as d:
        assert [e.n_tokens for e in d.manifest.evals if e.phase == "prefill"] == [512, 87]
        assert d.manifest.build["n_ubatch"] == 512
    _assert_clean(c)


def test_a_ubatch_smaller_than_the_draft_block_is_refused(fixture_models, tmp_path):
    from featdiff.core.errors import InputError
    from featdiff.driver.capture import capture
    from featdiff.llama.options import parse_run_options

    models = fixture_models("clean")
    with pytest.raises(InputError, match="-ub 2: a draft block of 4 rows must fit one ubatch"):
        capture(models / "target.gguf", models / "draft.gguf", tmp_path / "run.npz", tokens="1,2,3,4,5",
                rounds=1, options=parse_run_options(["-ub", "2"]))  # fmt: skip
    assert not (tmp_path / "run.npz").exists()


# ---------------------------------------------------------------- around the programs

LONG_TEXT = " ".join(f"word{i % 97} and the quick brown fox number {i}" for i in range(90))  # > 600 tokens
SPEC = ["--spec-type", "draft-dflash", "--spec-draft-n-max", "3", "-c", "2048", "-t", "1", "-td", "1"]


def _exec_and_compare(tools, models, tmp_path, program: str, extra: list[str], **capture_kw):
    from featdiff.diff import compare_dumps
    from featdiff.dump.reader import read_dump
    from featdiff.programs import exec as exec_capture

    from real_flow import reference_of

    cmd = [str(tools.program(program)), "-m", str(models / "target.gguf"), "-md", str(models / "draft.gguf"), *SPEC]
    run = exec_capture.capture_exec(cmd + extra, tmp_path / "run.npz", timeout_s=300, **capture_kw)
    with read_dump(run) as d:
        m = d.manifest
        tokens = ",".join(map(str, m.prompt_tokens))
        rounds = sum(1 for r in m.rounds if r.drafts)
        prefill = [e.n_tokens for e in m.evals if e.phase == "prefill"]
    ref = reference_of(models / "target.gguf", models / "draft-hf", tmp_path / "ref.npz", tokens=tokens,
                       rounds=rounds, run=run)  # fmt: skip
    return prefill, compare_dumps(ref, run)


def test_speculative_simple_with_ub_4_compares_clean(tools, fixture_models, tmp_path):
    prefill, c = _exec_and_compare(
        tools, fixture_models("clean"), tmp_path, "llama-speculative-simple",
        ["-ub", "4", "-p", "the quick brown fox jumps over the lazy dog " * 2, "-n", "12", "--temp", "0"],
    )  # fmt: skip
    assert len(prefill) > 1 and max(prefill) == 4
    _assert_clean(c)


def test_speculative_simple_with_a_long_prompt_file_compares_clean(tools, fixture_models, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(LONG_TEXT)
    prefill, c = _exec_and_compare(
        tools, fixture_models("clean"), tmp_path, "llama-speculative-simple",
        ["-f", str(prompt), "-n", "8", "--temp", "0"],
    )  # fmt: skip
    assert prefill[0] == 512 and sum(prefill) > 512
    _assert_clean(c)


def test_speculative_simple_with_a_long_prompt_on_its_command_line_compares_clean(tools, fixture_models, tmp_path):
    """The same long prompt given with -p (an argument of thousands of characters, not a file)."""
    prefill, c = _exec_and_compare(
        tools,
        fixture_models("clean"),
        tmp_path,
        "llama-speculative-simple",
        ["-p", LONG_TEXT, "-n", "8", "--temp", "0"],
    )
    assert prefill[0] == 512 and sum(prefill) > 512
    _assert_clean(c)


def test_llama_server_with_ub_4_compares_clean(tools, fixture_models, tmp_path):
    prefill, c = _exec_and_compare(
        tools,
        fixture_models("clean"),
        tmp_path,
        "llama-server",
        ["-ub", "4"],
        tokens="7,21,3,99,140,5,260,33,18,402,77,9",
    )
    assert len(prefill) > 1 and max(prefill) == 4
    _assert_clean(c)


def test_llama_server_with_a_long_prompt_compares_clean(tools, fixture_models, tmp_path):
    prefill, c = _exec_and_compare(tools, fixture_models("clean"), tmp_path, "llama-server", [], prompt=LONG_TEXT)
    assert prefill[0] == 512 and sum(prefill) > 512
    _assert_clean(c)


def test_an_inject_chunk_reading_the_first_chunks_rows_is_named(tools, fixture_models, tmp_path, monkeypatch):
    """0002-driver-faults.patch `inject-chunk0`: every n_ubatch chunk of a long inject reads chunk
    0's feature rows. With -ub 4 the prompt's inject is 4 chunks; rows 4.. carry rows 0..3: a row
    fault of the first chunk that differs, named at inp_target_features."""
    clean_args = ["-ub", "4", "-p", "the quick brown fox jumps over the lazy dog " * 2, "-n", "8", "--temp", "0"]
    models = fixture_models("clean")
    monkeypatch.setenv("FEATDIFF_FAULT", "inject-chunk0")
    _, c = _exec_and_compare(tools, models, tmp_path, "llama-speculative-simple", clean_args)
    errors = [f for f in c.findings if f.severity == "error"]
    assert errors and errors[0].tensor == "inp_target_features", [(f.kind, f.tensor, f.message) for f in errors]
    assert errors[0].kind == "misplaced_rows", errors[0]
