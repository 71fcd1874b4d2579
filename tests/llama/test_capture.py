"""Real captures through the pinned llama.cpp build: what the drafter receives is what the
target computed, staged the way upstream stages it."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from featdiff.dump.reader import read_dump
from featdiff.factory import pairs

from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS

GOLDEN = Path(__file__).parent / "golden" / "clean_records.jsonl"


def _records(dump, eval_index, name):
    return [r for r in dump.manifest.records if r.eval == eval_index and r.name == name]


def _one(dump, eval_index, name):
    recs = _records(dump, eval_index, name)
    assert len(recs) == 1, f"eval {eval_index}: {len(recs)} records named {name}"
    return dump.array(recs[0])


def _layer_input(dump, target_eval, layer):
    """What llama.cpp taps as the input of target layer `layer`: l_out-(layer-1), embd for 0."""
    return _one(dump, target_eval, "embd" if layer == 0 else f"l_out-{layer - 1}")


@pytest.mark.parametrize("variant", ["clean", "own-embd"])
def test_feature_slot_k_is_bitwise_the_input_of_target_layer_k(captured, variant):
    with read_dump(captured(variant)) as dump:
        layers = dump.manifest.models["draft"]["target_layers"]
        n_embd = dump.manifest.models["target"]["n_embd"]
        injects = [e for e in dump.manifest.evals if e.phase == "inject"]
        assert len(injects) == 1 + len(dump.manifest.rounds)
        for ev in injects:
            feats = _one(dump, ev.eval, "inp_target_features")  # (n_tokens, n_extract * n_embd)
            assert feats.shape == (ev.n_tokens, len(layers) * n_embd)
            source = dump.manifest.evals[ev.eval - 1]
            assert source.role == "target" and source.positions == ev.positions
            for k, layer in enumerate(layers):
                tapped = _layer_input(dump, source.eval, layer)
                for row in range(ev.n_tokens):
                    assert np.array_equal(feats[row, k * n_embd : (k + 1) * n_embd], tapped[row]), (ev.eval, k, row)


def test_injected_kv_has_one_row_per_context_token(captured):
    s = pairs.DRAFT
    with read_dump(captured("clean")) as dump:
        for ev in (e for e in dump.manifest.evals if e.phase == "inject"):
            for il in range(s.n_layer):
                for name in (f"Kcur_injected-{il}", f"Vcur_injected-{il}"):
                    assert _one(dump, ev.eval, name).shape == (ev.n_tokens, s.n_head_kv, s.n_embd_head)


@pytest.mark.parametrize("variant, table_from", [("clean", "target.gguf"), ("own-embd", "draft.gguf")])
def test_noise_rows_are_the_embedding_rows_of_the_block_tokens(captured, fixture_models, variant, table_from):
    reader = GGUFReader(str(fixture_models(variant) / table_from))
    table = np.array(next(t for t in reader.tensors if t.name == "token_embd.weight").data)  # (n_vocab, n_embd)
    with read_dump(captured(variant)) as dump:
        drafts = [e for e in dump.manifest.evals if e.phase == "draft"]
        assert drafts
        for ev in drafts:
            assert ev.token_ids[1:] == (pairs.MASK_TOKEN_ID,) * (pairs.BLOCK_SIZE - 1)
            assert np.array_equal(_one(dump, ev.eval, "inp_noise_embd"), table[list(ev.token_ids)])


def test_flow_follows_upstream_positions_and_rounds(captured):
    B = pairs.BLOCK_SIZE
    with read_dump(captured("clean")) as dump:
        m = dump.manifest
        assert [(e.role, e.phase) for e in m.evals[:2]] == [("target", "prefill"), ("draft", "inject")]
        assert m.evals[0].positions == tuple(range(len(m.prompt_tokens) - 1))
        for rnd in m.rounds:
            draft, verify, inject = (e for e in m.evals if e.round == rnd.round)
            assert draft.positions == verify.positions == inject.positions == tuple(range(rnd.pos0, rnd.pos0 + B))
            assert verify.token_ids == (rnd.anchor, *rnd.drafts)
            assert len(rnd.drafts) == B - 1 and 0 <= rnd.accepted <= B - 1
        for prev, nxt in zip(m.rounds, m.rounds[1:]):
            assert nxt.pos0 == prev.pos0 + prev.accepted + 1
            assert nxt.anchor == prev.target_tokens[-1]


def test_capture_record_list_matches_golden(captured):
    with read_dump(captured("clean")) as dump:
        got = [
            json.dumps([r.eval, r.role, r.phase, r.name, r.occurrence, list(r.shape), r.dtype])
            for r in dump.manifest.records
        ]
    if os.environ.get("FEATDIFF_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text("\n".join(got) + "\n")
    assert got == GOLDEN.read_text().splitlines()


def test_filters_select_by_role_and_exclude(captured):
    with read_dump(captured("clean", filters=("draft:Qcur-*", "target:l_out-1", "!Qcur-1"))) as dump:
        names = {(r.role, r.name) for r in dump.manifest.records}
    assert names == {("draft", "Qcur-0"), ("target", "l_out-1")}


def test_an_exclusion_can_name_a_role():
    from featdiff.core.filters import ROLE_IDS, capture_filters

    globs = capture_filters(["l_out-*", "!target:l_out-0"]).shim_globs()
    target, draft = globs[ROLE_IDS["target"]], globs[ROLE_IDS["draft"]]
    assert "!l_out-0" in target and "!l_out-0" not in draft and "l_out-*" in draft


BINDING_COMPILES = "compiling the llama.cpp binding"  # featdiff.llama.binding's log line when it compiles
PAUSE_AFTER_ROUND = 3  # the paused capture below holds still once this many rounds are in its spool
PAUSED_ROUNDS = 20  # what it was asked for: more than it ever gets to, so it cannot finish first
PAUSED = "paused"  # the line the paused capture prints on stdout, then waits for a signal
PAUSE_WAIT_S = 600  # a safety net against a hang only: the test waits on the line, never on a clock
# The child runs `featdiff capture` (cli.main: its signal handlers and exit codes) with the
# progress callback that the capture calls once per round replaced by one that stops the capture,
# in Python, between two rounds: whatever it is sent then lands at a known state.
_PAUSED_CAPTURE = """
import contextlib, sys, time
from featdiff.core import progress
from featdiff.cli import main

@contextlib.contextmanager
def steps(total, what):
    done = [0]
    def step():
        done[0] += 1
        if what == "rounds" and done[0] == {pause}:
            print("{paused}", flush=True)
            while True:
                time.sleep(3600)
    yield step

progress.steps = steps
sys.argv = ["featdiff", *sys.argv[1:]]
main()
"""


def _stderr_of(out: Path) -> Path:
    return out.with_name(out.name + ".stderr.txt")


def _paused_capture(d: Path, out: Path) -> subprocess.Popen:
    """A real capture of every node (`--filter '*'`) in a child process, returned once it has
    spooled PAUSE_AFTER_ROUND rounds and holds there (it cannot finish): a signal sent to it now
    finds the same state on every run."""
    code = _PAUSED_CAPTURE.format(pause=PAUSE_AFTER_ROUND, paused=PAUSED)
    args = ["capture", "--target", str(d / "target.gguf"), "--model", str(d / "draft.gguf"), "--tokens", "1,2,3,4"]
    args += ["--rounds", str(PAUSED_ROUNDS), "--filter", "*", "-o", str(out)]
    with _stderr_of(out).open("w") as err:  # a file: a pipe nobody reads while it waits could fill
        proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=err, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], PAUSE_WAIT_S)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != PAUSED:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the capture did not pause after round {PAUSE_AFTER_ROUND} (exit {proc.returncode}): "
                    f"{_stderr_of(out).read_text()[-2000:]}")  # fmt: skip
    index = out.with_name(out.name + ".spool.index")  # the shim writes each line through: all there now
    evals = [line for line in index.read_text().splitlines() if json.loads(line)["kind"] == "eval"]
    assert len(evals) == 2 + 3 * PAUSE_AFTER_ROUND  # prefill, inject, then draft, verify, inject a round
    return proc


def test_killed_capture_packs_into_a_dump_of_its_complete_records(fixture_models, tmp_path):
    out = tmp_path / "run.npz"
    proc = _paused_capture(fixture_models("clean"), out)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL and not out.exists()
    from typer.testing import CliRunner

    from featdiff.cli import app

    result = CliRunner().invoke(app, ["pack", str(tmp_path / "run.npz.spool"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    with read_dump(out) as dump:
        assert len(dump.manifest.evals) == 2 + 3 * PAUSE_AFTER_ROUND and len(dump.manifest.records) > 100
        for r in dump.manifest.records:
            assert dump.array(r).shape == r.shape


def test_second_capture_reuses_the_compiled_binding(fixture_models, tmp_path):
    """The second load finds the module the first compiled (or found) and compiles nothing: the
    same file, not rewritten (a recompile renames a new file into place: a new inode and mtime)."""
    code = (
        "import logging, os; logging.basicConfig(level=logging.INFO); "
        "from featdiff.llama import binding; m, b = binding.load(); s = os.stat(m.__file__); "
        "print(m.__file__, s.st_ino, s.st_mtime_ns)"
    )
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert first.stdout.strip() and first.stdout == second.stdout
    assert BINDING_COMPILES not in second.stderr


def test_interrupted_capture_still_writes_a_readable_dump(fixture_models, tmp_path):
    out = tmp_path / "run.npz"
    proc = _paused_capture(fixture_models("clean"), out)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    proc.communicate(timeout=PAUSE_WAIT_S)  # a hang is a failure, never a pass
    err = _stderr_of(out).read_text()
    assert proc.returncode == 130 and "interrupted by SIGINT" in err, err[-2000:]
    with read_dump(out) as dump:
        assert len(dump.manifest.evals) == 2 + 3 * PAUSE_AFTER_ROUND and len(dump.manifest.records) > 100
        assert [r.round for r in dump.manifest.rounds] == list(range(1, PAUSE_AFTER_ROUND + 1))
    assert not out.with_name("run.npz.spool.index").exists()


# --- the block length follows --draft-max, as llama.cpp's --spec-draft-n-max ------------------


@pytest.fixture(scope="module")
def run_draft_max_2(fixture_models, tmp_path_factory) -> Path:
    """A capture of the clean pair with 2 drafts per block: 3-row draft blocks."""
    from featdiff.driver.capture import capture

    d = fixture_models("clean")
    return capture(
        d / "target.gguf",
        d / "draft.gguf",
        tmp_path_factory.mktemp("draft-max-2") / "run.npz",
        tokens=DEFAULT_TOKENS,
        rounds=DEFAULT_ROUNDS,
        draft_max=2,
    )


def test_draft_max_sets_the_block_to_the_anchor_and_n_masks(run_draft_max_2):
    with read_dump(run_draft_max_2) as dump:
        m = dump.manifest
        assert m.build["draft_max"] == 2
        for rnd in m.rounds:
            draft, verify, inject = (e for e in m.evals if e.round == rnd.round)
            assert draft.token_ids == (rnd.anchor, pairs.MASK_TOKEN_ID, pairs.MASK_TOKEN_ID)
            assert draft.positions == verify.positions == inject.positions == tuple(range(rnd.pos0, rnd.pos0 + 3))
            assert len(rnd.drafts) == 2 and verify.token_ids == (rnd.anchor, *rnd.drafts)


def test_draft_max_beyond_the_block_size_is_clamped_with_a_warning(fixture_models, tmp_path, caplog):
    from featdiff.driver.capture import capture

    d = fixture_models("clean")
    with caplog.at_level("WARNING", logger="featdiff"):
        out = capture(
            d / "target.gguf", d / "draft.gguf", tmp_path / "run.npz", tokens="1,2,3,4", rounds=1, draft_max=9
        )
    assert "--draft-max 9 exceeds the trained block size (dflash.block_size = 4); clamping to 3" in caplog.text
    with read_dump(out) as dump:
        assert dump.manifest.build["draft_max"] == pairs.BLOCK_SIZE - 1
        assert [e.n_tokens for e in dump.manifest.evals if e.phase == "draft"] == [pairs.BLOCK_SIZE]


def test_reference_of_the_runs_block_length_compares_clean(run_draft_max_2, fixture_models, tmp_path):
    from typer.testing import CliRunner

    from featdiff.cli import app
    from featdiff.diff import compare_dumps, exit_code

    d, ref = fixture_models("clean"), tmp_path / "ref.npz"
    result = CliRunner().invoke(
        app,
        [
            "reference",
            "--target",
            str(d / "target.gguf"),
            "--model",
            str(d / "draft-hf"),
            "--tokens",
            DEFAULT_TOKENS,
            "--rounds",
            str(DEFAULT_ROUNDS),
            "--run",
            str(run_draft_max_2),
            "-o",
            str(ref),
        ],
    )
    assert result.exit_code == 0, result.output
    with read_dump(ref) as dump:
        assert dump.manifest.build["block_rows"] == 3
        assert {e.n_tokens for e in dump.manifest.evals if e.phase == "draft"} == {3}
    comparison = compare_dumps(ref, run_draft_max_2)
    assert exit_code(comparison) == 0, [f.message for f in comparison.findings]
    assert comparison.coverage.pairs > 0 and comparison.coverage.pairs_skipped == 0


def test_a_reference_of_longer_blocks_names_the_block_length(run_draft_max_2, referenced):
    from featdiff.diff import compare_dumps, exit_code

    comparison = compare_dumps(referenced("clean"), run_draft_max_2)  # llama.cpp's default: 4-row blocks
    assert exit_code(comparison) == 1
    first = next(f for f in comparison.findings if f.severity == "error")
    assert first.kind == "block_token" and first.tensor == "inp_noise_embd"
    assert "has 3 rows where the reference's has 4" in first.message
    assert "--spec-draft-n-max + 1 rows" in first.message


def _rewritten(src: Path, dst: Path, **edits) -> Path:
    """tests/reference/conftest.py's GGUF rewriter (a crafted broken drafter)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "reference_conftest", Path(__file__).parents[1] / "reference" / "conftest.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.rewrite_gguf(src, dst, **edits)


@pytest.mark.parametrize("what", ["mask", "fc"])
def test_a_pair_llama_cpp_would_misrun_is_refused_before_it_loads(fixture_models, tmp_path, what):
    """The pre-flight (lint's run checks): a mask token outside the vocabulary made the first draft
    decode fail (exit 3 before); both refusals are one line, exit 2, and leave no spool."""
    from gguf import GGUFValueType
    from typer.testing import CliRunner

    from featdiff.cli import app

    d = fixture_models("clean")
    edits = (
        {"set_keys": {"tokenizer.ggml.mask_token_id": (100000, GGUFValueType.UINT32)}}
        if what == "mask"
        else {"replace_tensors": {"fc.weight": np.ones((64, 192), np.float32)}}
    )
    broken = _rewritten(d / "draft.gguf", tmp_path / "D.gguf", **edits)
    out = tmp_path / "run.npz"
    result = CliRunner().invoke(
        app,
        ["capture", "--target", str(d / "target.gguf"), "--model", str(broken), "--tokens", "1,2,3,4", "-o", str(out)],
    )
    assert result.exit_code == 2, result.output
    assert f"{broken}: " in result.output and ("mask_token_id" if what == "mask" else "fc.weight") in result.output
    assert not out.exists() and not list(tmp_path.glob("run.npz.spool*"))


def test_role_ids_are_the_shims():
    """Python numbers the roles by their order in names.ROLES; the shim's header enum must agree
    (read through the compiled binding, so a change on either side fails here)."""
    from featdiff.core.filters import ROLE_IDS
    from featdiff.llama.runtime import Runtime

    lib = Runtime.load().lib
    assert (ROLE_IDS["target"], ROLE_IDS["draft"]) == (lib.FD_ROLE_TARGET, lib.FD_ROLE_DRAFT)
