"""`featdiff check --exec` on the planted faults test_check_faults.py and
test_check_step_faults.py leave out (issue 48): the graph faults of libllama around
llama-speculative-simple (`log-snr-*` of 0003, `recurrent-keep-rejected` of 0004: the program's
own libllama reads FEATDIFF_FAULT, so no process of featdiff's holds the pinned one), the long
inject split in n_ubatch chunks (`inject-chunk0`); around llama-server, those, and every
driver and graph fault of EAGLE3 and of MTP that one request shows (0002, 0007, 0008, 0009, 0011,
0013: `mtp-boundary-future` on the server's prompt split in two target batches; 0013's EAGLE3 taps
and d2t on the eagle3 pair, its GLM-4.5 graph faults on the `mtp-glm4moe` pair, each with the kind,
source and `where` it has in-process). Each exits 1 naming the finding docs/faults.md
gives it, never 2 or 3, and keeps its dumps. The faults that need several sequences at once are
checked on the capture of that traffic (`check --run`: tests/llama/test_server_traffic.py,
test_server_clients.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from featdiff_process import FAULT_VAR, check_names_fault

pytestmark = pytest.mark.slow  # real programs, real references; the converted pairs are cached per machine

PROMPT = "The quick brown fox"
TWICE = "the quick brown fox jumps over the lazy dog " * 2  # 18 tokens: 5 chunks of -ub 4
DFLASH = ["--spec-type", "draft-dflash", "--spec-draft-n-max", "3", "-c", "256", "-t", "1", "-td", "1"]
STEPS = ["--spec-draft-n-max", "3", "--spec-draft-p-min", "0", "-c", "256", "-t", "1"]
TRAINED = ("--ref-model", "draft-hf")  # the reference drafter: the pair's trained checkpoint
HF_TARGET = ("--ref-target", "target-hf")  # qwen35's target through transformers' model code
# fault -> (the pair it runs on, the reference's models, the program's own options, the finding check must name)
SIMPLE = {
    "inject-chunk0": ("clean", TRAINED, ["-ub", "4", "-p", TWICE], "misplaced_rows"),
    "log-snr-swapped": ("log-snr", TRAINED, ["-p", PROMPT], "wrong_source"),
    "log-snr-after-norm": ("log-snr", TRAINED, ["-p", PROMPT], "wrong_source"),
    "recurrent-keep-rejected": ("qwen35", HF_TARGET, ["-p", PROMPT], "wrong_source"),
}
# fault -> (the DFlash pair, the reference's models, the server's own options, its one request, the
# finding check must name): libllama's graph faults, and the long inject in chunks
SERVER_DFLASH = {
    "inject-chunk0": ("clean", TRAINED, ["-ub", "4"], TWICE.strip(), "misplaced_rows"),
    "log-snr-swapped": ("log-snr", TRAINED, [], PROMPT, "wrong_source"),
    "log-snr-after-norm": ("log-snr", TRAINED, [], PROMPT, "wrong_source"),
    "recurrent-keep-rejected": ("qwen35", HF_TARGET, [], PROMPT, "wrong_source"),
}
# fault -> (drafter kind, the finding check must name): every driver (0002, 0009, 0011, 0013) and graph
# (0007, 0008, 0013) fault of EAGLE3 and MTP that one request shows
SERVER = {
    "eagle3-step-seed-state": ("eagle3", "wrong_source"),
    "eagle3-concat-swapped": ("eagle3", "slot_permutation"),
    "mtp-step-seed-state": ("mtp", "wrong_source"),
    "mtp-concat-swapped": ("mtp", "slot_permutation"),
    "mtp-boundary-future": ("mtp", "wrong_source"),  # the server prefills the prompt in 25 + 4 tokens
    "eagle3-prenorm-after-norm": ("eagle3", "wrong_source"),
    "mtp-hidden-prenorm": ("mtp", "wrong_source"),
    "eagle3-no-shift": ("eagle3", "row_shift"),
    "eagle3-step-pos": ("eagle3", "position_offset"),
    "mtp-no-shift": ("mtp", "row_shift"),
    "mtp-recycle-prenorm": ("mtp", "wrong_source"),
    "mtp-step-pos": ("mtp", "position_offset"),
    # 0011's, in the same common/speculative.cpp llama-server drafts through
    "eagle3-shift-2": ("eagle3", "row_shift"),
    "eagle3-step-pos-early": ("eagle3", "position_offset"),
    "mtp-step-pos-early": ("mtp", "position_offset"),
    "eagle3-step-zero-state": ("eagle3", "zeros"),
    "mtp-step-zero-state": ("mtp", "zeros"),
    "mtp-pending-stale": ("mtp", "stale"),
    # 0013's: the taps of common/speculative.cpp, EAGLE3's d2t and qwen3 graphs, GLM-4.5's
    "eagle3-slots-one-layer": ("eagle3", "layer_offset"),
    "eagle3-tap-normed": ("eagle3", "wrong_source"),
    "eagle3-d2t-dropped": ("eagle3", "wrong_source"),
    "eagle3-d2t-shifted": ("eagle3", "wrong_source"),
    "mtp-glm4moe-norms-swapped": ("mtp", "wrong_source"),
    "mtp-glm4moe-hidden-layer-before": ("mtp", "layer_offset"),
}
# fault -> the pair it runs on, where not its drafter kind's own ("eagle3", "mtp")
PAIR = {"mtp-glm4moe-norms-swapped": "mtp-glm4moe", "mtp-glm4moe-hidden-layer-before": "mtp-glm4moe"}
# fault -> the source its wrong_source names (None: a kind with no source) and where, as in-process
# (docs/faults.md)
SOURCE = {
    "mtp-boundary-future": ("batch_last", "driver"),
    "eagle3-slots-one-layer": (None, "driver"),
    "eagle3-tap-normed": ("attn_norm", "graph"),
    "eagle3-d2t-dropped": ("no_d2t", "graph"),
    "eagle3-d2t-shifted": ("d2t_shift+1", "graph"),
    "mtp-glm4moe-norms-swapped": ("hnorm", "graph"),
    "mtp-glm4moe-hidden-layer-before": (None, "graph"),
    "eagle3-prenorm-after-norm": ("after_norm", "graph"),
    "mtp-hidden-prenorm": ("prenorm", "graph"),
    "mtp-recycle-prenorm": ("chain_prenorm", "graph"),
    "log-snr-after-norm": ("after_norm", "graph"),
}


@pytest.fixture(scope="module")
def pairs(fixture_models, tmp_path_factory):
    """name -> a DFlash pair: a fixture variant, or "qwen35" (the hybrid recurrent target, converted once)."""
    from featdiff.factory.hf_targets import write_family_fixture

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name == "qwen35" and name not in made:
            made[name] = write_family_fixture(tmp_path_factory.mktemp("fam-qwen35"), "qwen35")
        return made[name] if name == "qwen35" else fixture_models(name)

    return get


def _simple_args(tools, d: Path, ref: tuple[str, str], options: list[str]) -> list:
    """check's models and llama-speculative-simple's command for the DFlash pair `d`."""
    program = [tools.program("llama-speculative-simple"), "-m", d / "target.gguf", "-md", d / "draft.gguf", *DFLASH]
    return ["--target", d / "target.gguf", "--model", d / "draft.gguf", ref[0], d / ref[1], "--exec", "--", *program, *options,
            "-n", "8", "--temp", "0"]  # fmt: skip


@pytest.mark.parametrize("fault", SIMPLE)
def test_check_names_each_graph_and_chunk_fault_around_the_program(tools, pairs, tmp_path, fault):
    variant, ref, options, finding = SIMPLE[fault]
    errors = check_names_fault(_simple_args(tools, pairs(variant), ref, options), fault, tmp_path, finding)
    assert errors[0]["kind"] == finding, [(f["kind"], f["tensor"]) for f in errors]
    _assert_source(fault, errors[0])


@pytest.mark.parametrize("fault", SERVER_DFLASH)
def test_check_names_dflash_faults_around_llama_server(tools, pairs, tmp_path, fault):
    variant, ref, options, prompt, finding = SERVER_DFLASH[fault]
    d, prompts = pairs(variant), tmp_path / "prompts.txt"
    prompts.write_text(prompt + "\n")  # one request: the capture's, and the probe's
    server = [tools.program("llama-server"), "-m", d / "target.gguf", "-md", d / "draft.gguf", *DFLASH, *options]
    args = ["--target", d / "target.gguf", "--model", d / "draft.gguf", ref[0], d / ref[1], "--prompts", prompts]
    errors = check_names_fault([*args, "--exec", "--", *server], fault, tmp_path, finding)
    assert errors[0]["kind"] == finding, [(f["kind"], f["tensor"]) for f in errors]
    _assert_source(fault, errors[0])


def _server_args(tools, kind: str, d: Path, prompts: Path) -> list:
    """check's models and llama-server's command for the EAGLE3 or MTP pair `d`, one prompt."""
    server = [tools.program("llama-server"), "-m", d / "target.gguf"]
    if kind == "eagle3":
        models = ["--target", d / "target.gguf", "--model", d / "draft.gguf"]
        server += ["-md", d / "draft.gguf", "--spec-type", "draft-eagle3", *STEPS, "-td", "1"]
    else:  # the head inside the target's GGUF; the reference reads the target's checkpoint
        models = ["--target", d / "target.gguf", "--model", d / "target.gguf", "--ref-target", d / "target-hf"]
        server += ["--spec-type", "draft-mtp", *STEPS]
    return [*models, "--prompts", prompts, "--exec", "--", *server]


@pytest.mark.parametrize("fault", SERVER)
def test_check_names_eagle3_and_mtp_faults_around_llama_server(tools, eagle3_pairs, mtp_pairs, tmp_path, fault):
    kind, finding = SERVER[fault]
    d = eagle3_pairs(PAIR.get(fault, kind)) if kind == "eagle3" else mtp_pairs(PAIR.get(fault, kind))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")  # one request: the capture's, and the probe's
    errors = check_names_fault(_server_args(tools, kind, d, prompts), fault, tmp_path, finding)
    assert errors[0]["kind"] == finding, [(f["kind"], f["tensor"]) for f in errors]
    _assert_source(fault, errors[0])


def _assert_source(fault: str, error: dict) -> None:
    """The first error names the source and the side (driver, graph) SOURCE gives the fault, if any."""
    if fault in SOURCE:
        assert (error.get("source"), error["where"]) == SOURCE[fault], error["message"]


# a clean request's prompt: "The quick brown fox" meets, at position 32, a target row whose
# gated delta-net state llama.cpp scans noisier than the f16 cache alone explains (NMSE 2.7e-05 at
# a draft step's mtp_hnorm-6): a false FAIL before the recurrent-state term (REL_RECURRENT in
# diff/tolerance.py, bench/calibrate_recurrent.py)
CLEAN_PROMPT = "The quick brown fox"


def test_check_passes_a_clean_mtp_pair_around_llama_server(tools, mtp_pairs, tmp_path):
    """The same command with no fault planted exits 0, the server's prompt prefilled in more than
    one target decode call (its recurrent target): the batch_last candidate stays a candidate."""
    from typer.testing import CliRunner

    from featdiff.cli import app
    from featdiff.torchref.step_run import run_target_batches

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(CLEAN_PROMPT + "\n")
    kept = ["--keep", str(tmp_path / "dumps"), "--json", str(tmp_path / "check.json")]
    args = ["check", *kept, *map(str, _server_args(tools, "mtp", mtp_pairs("mtp"), prompts))]
    result = CliRunner().invoke(app, args, env={FAULT_VAR: None, "GITHUB_STEP_SUMMARY": None})
    assert result.exit_code == 0, result.output[-3000:]
    assert len(run_target_batches(tmp_path / "dumps" / "run.npz")[0]) >= 2  # the prompt split, as a fault sees it


def test_check_names_the_pinned_servers_eagle3_bridge_on_a_prompt_cut_in_batches(tools, eagle3_pairs, tmp_path):
    """No fault planted: llama-server with `-b 8` prefills the 30-token prompt in four decode calls,
    and the pinned common/speculative.cpp pairs each later call's first token with that call's last
    g row (its bridge row's g a view of pending_g_last, which the refresh overwrites before the
    decode). compare names it at the drafter's g norm, as MTP's `mtp-boundary-future`."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    args = [*_server_args(tools, "eagle3", eagle3_pairs("eagle3"), prompts), "-b", "8", "-ub", "8"]
    errors = check_names_fault(args, None, tmp_path, "wrong_source")
    first = errors[0]
    assert (first["kind"], first["tensor"], first["source"], first["where"]) == (
        "wrong_source", "g_norm-0", "batch_last", "driver"
    ), first["message"]  # fmt: skip
    assert "pending_g_last" in first["message"], first["message"]
