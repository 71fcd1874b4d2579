"""Hostile inputs to the producers' pre-flight (featdiff.kinds.preflight.preflight), the bound on
a flow's positions (featdiff.core.blocks) and the `--filter` parser: crafted drafter GGUFs, files that
are no GGUF, runaway `--rounds` and a typo of a role. Each is refused with one line and exit 2
before llama.cpp or the reference starts, and `featdiff lint` names each GGUF's problem."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFValueType
from typer.testing import CliRunner

from featdiff.cli import EXIT_FINDINGS, EXIT_INPUT, app
from featdiff.core import names
from featdiff.core.blocks import MAX_BLOCK_SIZE, block_size_problem, check_rounds_fit, flow_positions
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import read_gguf, trained_context
from featdiff.kinds.preflight import preflight
from featdiff.torchref.dflash import run as reference_run
from featdiff.verdict.lint import lint_gguf

runner = CliRunner()
CLI = [sys.executable, "-c", "from featdiff.cli import main; main()"]
PROCESS_TIMEOUT_S = 300  # a guard against a hang, not a measurement: a refusal takes about a second
TOKENS = "1,2,3"
RUNAWAY_ROUNDS = 1_000_000_000


def _rewrite_gguf():
    """tests/reference/conftest.py's GGUF rewriter, as tests/llama/test_capture.py loads it."""
    path = Path(__file__).parents[1] / "reference" / "conftest.py"
    spec = importlib.util.spec_from_file_location("reference_conftest", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.rewrite_gguf


def _set_key(key: str, value, vtype: GGUFValueType) -> dict:
    return {"drop_keys": (key,), "set_keys": {key: (value, vtype)}}


CRAFTED = {
    # name: (rewrite arguments of the clean drafter, text of the problem)
    "block-size-0": (_set_key(names.KEY_BLOCK_SIZE, 0, GGUFValueType.UINT32), "dflash.block_size = 0 leaves no row"),
    "block-size-1": (_set_key(names.KEY_BLOCK_SIZE, 1, GGUFValueType.UINT32), "dflash.block_size = 1 leaves no row"),
    "block-size-100000": (
        _set_key(names.KEY_BLOCK_SIZE, 100000, GGUFValueType.UINT32),
        f"dflash.block_size = 100000 is more rows than llama.cpp's draft batch holds in one ubatch "
        f"(n_ubatch {MAX_BLOCK_SIZE}",
    ),
    "layer-id-huge": (
        _set_key(names.KEY_TARGET_LAYERS, [2, 1_000_000], GGUFValueType.ARRAY),
        "dflash.target_layers = [2, 1000000] but the target has 6 layers",
    ),
    "layer-id-negative": (
        _set_key(names.KEY_TARGET_LAYERS, [-1, 4], GGUFValueType.ARRAY),
        "dflash.target_layers = [-1, 4] has negative ids",
    ),
    "no-mask-token": ({"drop_keys": (names.KEY_MASK_TOKEN,)}, "tokenizer.ggml.mask_token_id is missing"),
}


def _unreadable(kind: str, good: Path, dst: Path) -> Path:
    """A file that is no GGUF (`text`) or a GGUF cut off inside its tensor data (`truncated`)."""
    if kind == "text":
        dst.write_text("not a model\n")
    else:
        data = good.read_bytes()
        dst.write_bytes(data[: len(data) * 2 // 3])
    return dst


def _capture(target: Path, model: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """`featdiff capture` in-process mode, in a process of its own: an abort of llama.cpp shows
    as a signal there instead of killing the test session."""
    cmd = [*CLI, "capture", "--target", str(target), "--model", str(model), "--tokens", TOKENS, "--rounds", "1"]
    return subprocess.run([*cmd, "-o", str(out), *extra], capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)


def _assert_refused(done: subprocess.CompletedProcess, names_file: Path, tmp_path: Path, out: Path) -> None:
    """Exit 2 (not a signal), one line naming the file, nothing written beside the output."""
    assert done.returncode == EXIT_INPUT, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{names_file}: " in lines[0], done.stderr
    assert not out.exists() and not list(tmp_path.glob(f"{out.name}.spool*")), sorted(tmp_path.iterdir())


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_capture_refuses_a_crafted_drafter_before_llama_cpp_loads_it(case, fixture_models, tmp_path):
    edits, expected = CRAFTED[case]
    d = fixture_models("clean")
    broken = _rewrite_gguf()(d / "draft.gguf", tmp_path / "D.gguf", **edits)
    out = tmp_path / "run.npz"
    done = _capture(d / "target.gguf", broken, out)
    _assert_refused(done, broken, tmp_path, out)
    assert expected in done.stderr


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_lint_names_the_problem_of_a_crafted_drafter(case, fixture_models, tmp_path):
    edits, expected = CRAFTED[case]
    d = fixture_models("clean")
    broken = _rewrite_gguf()(d / "draft.gguf", tmp_path / "D.gguf", **edits)
    result = runner.invoke(app, ["lint", str(broken), "--target", str(d / "target.gguf")])
    assert result.exit_code == EXIT_FINDINGS, result.output
    assert f"{broken}: " in result.output and expected in result.output


@pytest.mark.parametrize("kind", ["text", "truncated"])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_capture_refuses_a_file_that_is_no_gguf_naming_it(kind, role, fixture_models, tmp_path):
    d = fixture_models("clean")
    files = {"target": d / "target.gguf", "draft": d / "draft.gguf"}
    files[role] = _unreadable(kind, files[role], tmp_path / f"{role}.gguf")
    out = tmp_path / "run.npz"
    done = _capture(files["target"], files["draft"], out)
    _assert_refused(done, files[role], tmp_path, out)
    assert "not a readable GGUF" in done.stderr


@pytest.mark.parametrize("kind", ["text", "truncated"])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_lint_and_reference_refuse_a_file_that_is_no_gguf_naming_it(kind, role, fixture_models, tmp_path):
    d = fixture_models("clean")
    files = {"target": d / "target.gguf", "draft": d / "draft.gguf"}
    files[role] = _unreadable(kind, files[role], tmp_path / f"{role}.gguf")
    linted = runner.invoke(app, ["lint", str(files["draft"]), "--target", str(files["target"])])
    out = tmp_path / "ref.npz"
    args = ["--target", str(files["target"]), "--model", str(files["draft"]), "--tokens", TOKENS, "-o", str(out)]
    referenced = runner.invoke(app, ["reference", *args])
    for result in (linted, referenced):
        assert result.exit_code == EXIT_INPUT, result.output
        assert f"{files[role]}: not a readable GGUF" in result.output
    assert not out.exists()


def test_reference_refuses_runaway_rounds_before_the_target_loads(fixture_models, tmp_path, monkeypatch):
    """--rounds past the target's trained context: the largest that fits is named, and the
    target's weights are never read (so no flow runs)."""
    d = fixture_models("clean")
    monkeypatch.setattr(reference_run, "load_target", _never_loaded)
    out = tmp_path / "ref.npz"
    args = ["--target", str(d / "target.gguf"), "--model", str(d / "draft.gguf"), "--tokens", TOKENS]
    result = runner.invoke(app, ["reference", *args, "--rounds", str(RUNAWAY_ROUNDS), "-o", str(out)])
    assert result.exit_code == EXIT_INPUT, result.output
    assert result.output.startswith(f"featdiff: error: --rounds {RUNAWAY_ROUNDS}: ") and not out.exists()
    fit = re.search(r"pass --rounds (\d+) or fewer", result.output)
    assert fit is not None, result.output
    n_ctx = trained_context(read_gguf(d / "target.gguf"))
    rows = 4  # the clean drafter's block_size 4 with llama.cpp's default --spec-draft-n-max 3
    assert n_ctx is not None and flow_positions(3, int(fit[1]), rows) <= n_ctx < flow_positions(
        3, int(fit[1]) + 1, rows
    )


def test_reference_bounds_an_hf_target_by_its_max_position_embeddings(fixture_models, tmp_path, monkeypatch):
    d = fixture_models("clean")
    monkeypatch.setattr(reference_run, "load_target", _never_loaded)
    args = ["--target", str(d / "target-hf"), "--model", str(d / "draft-hf"), "--tokens", TOKENS, "-o"]
    result = runner.invoke(app, ["reference", *args, str(tmp_path / "ref.npz"), "--rounds", str(RUNAWAY_ROUNDS)])
    assert result.exit_code == EXIT_INPUT, result.output
    assert f"but {d / 'target-hf'} was trained on " in result.output


def _never_loaded(*args, **kwargs):
    raise AssertionError("the reference loaded the target: the --rounds bound comes too late")


def test_the_largest_rounds_named_fits_and_one_more_does_not(tmp_path):
    target = tmp_path / "T.gguf"
    check_rounds_fit(1022, 4, 4096, target, n_prompt=3)  # 3 + 1023 x 4 = 4095 positions
    with pytest.raises(InputError, match=r"--rounds 1023: the flow reaches position 4099 .* pass --rounds 1022 or"):
        check_rounds_fit(1023, 4, 4096, target, n_prompt=3)
    with pytest.raises(InputError, match="states no trained context length"):
        check_rounds_fit(RUNAWAY_ROUNDS, 4, None, target, n_prompt=3)
    with pytest.raises(InputError, match="shorten the prompt"):
        check_rounds_fit(0, 4, 4096, target, n_prompt=4096)


def test_preflight_with_rounds_refuses_a_flow_past_the_trained_context(fixture_models):
    """What capture calls before loading: the prompt is not known yet, so the shortest one."""
    d = fixture_models("clean")
    preflight(d / "draft.gguf", d / "target.gguf", rounds=2)
    with pytest.raises(InputError, match=rf"--rounds {RUNAWAY_ROUNDS}: .* \(a prompt of 2 tokens at least"):
        preflight(d / "draft.gguf", d / "target.gguf", rounds=RUNAWAY_ROUNDS)


def test_preflight_refuses_fatal_problems_only(fixture_models, tmp_path):
    """A DFlash drafter without dflash.block_size runs (llama.cpp's default block): lint lists
    it, the pre-flight lets it pass; a DSpark drafter without it aborts llama.cpp's Markov head."""
    rewrite = _rewrite_gguf()
    clean, dspark = fixture_models("clean"), fixture_models("dspark")
    dflash = rewrite(clean / "draft.gguf", tmp_path / "D.gguf", drop_keys=(names.KEY_BLOCK_SIZE,))
    assert any("dflash.block_size is missing" in p for p in lint_gguf(dflash, clean / "target.gguf"))
    preflight(dflash, clean / "target.gguf")
    markov = rewrite(dspark / "draft.gguf", tmp_path / "S.gguf", drop_keys=(names.KEY_BLOCK_SIZE,))
    with pytest.raises(InputError, match=r"S\.gguf: dflash\.block_size is missing, which llama\.cpp's DSpark"):
        preflight(markov, dspark / "target.gguf")


def test_preflight_names_the_first_problem_and_counts_the_rest(fixture_models, tmp_path):
    d = fixture_models("clean")
    edits = {
        "drop_keys": (names.KEY_MASK_TOKEN, names.KEY_BLOCK_SIZE),
        "set_keys": {names.KEY_BLOCK_SIZE: (0, GGUFValueType.UINT32)},
    }
    broken = _rewrite_gguf()(d / "draft.gguf", tmp_path / "D.gguf", **edits)
    with pytest.raises(InputError) as e:
        preflight(broken, d / "target.gguf")
    assert str(e.value) == (
        f"{broken}: dflash.block_size = 0 leaves no row to draft; expected 2 .. {MAX_BLOCK_SIZE}: re-export the "
        f"drafter with its trained block size (1 more: `featdiff lint {broken} --target {d / 'target.gguf'}`)"
    )


def test_a_key_of_the_wrong_type_is_an_input_error_naming_it(fixture_models, tmp_path):
    d = fixture_models("clean")
    broken = _rewrite_gguf()(
        d / "draft.gguf", tmp_path / "D.gguf", **_set_key(names.KEY_BLOCK_SIZE, "four", GGUFValueType.STRING)
    )
    result = runner.invoke(app, ["lint", str(broken), "--target", str(d / "target.gguf")])
    assert result.exit_code == EXIT_INPUT
    assert f"{broken}: metadata key 'dflash.block_size' = 'four', expected an integer" in result.output


def test_capture_refuses_a_filter_role_typo(fixture_models, tmp_path):
    """`drafter:*` would be a glob on both roles matching nothing: an empty capture, exit 0."""
    d = fixture_models("clean")
    out = tmp_path / "run.npz"
    done = _capture(d / "target.gguf", d / "draft.gguf", out, "--filter", "drafter:*")
    assert done.returncode == EXIT_INPUT, done.stderr[-2000:]
    assert "--filter 'drafter:*': unknown role 'drafter'; roles are target, draft" in done.stderr
    assert not out.exists() and not list(tmp_path.glob("run.npz.spool*"))


def test_block_size_bounds_follow_the_first_draft_row():
    """An anchor-first DSpark block drafts from row 0, so one row is enough there; no block may
    pass one ubatch of llama.cpp's draft context."""
    assert block_size_problem(1, first_draft_row=0) is None and block_size_problem(MAX_BLOCK_SIZE) is None
    assert "leaves no row" in (block_size_problem(1, first_draft_row=1) or "")
    assert "leaves no row" in (block_size_problem(0, first_draft_row=0) or "")
    assert "one ubatch" in (block_size_problem(MAX_BLOCK_SIZE + 1, first_draft_row=0) or "")
