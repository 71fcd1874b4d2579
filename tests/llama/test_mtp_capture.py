"""MTP heads end to end on the real library (issue 33): a Qwen3.5, Qwen3.5-MoE, GLM-4.5 or MiMo-V2 target whose
MTP head the pinned converter kept (inside its GGUF, or as a separate `--mtp` GGUF) captured by featdiff's MTP driver
(common_speculative_impl_draft_mtp's flow) compares clean against the reference, from the GGUF's
head and from the checkpoint's; the graph faults of 0008-mtp-graph-faults.patch are named; a GGUF
without a head is refused by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from featdiff.diff import compare_dumps
from featdiff.driver.capture import capture
from featdiff.dump.reader import read_dump
from featdiff.factory.mtp import MTP_SETTINGS
from featdiff.torchref.kind import reference
from featdiff_process import checks_at_once

pytestmark = pytest.mark.slow  # the pinned converter makes the pairs (cached per machine)

TOKENS = "7,21,3,99,140,5,260,33,18,402,77,9"
ROUNDS = 3


def _run_and_ref(d: Path, model: Path, head: Path, tmp: Path, follow: bool = False) -> tuple[Path, Path]:
    """An in-process capture of the head `model` on `d`'s target, and the reference of the head
    at `head` (a GGUF or the checkpoint) on the target's checkpoint, guided by (or following) the run."""
    run = capture(d / "target.gguf", model, tmp / "run.npz", tokens=TOKENS, rounds=ROUNDS)
    given = {"follow": run} if follow else {"tokens": TOKENS, "run": run}
    ref = reference(
        d / "target-hf", head, tmp / "ref.npz", prompt=None, rounds=ROUNDS, dtype="float32", device="cpu",
        kv_dtype="f16", llama_dir=None, **{"tokens": None, **given},
    )  # fmt: skip
    return run, ref


@pytest.mark.parametrize(
    "variant, model, head",
    [
        ("mtp", "target.gguf", "target.gguf"),  # the heads inside the target GGUF, run on the target's own model
        ("mtp", "target.gguf", "target-hf"),  # the reference from the checkpoint's mtp.* tensors
        ("mtp-separate", "draft.gguf", "draft.gguf"),  # a separate `--mtp` head GGUF
        ("mtp-qwen35moe", "target.gguf", "target.gguf"),  # Qwen3.5-MoE: the head's FFN routed over experts
        ("mtp-qwen35moe", "target.gguf", "target-hf"),  # its head from the checkpoint's per-expert tensors
        ("mtp-glm4moe", "target.gguf", "target.gguf"),  # GLM-4.5: biased attention, sigmoid routing, choice bias
        ("mtp-glm4moe", "target.gguf", "target-hf"),  # its head from the checkpoint's decoder layer n_layer
        ("mtp-mimo2", "target.gguf", "target.gguf"),  # MiMo-V2: handed the pre-norm hidden, a sliding-window head
        ("mtp-mimo2", "target.gguf", "target-hf"),  # its head from the checkpoint's model.mtp.layers.0
        ("mtp-deepseek2", "target.gguf", "target.gguf"),  # DeepSeek-V3: MLA (absorbed, f16 latent cache), MoE
        ("mtp-deepseek2", "target.gguf", "target-hf"),  # its head from decoder layer n_layer, kv_b split as converted
        ("mtp-deepseek32", "target.gguf", "target.gguf"),  # DeepSeek-V3.2: the trunk's indexer dense at these lengths
        ("mtp-deepseek32", "target.gguf", "target-hf"),  # its head (deepseek2's) from the checkpoint, indexer unused
        ("mtp-glm-dsa", "target.gguf", "target.gguf"),  # GLM-5: deepseek32's head, sigmoid routing unsaid in the file
        ("mtp-glm-dsa", "target.gguf", "target-hf"),  # its head from the checkpoint's layer n_layer, routed by sigmoid
    ],
)
def test_a_correct_head_compares_clean_with_nothing_skipped(mtp_pairs, variant, model, head, tmp_path):
    d = mtp_pairs(variant)
    run, ref = _run_and_ref(d, d / model, d / head, tmp_path)
    c = compare_dumps(ref, run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]
    assert not c.skipped
    with read_dump(run) as dump:
        m = dump.manifest
    draft = {r.name for r in m.records if r.role == "draft"}
    assert {"mtp_h_input", "mtp_hnorm-6", "mtp_enorm-6", "mtp_concat-6", "mtp_eh_proj-6", "h_nextn"} <= draft
    assert {r.name for r in m.records if r.role == "target"} >= {"h_nextn", "result_output"}
    assert m.models["draft"]["architecture"] == MTP_SETTINGS[variant].arch
    residual = (
        "mtp_ffn_inp-6"
        if variant in ("mtp-glm4moe", "mtp-mimo2", "mtp-glm-dsa") or "deepseek" in variant
        else "mtp_attn_residual-6"
    )  # their graphs' name
    assert residual in draft and residual in {p.name for p in c.pairs}
    assert all(r.drafts for r in m.rounds)
    assert all(e.n_tokens == 1 for e in m.evals if e.phase == "draft")
    # what the head is handed is compared on every catch-up batch and every draft step
    handed = {p.phase for p in c.pairs if p.name == "mtp_h_input"}
    assert handed == {"inject", "draft"}


# each fault planted in the qwen35 graphs, in glm4-moe's and in mimo2's (0008-mtp-graph-faults.patch):
# MiMo-V2's head is trained on the pre-norm state, so its norm faults are the reverse ones
CONCAT_SWAPPED = ("mtp-concat-swapped", "slot_permutation", "mtp_concat-6", "[h_norm, e_norm]")
POSTNORM_TRAINED_FAULTS = [
    ("mtp-hidden-prenorm", "wrong_source", "mtp_h_input", "before the final norm"),
    CONCAT_SWAPPED,
    ("mtp-recycle-prenorm", "wrong_source", "mtp_h_input", "previous step's state before the head norm"),
]
PRENORM_TRAINED_FAULTS = [
    ("mtp-hidden-postnorm", "wrong_source", "mtp_h_input", "after the final norm"),
    CONCAT_SWAPPED,
    ("mtp-recycle-postnorm", "wrong_source", "mtp_h_input", "previous step's state after the head norm"),
]
PLANTED = [(v, *f) for v in ("mtp", "mtp-glm4moe") for f in POSTNORM_TRAINED_FAULTS]
PLANTED += [("mtp-mimo2", *f) for f in PRENORM_TRAINED_FAULTS]


@pytest.mark.parametrize("variant, fault, kind, tensor, words", PLANTED)
def test_each_planted_graph_fault_is_named(mtp_pairs, monkeypatch, tmp_path, variant, fault, kind, tensor, words):
    d = mtp_pairs(variant)
    monkeypatch.setenv("FEATDIFF_FAULT", fault)  # 0008-mtp-graph-faults.patch, read by libllama's graph
    run, ref = _run_and_ref(d, d / "target.gguf", d / "target.gguf", tmp_path, follow=True)
    c = compare_dumps(ref, run)
    errors = [f for f in c.findings if f.severity == "error"]
    assert [(f.kind, f.tensor) for f in errors] == [(kind, tensor)], [f.message for f in errors]
    assert words in errors[0].message
    assert errors[0].fields["where"] == "graph", errors[0].fields["where_reason"]  # the same GGUF on both sides
    assert not [f for f in c.findings if f.kind == "flow_note"]  # the faulty graph keeps upstream's node order
    phases = {"mtp-recycle-prenorm": "draft", "mtp-recycle-postnorm": "draft"}  # step 1 reads the target's row
    assert c.first_divergence is not None and c.pairs[c.first_divergence].phase == phases.get(fault, "inject")


def test_a_gguf_without_a_head_is_refused_by_name(mtp_pairs, tmp_path):
    d = mtp_pairs("mtp-separate")  # its target.gguf was converted with --no-mtp
    line = _refused_capture(d / "target.gguf", tmp_path)
    assert "nextn_predict_layers" in line and "--no-mtp" in line, line


def _refused_capture(gguf: Path, tmp_path: Path) -> str:
    """The one line `featdiff capture` of `gguf` as target and head says, refusing it with exit 2
    and writing no dump."""
    out = tmp_path / "run.npz"
    done = subprocess.run(
        [sys.executable, "-c", "from featdiff.cli import main; main()", "capture", "--target", str(gguf),
         "--model", str(gguf), "--tokens", TOKENS, "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and not out.exists(), lines
    return lines[0]


def test_check_passes_the_trained_head_and_fails_it_with_a_planted_fault(mtp_pairs, tmp_path):
    """`featdiff check` on the trained head (the target's reference from its checkpoint: a Qwen3.5
    target runs through transformers): the wiring compares clean and the run accepts as the
    reference does; with the concat swapped (0008) the same command fails, naming it."""
    import os

    d = mtp_pairs("trained-mtp")
    env = {k: v for k, v in os.environ.items() if k != "FEATDIFF_FAULT"}
    model = d / "target.gguf"  # the head inside the target's GGUF
    args = ["--target", model, "--model", model, "--ref-target", d / "target-hf", "--prompts", d / "prompts.txt"]
    done, faulty = checks_at_once(args, [env, {**env, "FEATDIFF_FAULT": "mtp-concat-swapped"}], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout and "agree" in done.stdout
    assert faulty.returncode == 1, faulty.stdout + faulty.stderr
    assert "slot_permutation" in faulty.stdout and "mtp_concat-6" in faulty.stdout
