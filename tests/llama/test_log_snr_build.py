"""GIDD log-SNR conditioning computed by a real llama.cpp build (the pinned tree with
patches/llama.cpp/0001-dflash-log-snr.patch, built by `make tools`), captured in-process and
around llama-server: a correct drafter compares clean with the fork's records among the compared
ones, a stripped export is a missing term, and the trained drafter accepts clearly more with its
conditioning than without."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from featdiff.core import names
from featdiff.diff import compare_dumps, exit_code
from featdiff.dump.reader import read_dump
from featdiff.factory import fixtures
from featdiff.programs import exec as exec_capture
from featdiff.verdict.probe import probe, read_prompts

from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS
from test_exec import RUN_TIMEOUT_S, TOKENS, _command

# the records the patched graph computes for the term, and the rows before it
LOG_SNR_RECORDS = (names.INP_NOISE_EMBD, *names.LOG_SNR_RECORDS)
# relative error of those records against the float64 formula: they come before any attention,
# so only float32 rounding separates them (measured: at most 1.6e-7 relative, helper run of the patch)
MAX_REL_ERR = 1e-5
PROBE_ROUNDS = 6
FAULT_VAR = "FEATDIFF_FAULT"  # patches/llama.cpp/0003-log-snr-faults.patch
CONDITIONING_GAIN = 0.5  # tokens per block the conditioning must be worth, at least, on held-out prompts


@pytest.fixture(scope="session")
def patched_dir(tools):
    """The patched llama.cpp tree with its build in DIR/build, as `--llama-dir` reads it."""
    return tools.source


def _capture(d: Path, out: Path, tokens: str, llama_dir: Path, fault: str | None = None) -> Path:
    """`featdiff capture --llama-dir` in its own process, as a user runs it: one process holds one
    libllama (the suite's own process has loaded the pinned one already). `fault`: FEATDIFF_FAULT."""
    cmd = [
        sys.executable,
        "-c",
        "from featdiff.cli import main; main()",
        "capture",
        "--target",
        str(d / "target.gguf"),
        "--model",
        str(d / "draft.gguf"),
        "--tokens",
        tokens,
        "--rounds",
        str(DEFAULT_ROUNDS),
        "--llama-dir",
        str(llama_dir),
        "-o",
        str(out),
    ]
    env = {k: v for k, v in os.environ.items() if k != FAULT_VAR} | ({FAULT_VAR: fault} if fault else {})
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr
    return out


def _log_snr_pairs(comparison) -> dict[str, list]:
    out: dict[str, list] = {}
    for p in comparison.pairs:
        if p.name in LOG_SNR_RECORDS:
            out.setdefault(p.name, []).append(p)
    return out


def _assert_clean_with_log_snr_records(comparison) -> None:
    assert comparison.ok, [f.message for f in comparison.findings]
    pairs = _log_snr_pairs(comparison)
    assert set(pairs) == set(LOG_SNR_RECORDS), sorted(pairs)
    for name, group in pairs.items():
        assert all(p.within and p.rel_p99 <= MAX_REL_ERR for p in group), (name, [p.rel_p99 for p in group])


def test_log_snr_drafter_captured_in_process_compares_clean(fixture_models, referenced, patched_dir, tmp_path):
    d = fixture_models("log-snr")
    run = _capture(d, tmp_path / "run.npz", DEFAULT_TOKENS, patched_dir)
    _assert_clean_with_log_snr_records(compare_dumps(referenced("log-snr"), run))


def test_log_snr_drafter_around_llama_server_compares_clean(fixture_models, referenced, tools, tmp_path):
    d = fixture_models("log-snr")
    run = exec_capture.capture_exec(
        _command(tools, "llama-server", d), tmp_path / "run.npz", tokens=TOKENS, timeout_s=RUN_TIMEOUT_S
    )
    with read_dump(run) as dump:
        m = dump.manifest
        tokens = ",".join(map(str, m.prompt_tokens))
        rounds = sum(1 for r in m.rounds if r.drafts)
    _assert_clean_with_log_snr_records(compare_dumps(referenced("log-snr", tokens=tokens, rounds=rounds), run))


def test_trained_log_snr_drafter_captured_in_process_compares_clean(fixture_models, referenced, patched_dir, tmp_path):
    d = fixture_models("trained-log-snr")
    tokens = ",".join(map(str, read_prompts(d / fixtures.PROMPTS_FILE)[0].tokens))
    run = _capture(d, tmp_path / "run.npz", tokens, patched_dir)
    _assert_clean_with_log_snr_records(compare_dumps(referenced("trained-log-snr", tokens=tokens), run))


def test_an_export_without_the_log_snr_term_is_a_missing_term_on_the_patched_build(
    fixture_models, referenced, patched_dir, tmp_path
):
    d = fixture_models("no-log-snr")
    run = _capture(d, tmp_path / "run.npz", DEFAULT_TOKENS, patched_dir)
    comparison = compare_dumps(referenced("no-log-snr"), run)
    terms = [f for f in comparison.findings if f.kind == "missing_term"]
    assert terms and terms[0].fields["term"] == names.DSPARK_LOG_SNR_FC2, [f.message for f in comparison.findings]
    assert terms[0].fields["where"] == "export", terms[0].fields["where_reason"]  # the GGUF lacks the log-SNR keys
    assert exit_code(comparison) == 1


def test_log_snr_levels_swapped_in_the_graph_are_a_wrong_source(fixture_models, referenced, patched_dir, tmp_path):
    d = fixture_models("log-snr")
    run = _capture(d, tmp_path / "run.npz", DEFAULT_TOKENS, patched_dir, fault="log-snr-swapped")
    comparison = compare_dumps(referenced("log-snr"), run)
    first = next(f for f in comparison.findings if f.severity == "error")
    assert (first.kind, first.tensor, first.fields["source"]) == ("wrong_source", names.DSPARK_LOG_SNR_FEAT, "swapped")
    assert "anchor row at min_log_snr" in first.message and exit_code(comparison) == 1
    assert first.fields["where"] == "graph", first.fields["where_reason"]  # 0003 plants it in the graph


def test_the_log_snr_term_added_after_the_first_norm_is_a_wrong_source(
    fixture_models, referenced, patched_dir, tmp_path
):
    d = fixture_models("log-snr")
    run = _capture(d, tmp_path / "run.npz", DEFAULT_TOKENS, patched_dir, fault="log-snr-after-norm")
    comparison = compare_dumps(referenced("log-snr"), run)
    first = next(f for f in comparison.findings if f.severity == "error")
    assert (first.kind, first.tensor, first.fields["source"]) == (
        "wrong_source",
        names.DSPARK_DRAFT_EMBD_SNR,
        "after_norm",
    )
    assert "before the first layer" in first.message and exit_code(comparison) == 1
    assert first.fields["where"] == "graph", first.fields["where_reason"]  # 0003 plants it in the graph


@pytest.fixture(scope="session")
def server_probed(fixture_models, tools):
    """variant -> the probe of that trained pair through the patched llama-server."""
    made = {}

    def get(variant: str):
        if variant not in made:
            d = fixture_models(variant)
            made[variant] = probe(
                d / "target.gguf",
                d / "draft.gguf",
                prompts=d / fixtures.PROMPTS_FILE,
                rounds=PROBE_ROUNDS,
                ref_model=d / "draft-hf",
                command=_command(tools, "llama-server", d),
            )
        return made[variant]

    return get


def test_trained_log_snr_drafter_accepts_clearly_more_with_its_conditioning(server_probed):
    conditioned, stripped = server_probed("trained-log-snr"), server_probed("trained-no-log-snr")
    assert conditioned.run.mean_accepted_length >= stripped.run.mean_accepted_length + CONDITIONING_GAIN, (
        conditioned.run,
        stripped.run,
    )
    assert not conditioned.has_gap and stripped.has_gap
