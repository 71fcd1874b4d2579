"""`featdiff check --exec` survives the EAGLE3 and MTP faults it exists to catch (issue 48): each
fault the project plants in the EAGLE3 and MTP drivers (0002, 0009, 0011, 0013) and graphs (0007,
0008, 0013, 0015, 0016, 0017), chosen at run time by FEATDIFF_FAULT around llama-speculative-simple, exits 1 naming the finding
docs/faults.md gives it, never 2 or 3, and keeps its dumps. check's reference is its own (the
run's prompt and rounds, guided by the run), not the one test_eagle3_exec.py and
test_step_faults.py make with --follow, so this also shows the verdict does not hang on how the
reference was made. The DFlash family's faults: test_check_faults.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from featdiff_process import check_names_fault

DRAFT_ARGS = ["--spec-draft-n-max", "3", "--spec-draft-p-min", "0", "-c", "256", "-t", "1"]
# fault -> the finding check must name (docs/faults.md), by drafter kind
EAGLE3 = {
    "eagle3-no-shift": "row_shift",
    "eagle3-concat-swapped": "slot_permutation",
    "eagle3-prenorm-after-norm": "wrong_source",
    "eagle3-step-pos": "position_offset",
    "eagle3-step-seed-state": "wrong_source",
    "eagle3-shift-2": "row_shift",  # 0011
    "eagle3-step-pos-early": "position_offset",
    "eagle3-step-zero-state": "zeros",
    "eagle3-slots-one-layer": "layer_offset",  # 0013
    "eagle3-tap-normed": "wrong_source",
    "eagle3-d2t-dropped": "wrong_source",
    "eagle3-d2t-shifted": "wrong_source",
}
MTP = {
    "mtp-no-shift": "row_shift",
    "mtp-boundary-future": "wrong_source",
    "mtp-hidden-prenorm": "wrong_source",
    "mtp-concat-swapped": "slot_permutation",
    "mtp-recycle-prenorm": "wrong_source",
    "mtp-step-pos": "position_offset",
    "mtp-step-seed-state": "wrong_source",
    "mtp-step-pos-early": "position_offset",  # 0011
    "mtp-step-zero-state": "zeros",
    "mtp-pending-stale": "stale",
}
GLM4MOE = {  # 0013, in glm4-moe.cpp: run on the mtp-glm4moe pair
    "mtp-glm4moe-norms-swapped": "wrong_source",
    "mtp-glm4moe-hidden-layer-before": "layer_offset",
    "mtp-glm4moe-hidden-layer-first": "layer_offset",  # 0015
}
GLM_DSA = {  # 0016, in glm-dsa.cpp: run on the mtp-glm-dsa pair (GLM-5's head)
    "mtp-glm-dsa-raw-state": "wrong_source",
    "mtp-glm-dsa-softmax-routing": "wrong_source",
}
DEEPSEEK2 = {"mtp-deepseek2-rope-halves": "wrong_source"}  # 0017, in deepseek2.cpp: the mtp-deepseek2 pair
CASES = [pytest.param("eagle3", "eagle3", f, k, id=f) for f, k in EAGLE3.items()]
CASES += [pytest.param("mtp", "mtp", f, k, id=f) for f, k in MTP.items()]
CASES += [pytest.param("mtp", "mtp-glm4moe", f, k, id=f) for f, k in GLM4MOE.items()]
CASES += [pytest.param("mtp", "mtp-glm-dsa", f, k, id=f) for f, k in GLM_DSA.items()]
CASES += [pytest.param("mtp", "mtp-deepseek2", f, k, id=f) for f, k in DEEPSEEK2.items()]

pytestmark = pytest.mark.slow  # the pinned converter makes the pairs (cached per machine)


def _args(tools, kind: str, d: Path) -> list[str]:
    """check's models and the program's command line for the pair `d` of `kind`."""
    program = str(tools.program("llama-speculative-simple"))
    if kind == "eagle3":
        models = ["--target", str(d / "target.gguf"), "--model", str(d / "draft.gguf")]
        cmd = [program, "-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf"), "--spec-type", "draft-eagle3"]
        cmd += [*DRAFT_ARGS, "-td", "1", "-p", "The quick brown fox"]
    else:  # the head inside the target's GGUF; the reference reads the target's checkpoint
        models = ["--target", str(d / "target.gguf"), "--model", str(d / "target.gguf")]
        models += ["--ref-target", str(d / "target-hf")]
        cmd = [program, "-m", str(d / "target.gguf"), "--spec-type", "draft-mtp", *DRAFT_ARGS, "-p", "hello world"]
    return [*models, "--exec", "--", *cmd, "-n", "16", "--temp", "0"]


@pytest.mark.parametrize("kind, variant, fault, finding", CASES)
def test_check_names_each_eagle3_and_mtp_fault_and_exits_1(
    tools, eagle3_pairs, mtp_pairs, tmp_path, kind, variant, fault, finding
):
    d = eagle3_pairs(variant) if kind == "eagle3" else mtp_pairs(variant)
    check_names_fault(_args(tools, kind, d), fault, tmp_path, finding)
