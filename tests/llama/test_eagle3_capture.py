"""EAGLE3 end to end on the real library (issue 32): the pinned converter's pair captured by
featdiff's EAGLE3 driver (common_speculative_impl_draft_eagle3's flow) compares clean against the
reference with nothing skipped; the DFlash layer convention applied to it is named; an id the
target's layer count reads a state featdiff does not model and is refused by name."""

from __future__ import annotations

import subprocess
import sys

import pytest

from featdiff.core.errors import InputError
from featdiff.diff import compare_dumps
from featdiff.driver.capture import capture
from featdiff.dump.reader import read_dump
from featdiff.factory.gguf_rewrite import rewrite_gguf
from featdiff.torchref.kind import reference
from featdiff_process import checks_at_once

from eagle3_real import ROUNDS, TOKENS, run_and_ref

pytestmark = pytest.mark.slow  # the pinned converter makes the pairs (cached per machine)


@pytest.mark.parametrize("variant", ["eagle3", "eagle3-norm-before-fc", "eagle3-llama", "eagle3-own-embd"])
def test_a_correct_pair_compares_clean_with_nothing_skipped(eagle3_pairs, variant, tmp_path):
    d = eagle3_pairs(variant)
    run, ref = run_and_ref(d, d / "draft.gguf", tmp_path)
    c = compare_dumps(ref, run)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]
    assert not c.skipped
    with read_dump(run) as dump:
        m = dump.manifest
    names = {r.name for r in m.records if r.role == "draft"}
    assert {"inp_embd", "fc_out", "concat_embd-0", "eagle3_prenorm-0", "result_output", "draft_logits"} <= names
    # the encoder's features from its graph, also where only enc_input_norm reads them (issue 42)
    encodes = {e.eval for e in m.evals if e.call == "encode"}
    assert encodes and {r.op for r in m.records if r.name == "inp_embd" and r.eval in encodes} == {"NONE"}
    assert m.models["draft"]["architecture"] == "eagle3" and len(m.models["draft"]["target_layers"]) == 3
    # every round drafted, one token an eval (the seed, then the steps), each eval's rows compared
    assert all(r.drafts for r in m.rounds)
    drafted = [e for e in m.evals if e.phase == "draft"]
    assert drafted and all(e.n_tokens == 1 for e in drafted)
    compared = [p for p in c.pairs if p.phase == "draft" and p.name == "result_output"]
    assert len(compared) == len(m.rounds)  # each round's steps, joined by position


def test_the_dflash_layer_convention_on_an_eagle3_drafter_is_a_layer_offset(eagle3_pairs, tmp_path):
    d = eagle3_pairs("eagle3-default-layers")  # [2, 3, 3] on the 6-layer target: + 1 stays inside it
    plus1 = rewrite_gguf(d / "draft.gguf", tmp_path / "draft-plus1.gguf", keys={"eagle3.target_layers": [3, 4, 4]})
    run, ref = run_and_ref(d, plus1, tmp_path)
    c = compare_dumps(ref, run)
    first = next(f for f in c.findings if f.severity == "error")
    assert first.kind == "layer_offset", first.message
    assert first.fields["observed_layers"] == [3, 4, 4] and first.fields["expected_layers"] == [2, 3, 3]
    assert "eagle3.target_layers" in first.message and "dflash" not in first.message
    assert [f.kind for f in c.findings if f.severity == "error"] == ["layer_offset"]  # fc_out etc. inherit it


def test_an_id_equal_to_the_layer_count_is_refused_by_name(eagle3_pairs, tmp_path):
    d = eagle3_pairs("eagle3")
    bad = rewrite_gguf(d / "draft.gguf", tmp_path / "draft-nextn.gguf", keys={"eagle3.target_layers": [1, 3, 6]})
    done = subprocess.run(
        [sys.executable, "-c", "from featdiff.cli import main; main()", "capture", "--target", str(d / "target.gguf"), "--model", str(bad),
         "--tokens", TOKENS, "-o", str(tmp_path / "run.npz")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "nextn" in lines[0] and "does not model" in lines[0] and str(bad) in lines[0]
    assert not (tmp_path / "run.npz").exists()


def test_the_fixture_command_lists_and_writes_eagle3_pairs(tmp_path):
    listed = subprocess.run(
        [sys.executable, "-c", "from featdiff.cli import main; main()", "fixture", "--list"],
        capture_output=True,
        text=True,
    )
    assert all(f"\n{v} " in listed.stdout for v in ("eagle3-norm-before-fc", "dspark", "dflash2", "qwen3moe"))
    d2 = subprocess.run(
        [sys.executable, "-c", "from featdiff.cli import main; main()", "fixture", str(tmp_path / "d2"), "--variant", "dflash2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert d2.returncode == 0 and (tmp_path / "d2" / "draft.gguf").is_file(), d2.stderr
    done = subprocess.run(
        [sys.executable, "-c", "from featdiff.cli import main; main()", "fixture", str(tmp_path / "fx"), "--variant", "eagle3-full-vocab"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "fx" / "draft.gguf").is_file() and "eagle3-full-vocab" in (
        tmp_path / "fx" / "VARIANT"
    ).read_text()


@pytest.mark.parametrize(
    ("fault", "kind", "tensor", "source"),
    [
        ("eagle3-concat-swapped", "slot_permutation", "concat_embd-0", None),
        ("eagle3-prenorm-after-norm", "wrong_source", "g_norm-0", "after_norm"),
    ],
)
def test_an_eagle3_graph_fault_of_the_patched_library_is_named(
    eagle3_pairs, fault, kind, tensor, source, tmp_path, monkeypatch
):
    """0007-eagle3-graph-faults.patch plants them in libllama's eagle3 graph (FEATDIFF_FAULT, read
    when the graph is built): the in-process driver runs them, the reference of the correct pair
    names them at the record where they first differ."""
    d = eagle3_pairs("eagle3")
    clean = tmp_path / "clean"
    clean.mkdir()
    _, ref = run_and_ref(d, d / "draft.gguf", clean)
    monkeypatch.setenv("FEATDIFF_FAULT", fault)
    run = capture(d / "target.gguf", d / "draft.gguf", tmp_path / "run.npz", tokens=TOKENS, rounds=ROUNDS)
    first = next(f for f in compare_dumps(ref, run).findings if f.severity == "error")
    assert (first.kind, first.tensor) == (kind, tensor), first.message
    assert first.fields["where"] == "graph", first.fields["where_reason"]  # the reference read the same GGUF
    if source is not None:
        assert first.fields["source"] == source
    else:
        assert list(first.fields["permutation"]) == [1, 0]


def test_check_passes_the_trained_eagle3_pair_and_fails_it_with_a_planted_fault(eagle3_pairs, tmp_path):
    """`featdiff check` on the trained pair: the wiring compares clean and the run accepts as the
    reference does (about 3.9 tokens per block of 3 drafts); with the recycled state taken after
    the norm (0007) the same command fails and names it."""
    import os

    d = eagle3_pairs("trained-eagle3")
    env = {k: v for k, v in os.environ.items() if k != "FEATDIFF_FAULT"}
    args = ["--target", d / "target.gguf", "--model", d / "draft.gguf", "--prompts", d / "prompts.txt"]
    done, faulty = checks_at_once(args, [env, {**env, "FEATDIFF_FAULT": "eagle3-prenorm-after-norm"}], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout and "agree" in done.stdout
    assert faulty.returncode == 1, faulty.stdout + faulty.stderr
    assert "wrong_source" in faulty.stdout and "g_norm-0" in faulty.stdout


@pytest.mark.parametrize("variant", ["eagle3", "eagle3-norm-before-fc", "eagle3-default-layers", "eagle3-qwen3moe"])
def test_the_reference_from_the_hf_checkpoints_compares_clean(eagle3_pairs, variant, tmp_path):
    """The trained checkpoint as the user has it (target-hf/, draft-hf/: rotate-half q/k, d2t
    offsets, the converter's default layers where the config states none) is the reference."""
    d = eagle3_pairs(variant)
    run = capture(d / "target.gguf", d / "draft.gguf", tmp_path / "run.npz", tokens=TOKENS, rounds=ROUNDS)
    ref = reference(
        d / "target-hf", d / "draft-hf", tmp_path / "ref.npz", prompt=None, tokens=TOKENS, rounds=ROUNDS,
        dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None, run=run,
    )  # fmt: skip
    c = compare_dumps(ref, run)
    assert c.ok and not c.skipped, [f.message for f in c.findings if f.severity == "error"]
    with read_dump(ref) as dump:
        assert dump.manifest.models["draft"]["sha256"]  # the checkpoint's files, hashed


def test_an_eagle3_key_the_reference_does_not_model_is_listed_recorded_and_refused(eagle3_pairs, tmp_path):
    """featdiff.kinds.eagle3: lint lists it (unmodelled), a capture runs and records it in the
    manifest, the reference refuses the drafter by name (exit 2)."""
    d = eagle3_pairs("eagle3")
    odd = rewrite_gguf(
        d / "draft.gguf", tmp_path / "draft-yarn.gguf", keys={"eagle3.rope.scaling.yarn_ext_factor": 0.5}
    )
    lint = subprocess.run(
        [sys.executable, "-c", "from featdiff.cli import main; main()", "lint", str(odd), "--target", str(d / "target.gguf")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert (
        "eagle3.rope.scaling.yarn_ext_factor" in lint.stdout + lint.stderr
        and "not modelled" in lint.stdout + lint.stderr
    )
    run = capture(d / "target.gguf", odd, tmp_path / "run.npz", tokens=TOKENS, rounds=1)
    with read_dump(run) as dump:
        assert dump.manifest.models["draft"]["unmodelled"] == ["eagle3.rope.scaling.yarn_ext_factor"]
    with pytest.raises(InputError, match="does not model"):
        reference(
            d / "target.gguf", odd, tmp_path / "ref.npz", prompt=None, tokens=TOKENS, rounds=1,
            dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None,
        )  # fmt: skip
