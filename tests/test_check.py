"""`featdiff check`: one verdict from a real capture, its reference, compare and the accept probe.
The trained pair passes (exit 0); the off-by-one and the log-SNR-stripped exports fail (exit 1)
with the finding and the accept gap in the summary, in-process and around llama-server. The
pytest plugin's example file and the CI example script run end to end; the public API is light
to import and calls the same stages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import featdiff
from featdiff.cli import app
from featdiff.factory import fixtures
from featdiff.verdict.probe import Probe, PromptProbe, RoundPair
from featdiff.verdict.result import MIN_BLOCKS, judge_accept

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_TEST = ROOT / "examples" / "test_drafter_wiring.py"
CI_SCRIPT = ROOT / "examples" / "ci" / "check.sh"
ROUNDS = 2
N_PROMPTS = 3  # of the fixture's held-out prompts: 6 paired blocks in-process, about 30 through llama-server
SERVER_ARGS = ["--spec-type", "draft-dflash", "--spec-draft-n-max", "3", "-c", "256", "-t", "1", "-td", "1"]
LOG_SNR_ROUNDS = 6  # in-process, per held-out prompt: 48 blocks (measured gap -1.06, margin 0.45)
RUN_TIMEOUT_S = 600
EXIT_OK, EXIT_FAIL, EXIT_INPUT = 0, 1, 2
CHECK_JSON_KEYS = {
    "ok",
    "verdict",
    "reasons",
    "mode",
    "program",
    "prompt_tokens",
    "accept",
    "comparison",
    "probe",
    "report",
    "dumps",
}


def _prompts(d: Path, out: Path, n: int = N_PROMPTS) -> Path:
    lines = (d / fixtures.PROMPTS_FILE).read_text().splitlines()[:n]
    out.write_text("\n".join(lines) + "\n")
    return out


def _server_command(tools, d: Path) -> list[str]:
    return [
        str(tools.program("llama-server")),
        "-m",
        str(d / "target.gguf"),
        "-md",
        str(d / "draft.gguf"),
        *SERVER_ARGS,
    ]


def _pair_args(d: Path) -> list[str]:
    """`--target` and `--model` of a fixture pair's GGUFs."""
    return ["--target", str(d / "target.gguf"), "--model", str(d / "draft.gguf")]


@pytest.fixture(scope="session")
def checked(tmp_path_factory, fixture_models, tools):
    """(variant, mode) -> the outputs of `featdiff check` on that trained pair, run once through the
    CLI: `code`, `output`, `json`, `summary`, `step_summary` (what $GITHUB_STEP_SUMMARY got), `dir`."""
    made: dict[tuple[str, str], dict] = {}

    def get(variant: str, mode: str = "in-process") -> dict:
        if (variant, mode) not in made:
            d, out = fixture_models(variant), tmp_path_factory.mktemp(f"check-{variant}-{mode}")
            args = [
                "check",
                *_pair_args(d),
                "--ref-model",
                str(d / "draft-hf"),
                "--prompts",
                str(_prompts(d, out / "prompts.txt")),
                "--rounds",
                str(ROUNDS),
                "--keep",
                str(out / "dumps"),
                "--json",
                str(out / "check.json"),
                "--report",
                str(out / "report.html"),
                "--summary-md",
                str(out / "summary.md"),
            ]
            if mode == "llama-server":
                args += ["--exec", "--", *_server_command(tools, d)]
            step_summary = out / "step-summary.md"
            step_summary.write_text("earlier step\n")
            result = CliRunner().invoke(app, args, env={"GITHUB_STEP_SUMMARY": str(step_summary)})
            made[(variant, mode)] = {
                "code": result.exit_code,
                "output": result.output,
                "dir": out,
                "json": json.loads((out / "check.json").read_text()),
                "summary": (out / "summary.md").read_text(),
                "step_summary": step_summary.read_text(),
            }
        return made[(variant, mode)]

    return get


# ---------------------------------------------------------------- the margin rule (pure)


def _probe(diffs: list[tuple[int, int]]) -> Probe:
    """A probe of one prompt whose blocks of 3 drafts accepted (run, ref) tokens."""
    rounds = tuple(
        RoundPair(i, (1, 2, 3), (1, 2, 3) if run == ref else (1, 2, 4), run, ref) for i, (run, ref) in enumerate(diffs)
    )
    return Probe((PromptProbe("p", (1, 2), rounds),))


def test_identical_accepts_match_with_no_margin():
    a = judge_accept(_probe([(3, 3)] * 6))
    assert (a.gap, a.margin, a.matches) == (0.0, 0.0, True)


def test_one_block_flipped_by_a_near_tie_is_within_the_margin():
    a = judge_accept(_probe([(3, 3)] * 5 + [(0, 3)]))
    assert a.gap == pytest.approx(-0.5) and a.matches


def test_a_constant_loss_is_a_gap_however_small():
    a = judge_accept(_probe([(2, 3)] * 6))
    assert a.gap == pytest.approx(-1.0) and a.margin == 0.0 and not a.matches


def test_too_few_blocks_are_no_match():
    a = judge_accept(_probe([(3, 3)] * (MIN_BLOCKS - 1)))
    assert a.blocks == MIN_BLOCKS - 1 and not a.matches


def test_min_accept_is_on_the_runs_accept_rate():
    probe = _probe([(1, 1)] * 6)  # a third of the drafts accepted, on both sides
    assert judge_accept(probe, min_accept=0.3).above_min and not judge_accept(probe, min_accept=0.5).above_min


# ---------------------------------------------------------------- the verdict, in-process and around llama-server


@pytest.mark.parametrize("mode", ["in-process", "llama-server"])
def test_the_trained_pair_passes(checked, mode):
    c = checked("trained", mode)
    assert c["code"] == EXIT_OK, c["output"]
    assert c["json"]["ok"] and c["json"]["verdict"] == "pass" and not c["json"]["reasons"]
    assert c["json"]["accept"]["run"] == c["json"]["accept"]["ref"] and c["json"]["accept"]["matches"]
    assert "## featdiff check: pass" in c["summary"] and "| run |" in c["summary"]


@pytest.mark.parametrize("mode", ["in-process", "llama-server"])
def test_off_by_one_layers_fail_with_the_finding_and_the_accept_gap_in_the_summary(checked, mode):
    c = checked("trained-layers-minus1", mode)
    assert c["code"] == EXIT_FAIL, c["output"]
    assert c["json"]["verdict"] == "fail" and not c["json"]["accept"]["matches"]
    first = next(f for f in c["json"]["comparison"]["findings"] if f["severity"] == "error")
    assert (first["kind"], first["tensor"], first["delta"]) == ("layer_offset", "inp_target_features", -1)
    assert "layer_offset at inp_target_features" in c["summary"] and "accept gap" in c["summary"]
    assert c["json"]["accept"]["run"]["mean_accepted_length"] < c["json"]["accept"]["ref"]["mean_accepted_length"]


def test_the_summary_is_appended_to_the_github_step_summary(checked):
    c = checked("trained-layers-minus1")
    assert c["step_summary"] == "earlier step\n" + c["summary"] + "\n"


def test_the_json_holds_the_contracts_keys_and_the_report_path(checked):
    c = checked("trained")
    assert set(c["json"]) == CHECK_JSON_KEYS
    assert c["json"]["mode"] == "in-process" and c["json"]["program"] is None
    assert {"ok", "findings", "records", "coverage"} <= set(c["json"]["comparison"])  # docs/findings.md
    assert Path(c["json"]["report"]).stat().st_size > 10_000
    assert c["json"]["accept"]["blocks"] == N_PROMPTS * ROUNDS
    assert {p["label"] for p in c["json"]["probe"]["prompts"]} and len(c["json"]["probe"]["prompts"]) == N_PROMPTS


@pytest.mark.parametrize("mode", ["in-process", "llama-server"])
def test_the_log_snr_stripped_export_fails_on_the_patched_build(fixture_models, tools, tmp_path, mode):
    """In its own process, as test_log_snr_build captures: one process holds one libllama. All the
    held-out prompts: the stripped export still accepts most drafts (about 3 of 4 tokens per block
    against 4), so the gap needs more blocks than the off-by-one's to clear the margin."""
    d = fixture_models("trained-no-log-snr")
    cmd = [sys.executable, "-c", "from featdiff.cli import main; main()", "check"]
    cmd += ["--target", str(d / "target.gguf"), "--model", str(d / "draft.gguf"), "--ref-model", str(d / "draft-hf")]
    cmd += ["--prompts", str(d / fixtures.PROMPTS_FILE), "--rounds", str(LOG_SNR_ROUNDS)]
    cmd += ["--llama-dir", str(tools.source), "--summary-md", str(tmp_path / "summary.md")]
    cmd += ["--json", str(tmp_path / "check.json")]
    if mode == "llama-server":
        cmd += ["--exec", "--", *_server_command(tools, d)]
    env = {k: v for k, v in os.environ.items() if k not in ("FEATDIFF_FAULT", "GITHUB_STEP_SUMMARY")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    assert done.returncode == EXIT_FAIL, done.stdout[-3000:] + done.stderr[-3000:]
    summary, result = (tmp_path / "summary.md").read_text(), json.loads((tmp_path / "check.json").read_text())
    terms = [f for f in result["comparison"]["findings"] if f["kind"] == "missing_term"]
    assert terms and terms[0]["term"] == "dspark_log_snr_fc2", summary
    assert "missing_term" in summary and "accept gap" in summary, summary


# ---------------------------------------------------------------- inputs and outputs


def test_kept_dumps_feed_the_public_api(checked, tmp_path):
    c = checked("trained-layers-minus1")
    ref, run = c["dir"] / "dumps" / "ref.npz", c["dir"] / "dumps" / "run.npz"
    comparison = featdiff.compare(ref, run)
    assert not comparison.ok and comparison.findings[0].kind == "layer_offset"
    assert featdiff.report(ref, run, tmp_path / "r.html", comparison=comparison).stat().st_size > 10_000


def test_an_output_that_is_an_input_exits_2_before_anything_runs(fixture_models, tmp_path):
    d = fixture_models("clean")
    result = CliRunner().invoke(
        app,
        [
            "check",
            *_pair_args(d),
            "--report",
            str(d / "draft.gguf"),
        ],
    )
    assert result.exit_code == EXIT_INPUT, result.output
    assert "--report must not be an input" in result.output


def test_prompts_for_a_program_with_its_own_prompt_exit_2(fixture_models, tools, tmp_path):
    d = fixture_models("clean")
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\n")
    result = CliRunner().invoke(
        app,
        [
            "check",
            *_pair_args(d),
            "--prompts",
            str(prompts),
            "--exec",
            "--",
            str(tools.program("llama-speculative-simple")),
            "-p",
            "hi",
        ],
    )
    assert result.exit_code == EXIT_INPUT, result.output
    assert "drop --prompts" in result.output


def test_check_help_shows_its_flags():
    result = CliRunner().invoke(app, ["check", "--help"])
    assert result.exit_code == 0
    for flag in (
        "--target",
        "--model",
        "--ref-target",
        "--ref-model",
        "--llama-dir",
        "--exec",
        "--prompts",
        "--rounds",
        "--min-accept",
        "--json",
        "--report",
        "--summary-md",
        "--keep",
    ):
        assert flag in result.output, flag


def test_import_featdiff_stays_light_and_its_stages_are_callable():
    code = (
        "import sys, featdiff; heavy = [m for m in ('torch', 'numpy', 'featdiff.llama') if m in sys.modules]; "
        "import featdiff.diff.render; "
        "print(heavy, all(callable(getattr(featdiff, n)) for n in "
        "('capture', 'reference', 'compare', 'report', 'check')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[] True"


# ---------------------------------------------------------------- the plugin's example and the CI script


@pytest.mark.slow  # a whole pytest session in a subprocess
@pytest.mark.parametrize("variant, passes", [("trained", True), ("trained-layers-minus1", False)])
def test_the_plugins_example_test_file_runs_under_pytest(fixture_models, tmp_path, variant, passes):
    d = fixture_models(variant)
    env = {
        **os.environ,
        "FEATDIFF_TARGET": str(d / "target.gguf"),
        "FEATDIFF_DRAFT": str(d / "draft.gguf"),
        "FEATDIFF_REF_MODEL": str(d / "draft-hf"),
        "FEATDIFF_PROMPTS": str(_prompts(d, tmp_path / "p.txt")),
    }
    env.pop("GITHUB_STEP_SUMMARY", None)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(tmp_path),
        str(EXAMPLE_TEST),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=RUN_TIMEOUT_S)
    if passes:
        assert done.returncode == 0 and "1 passed, 1 skipped" in done.stdout, done.stdout[-3000:]
    else:
        assert done.returncode == 1 and "1 failed, 1 skipped" in done.stdout, done.stdout[-3000:]
        assert "featdiff check failed: layer_offset at inp_target_features" in done.stdout
        assert "accept gap" in done.stdout


def test_the_ci_example_script_runs_end_to_end_on_the_tools_build(fixture_models, tools, tmp_path):
    fixture_models("trained")  # trains the pair first (cached), as the script's fixture step reuses it
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "OUT": str(tmp_path / "out"),
        "GITHUB_STEP_SUMMARY": str(tmp_path / "step-summary.md"),
    }
    for name in ("TARGET", "DRAFT", "REF_MODEL", "PROMPTS", "MODE", "GITHUB_ACTIONS"):
        env.pop(name, None)
    done = subprocess.run(
        ["bash", str(CI_SCRIPT)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=RUN_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"llama.cpp: {tools.source}" in done.stdout and "PASS" in done.stdout
    out = tmp_path / "out"
    assert json.loads((out / "check.json").read_text())["ok"]
    assert (out / "report.html").stat().st_size > 10_000
    assert (tmp_path / "step-summary.md").read_text() == (out / "summary.md").read_text() + "\n"
