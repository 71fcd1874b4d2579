"""featdiff on a build of the older batch API generation (`llama_batch` + `llama_decode` /
`llama_encode`, before `llama_batch_ext` / `llama_process`): llama.cpp as llama-cpp-python 0.3.35
ships it, unpatched, built once per machine into build/release-0.3.35 (featdiff.llama.tools,
about 8 minutes on 2 cores). That tree has the dflash arch, with the two-step injection of its
generation (llama_encode of the features, then llama_decode of the encoder's rows).

Each capture runs in a process of its own: this one has the pinned libllama loaded, and the two
builds' libraries share their sonames.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from featdiff.diff import compare_dumps
from featdiff.dump.reader import read_dump
from featdiff.factory.fixtures import VOCAB_SPM, write_fixture
from featdiff.llama import binding
from featdiff.llama.tools import ToolBuild

from real_flow import reference_of

pytestmark = [pytest.mark.tools, pytest.mark.slow]  # builds an older llama.cpp: not part of `make test-fast`
TOKENS = "300,301,302,303,304,305,306,307"  # plain words of the SentencePiece vocab (0-2 are special)
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def spm_models(tmp_path_factory):
    """variant -> the fixture pair with a SentencePiece vocab: that tree predates llama.cpp's
    "test" tokenizer, which the other fixtures use."""
    made: dict[str, Path] = {}

    def get(variant: str = "clean") -> Path:
        if variant not in made:
            made[variant] = write_fixture(tmp_path_factory.mktemp(f"spm-{variant}"), variant, vocab=VOCAB_SPM)
        return made[variant]

    return get


def _featdiff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from featdiff.cli import main; main()", *args],
        capture_output=True,
        text=True,
        errors="replace",  # the random drafter's pair generates byte tokens: not always UTF-8
        timeout=RUN_TIMEOUT_S,
    )


def test_the_header_decides_the_generation(legacy):
    assert binding.find_build(legacy.source).batch_api == binding.BATCH_LEGACY
    assert binding.find_build(None).batch_api == binding.BATCH_EXT
    assert "struct llama_batch llama_batch_init" in binding.cdef(binding.find_build(legacy.source))
    assert "llama_process" not in binding.cdef(binding.find_build(legacy.source))


def _compared(run: Path, d: Path, tmp_path: Path):
    ref = reference_of(d / "target.gguf", d / "draft-hf", tmp_path / "ref.npz", follow=run)
    return compare_dumps(ref, run)


def _assert_clean(run: Path, d: Path, tmp_path: Path) -> None:
    comparison = _compared(run, d, tmp_path)
    assert comparison.ok, [f.message for f in comparison.findings]
    paired = {p.name for p in comparison.pairs}
    # the drafter's wiring is compared, not only the target's: the features its encoder read (the
    # run's `inp_embd`), the injected K/V, its layers
    assert {"inp_target_features", "inp_g_embeddings", "Kcur_injected-0", "l_out-0"} <= paired, sorted(paired)
    assert comparison.coverage.pairs > 0


def _capture(legacy: ToolBuild, d: Path, run: Path) -> None:
    done = _featdiff("capture", "--llama-dir", str(legacy.source), "--target", str(d / "target.gguf"),
                     "--model", str(d / "draft.gguf"), "--tokens", TOKENS, "--rounds", "2", "-o", str(run))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def test_in_process_capture_on_the_older_generation_compares_clean(legacy, spm_models, tmp_path):
    d = spm_models("clean")
    run = tmp_path / "run.npz"
    _capture(legacy, d, run)
    with read_dump(run) as dump:
        m = dump.manifest
        assert Path(m.build["library"]).parent == legacy.bin_dir
        injects = [ev for ev in m.evals if ev.phase == "inject" and ev.round == 1]
        # encode, then decode, of the same rows at the same positions
        assert [ev.call for ev in injects] == ["encode", "decode"]
        assert injects[0].positions == injects[1].positions
        assert {r.name for r in m.records if r.eval == injects[0].eval} == {"inp_embd"}
    shown = _featdiff("inspect", str(run)).stdout
    assert f"eval {injects[0].eval:3d}  draft  inject  round 1" in shown and "llama_encode" in shown
    _assert_clean(run, d, tmp_path)


def test_the_older_generation_names_a_wrong_layer_id(legacy, spm_models, tmp_path):
    d = spm_models("layers-plus1")
    run = tmp_path / "run.npz"
    _capture(legacy, d, run)
    comparison = _compared(run, d, tmp_path)
    assert not comparison.ok
    offsets = [f.to_json() for f in comparison.findings if f.kind == "layer_offset"]
    assert offsets, [f.message for f in comparison.findings]
    assert (offsets[0]["slot"], offsets[0]["expected_layer"], offsets[0]["observed_layer"]) == (0, 2, 3)


def test_exec_capture_around_the_older_generations_program(legacy, spm_models, tmp_path):
    d = spm_models("clean")
    run = tmp_path / "run.npz"
    program = legacy.program("llama-speculative-simple")
    done = _featdiff("capture", "--exec", "--llama-dir", str(legacy.source), "-o", str(run), "--",
                     str(program), "-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf"),
                     "--spec-type", "draft-dflash", "--spec-draft-n-max", "3", "-c", "256", "-t", "1",
                     "-p", "The quick brown fox", "-n", "16", "--temp", "0")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with read_dump(run) as dump:
        phases = {ev.phase for ev in dump.manifest.evals}
        assert {"prefill", "inject", "draft", "verify"} <= phases
        injects = [ev for ev in dump.manifest.evals if ev.phase == "inject"]
        assert {ev.call for ev in injects} == {"encode", "decode"}
        # llama_encode gets no positions: the encoder eval has those of the decode after it
        assert all(p >= 0 for ev in injects for p in ev.positions)
    _assert_clean(run, d, tmp_path)


def test_exec_of_an_older_program_compiles_the_preload_against_its_own_headers(legacy, spm_models, tmp_path):
    """No --llama-dir: the preload's headers are those of the build whose libllama the program
    loads, not featdiff's default build's (a struct of the wrong layout would crash the program)."""
    from featdiff.programs.preload import build_of_program

    program = legacy.program("llama-speculative-simple")
    assert build_of_program(program) == legacy.source
    assert build_of_program(binding.find_build(None).root / "build" / "bin" / "llama-simple") is None
    d = spm_models("clean")
    run = tmp_path / "run.npz"
    done = _featdiff("capture", "--exec", "-o", str(run), "--", str(program), "-m", str(d / "target.gguf"),
                     "-md", str(d / "draft.gguf"), "--spec-type", "draft-dflash", "--spec-draft-n-max", "3",
                     "-c", "256", "-t", "1", "-p", "The quick brown fox", "-n", "8", "--temp", "0")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with read_dump(run) as dump:
        assert any(ev.call == "encode" for ev in dump.manifest.evals)


def test_exec_with_another_build_named_than_the_programs_exits_2_naming_both(legacy, spm_models, tmp_path):
    d = spm_models("clean")
    program = legacy.program("llama-speculative-simple")
    other = binding.find_build(None).root
    done = _featdiff("capture", "--exec", "--llama-dir", str(other), "-o", str(tmp_path / "run.npz"), "--",
                     str(program), "-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf"), "-p", "x", "-n", "2")  # fmt: skip
    assert done.returncode == 2
    (line,) = [ln for ln in done.stderr.splitlines() if "error" in ln]
    assert str(program) in line and str(legacy.bin_dir) in line and str(other) in line
    assert not (tmp_path / "run.npz").exists()
