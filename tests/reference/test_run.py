"""The reference dump: contract fields, record shapes, the greedy flow's rounds, the candidate
records, and the command line's input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from featdiff.core import names
from featdiff.cli import app
from featdiff.dump.manifest import Manifest
from featdiff.dump.reader import read_dump
from featdiff.dump.records import Eval
from featdiff.dump.writer import DumpWriter
from featdiff.torchref.dflash.drafter import encode
from featdiff.dump.blocks import run_block_rows
from featdiff.torchref.load import load_draft

runner = CliRunner()
B, N_EMBD, N_VOCAB, N_LAYER_TGT, N_LAYER_DFT = 4, 64, 512, 6, 2
CANDIDATE_BOUND = 1e-6  # rel L2: the same float32 ops on the same features, weights from another file

DRAFT_SHAPES = {
    names.INP_NOISE_EMBD: (B, N_EMBD),
    "noise_norm-0": (B, N_EMBD),
    "Qcur-0": (B, 4, 16),
    "Kcur-0": (B, 2, 16),
    "Vcur-0": (B, 2, 16),
    "kqv_out-0": (B, 64),
    "ffn_inp-1": (B, N_EMBD),
    "ffn_out-1": (B, N_EMBD),
    "l_out-1": (B, N_EMBD),
    names.RESULT_NORM: (B, N_EMBD),
    names.RESULT_OUTPUT: (B, N_VOCAB),
}


def test_manifest_carries_the_contract_fields(ref_dump):
    with read_dump(ref_dump("clean")) as d:
        m = d.manifest
    assert m.source == "reference"
    assert m.prompt_tokens == tuple(range(1, 11))
    assert set(m.build) == {"torch", "device", "dtype", "kv_dtype", "block_rows", "p_min"}
    assert m.build["kv_dtype"] == "f16" and m.build["dtype"] == "float32"
    assert m.build["block_rows"] == B  # llama.cpp's default: min(3, block_size - 1) + 1 = 4 for block size 4
    draft = m.models["draft"]
    assert draft["target_layers"] == [2, 4] and draft["block_size"] == B and draft["mask_token_id"] == 511
    assert draft["has_own_embeddings"] is False and draft["architecture"] == "dflash"
    assert m.models["target"]["architecture"] == "qwen3" and m.models["target"]["n_layer"] == N_LAYER_TGT
    assert len(m.models["target"]["sha256"]) == 64


def test_records_are_float32_with_llama_cpp_shapes(ref_dump):
    with read_dump(ref_dump("clean")) as d:
        by_eval = {}
        for r in d.records():
            assert r.dtype == "float32" and r.occurrence == 0 and r.ne == tuple(reversed(r.shape))
            by_eval.setdefault(r.eval, {})[r.name] = r.shape
    prefill, inject, draft, verify = (by_eval[i] for i in range(4))
    assert prefill["layer_inp-0"] == (9, N_EMBD) and prefill["l_out-4"] == (9, N_EMBD)
    assert prefill[f"l_out-{N_LAYER_TGT - 1}"] == (0, N_EMBD)  # the prefill has no output rows
    assert prefill[names.RESULT_OUTPUT] == (0, N_VOCAB)
    assert {f"layer_inp-{L}" for L in range(N_LAYER_TGT)} <= set(prefill)
    assert inject[names.INP_TARGET_FEATURES] == (9, 2 * N_EMBD) and inject[names.INP_G_EMBEDDINGS] == (9, N_EMBD)
    assert inject["Kcur_injected-1"] == (9, 2, 16) and inject["Vcur_injected-1"] == (9, 2, 16)
    for name, shape in DRAFT_SHAPES.items():
        assert draft[name] == shape, name
    assert verify[f"l_out-{N_LAYER_TGT - 1}"] == (B, N_EMBD) and verify[names.RESULT_OUTPUT] == (B, N_VOCAB)


def test_rounds_follow_the_greedy_flow(ref_dump):
    with read_dump(ref_dump("clean")) as d:
        m = d.manifest
        pos0, anchor = len(m.prompt_tokens) - 1, m.prompt_tokens[-1]
        for r in m.rounds:
            assert (r.pos0, r.anchor) == (pos0, anchor)
            assert len(r.drafts) == B - 1 and 0 <= r.accepted <= B - 1
            assert len(r.target_tokens) == r.accepted + 1
            assert r.drafts[: r.accepted] == r.target_tokens[: r.accepted]
            draft_eval, verify_eval, inject_eval = (e for e in m.evals if e.round == r.round)
            logits = d.array(f"e{draft_eval.eval:05d}.draft.{names.RESULT_OUTPUT}.0")
            assert tuple(logits[1:].argmax(-1)) == r.drafts  # DFlash reads slots 1..B-1
            assert draft_eval.token_ids == (anchor,) + (511,) * (B - 1)
            assert verify_eval.token_ids == (anchor,) + r.drafts
            assert (
                draft_eval.positions == verify_eval.positions == inject_eval.positions == tuple(range(pos0, pos0 + B))
            )
            pos0, anchor = pos0 + r.accepted + 1, r.target_tokens[-1]
    assert [(e.role, e.phase) for e in m.evals[:5]] == [
        ("target", "prefill"),
        ("draft", "inject"),
        ("draft", "draft"),
        ("target", "verify"),
        ("draft", "inject"),
    ]
    assert [e.eval for e in m.evals] == list(range(len(m.evals)))


def test_slot_candidate_equals_the_swapped_fc_gguf(ref_dump, variant_dir):
    swapped = load_draft(variant_dir("slots-swapped") / "draft.gguf", torch.float32, torch.device("cpu"))
    with read_dump(ref_dump("slots-swapped", model="draft-hf")) as d:
        features = d.array("e00001.draft.inp_target_features.0")
        candidate = d.array("e00001.draft." + names.candidate_name(names.INP_G_EMBEDDINGS, "slots=1,0") + ".0")
        truth = d.array("e00001.draft.inp_g_embeddings.0")
    run_like = encode(swapped, torch.from_numpy(features)).numpy()
    assert np.linalg.norm(run_like - candidate) <= CANDIDATE_BOUND * np.linalg.norm(candidate)
    assert np.linalg.norm(run_like - truth) > 0.1 * np.linalg.norm(truth)


def test_table_candidate_is_the_target_embedding(ref_dump, variant_dir):
    from safetensors.numpy import load_file

    table = load_file(str(variant_dir("own-embd") / "target-hf" / "model.safetensors"))["model.embed_tokens.weight"]
    with read_dump(ref_dump("own-embd")) as d:
        for e in (e for e in d.manifest.evals if e.phase == "draft"):
            got = d.array(f"e{e.eval:05d}.draft." + names.candidate_name(names.INP_NOISE_EMBD, "table=target") + ".0")
            np.testing.assert_array_equal(got, table[list(e.token_ids)])


def test_f32_cache_changes_attention_numerics_only(ref_dump):
    with read_dump(ref_dump("clean", kv_dtype="f16")) as f16, read_dump(ref_dump("clean", kv_dtype="f32")) as f32:
        assert f16.manifest.rounds == f32.manifest.rounds
        a, b = f16.array("e00002.draft.kqv_out-0.0"), f32.array("e00002.draft.kqv_out-0.0")
        assert 0 < np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)
        np.testing.assert_array_equal(f16.array("e00002.draft.Qcur-0.0"), f32.array("e00002.draft.Qcur-0.0"))


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "exactly one of --prompt"),
        (["--tokens", "1,2", "--prompt", "hi"], "exactly one of --prompt"),
        (["--tokens", "5"], "at least 2"),
        (["--tokens", "1,x"], "comma-separated integers"),
        (["--tokens", "1,600"], "outside the target vocabulary of 512"),
        (["--tokens", "1,2", "--dtype", "int8"], "--dtype 'int8'"),
        (["--tokens", "1,2", "--kv-dtype", "q8_0"], "--kv-dtype 'q8_0'"),
    ],
)
def test_cli_refuses_unusable_input_with_exit_2(args, message, variant_dir, tmp_path):
    d = variant_dir("clean")
    result = runner.invoke(
        app,
        [
            "reference",
            "--target",
            str(d / "target.gguf"),
            "--model",
            str(d / "draft.gguf"),
            "-o",
            str(tmp_path / "ref.npz"),
            *args,
        ],
    )
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_cli_prompt_with_two_hf_dirs_needs_tokens(variant_dir, tmp_path):
    d = variant_dir("clean")
    result = runner.invoke(
        app,
        [
            "reference",
            "--target",
            str(d / "target-hf"),
            "--model",
            str(d / "draft-hf"),
            "-o",
            str(tmp_path / "ref.npz"),
            "--prompt",
            "hello",
        ],
    )
    assert result.exit_code == 2
    assert "pass --tokens" in result.output


def test_cli_writes_a_readable_dump(variant_dir, tmp_path):
    d = variant_dir("clean")
    out = tmp_path / "ref.npz"
    result = runner.invoke(
        app,
        [
            "reference",
            "--target",
            str(d / "target-hf"),
            "--model",
            str(d / "draft.gguf"),
            "--tokens",
            "3,1,4,1,5",
            "--rounds",
            "1",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    with read_dump(out) as dump:
        assert len(dump.manifest.rounds) == 1 and len(dump.manifest.evals) == 5


def test_prompt_is_tokenized_with_the_gguf_vocabulary(variant_dir, tmp_path):
    from featdiff.llama.tokenize import tokenize

    d = variant_dir("clean")
    out = tmp_path / "ref.npz"
    result = runner.invoke(
        app,
        [
            "reference",
            "--target",
            str(d / "target-hf"),
            "--model",
            str(d / "draft.gguf"),
            "--prompt",
            "w7 w21 w3",
            "--rounds",
            "1",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    with read_dump(out) as dump:
        assert list(dump.manifest.prompt_tokens) == tokenize(d / "draft.gguf", "w7 w21 w3")


def _reference_cli(d, out, *args):
    return runner.invoke(
        app,
        [
            "reference",
            "--target",
            str(d / "target.gguf"),
            "--model",
            str(d / "draft.gguf"),
            "--tokens",
            "3,1,4,1,5",
            "--rounds",
            "2",
            "-o",
            str(out),
            *args,
        ],
    )


def test_block_3_decodes_3_row_draft_blocks(variant_dir, tmp_path):
    out = tmp_path / "ref.npz"
    result = _reference_cli(variant_dir("clean"), out, "--block", "3")
    assert result.exit_code == 0, result.output
    with read_dump(out) as d:
        m = d.manifest
        assert m.build["block_rows"] == 3
        for r in m.rounds:
            draft_eval, verify_eval, inject_eval = (e for e in m.evals if e.round == r.round)
            assert draft_eval.token_ids == (r.anchor, 511, 511) and len(r.drafts) == 2
            assert (
                draft_eval.positions
                == verify_eval.positions
                == inject_eval.positions
                == (r.pos0, r.pos0 + 1, r.pos0 + 2)
            )
            assert d.array(f"e{draft_eval.eval:05d}.draft.{names.RESULT_OUTPUT}.0").shape == (3, N_VOCAB)


def _dump_of_evals(path, evals):
    """A run dump holding only these evals: the manifest is all `--run` reads."""
    return DumpWriter(path).close(Manifest(source="llama.cpp", models={}, build={}, evals=tuple(evals), records=()))


def _draft(i, n_tokens, phase="draft", rc=0):
    return Eval(
        eval=i,
        role="draft",
        phase=phase,
        n_tokens=n_tokens,
        positions=tuple(range(n_tokens)),
        token_ids=(1,) * n_tokens,
        seq_ids=(0,) * n_tokens,
        round=1,
        rc=rc,
    )


def test_run_block_length_ignores_failed_and_warmup_decodes():
    evals = (_draft(0, 1, phase="warmup"), _draft(1, 3), _draft(2, 5, rc=-1), _draft(3, 3))
    assert run_block_rows(evals, "run.npz") == 3
    assert run_block_rows((_draft(0, 1, phase="warmup"),), "run.npz") is None


def test_a_one_token_step_drafters_block_is_its_longest_verify():
    """EAGLE3 and MTP draft a decode per token: the block `check --run` probes with is the anchor
    and the drafts of the run's fullest round, not a draft decode's one row."""
    from dataclasses import replace

    steps = tuple(_draft(i, 1) for i in range(3))
    verifies = (
        replace(_draft(3, 4), role="target", phase="verify"),
        replace(_draft(4, 2), role="target", phase="verify"),
    )
    assert run_block_rows(steps + verifies, "run.npz", steps=True) == 4
    assert run_block_rows(steps, "run.npz", steps=True) is None


def _one_line(result) -> str:
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("featdiff: error: "), result.output
    return lines[0]


def _run_files(tmp) -> dict:
    """What the refusals below pass to --run, by file name: crafted dumps and a non-dump."""
    (tmp / "notes.npz").write_text("not a dump\n")
    return {
        "one.npz": _dump_of_evals(tmp / "one.npz", [_draft(0, 3)]),
        "mixed.npz": _dump_of_evals(tmp / "mixed.npz", [_draft(0, 3), _draft(4, 4)]),
        "nodraft.npz": _dump_of_evals(tmp / "nodraft.npz", [_draft(0, 3, rc=1)]),
        "notes.npz": tmp / "notes.npz",
        "missing.npz": tmp / "missing.npz",
    }


@pytest.mark.parametrize(
    "args, names_it, message",
    [
        (["--block", "0"], "--block 0", "expected 2 .. 4 rows"),
        (["--block", "99"], "--block 99", "dflash.block_size = 4"),
        (["--block", "3", "--run", "one.npz"], "--run", "pass one of them"),
        (["--run", "missing.npz"], "missing.npz", "no such dump"),
        (["--run", "notes.npz"], "notes.npz", "not a readable .npz"),
        (["--run", "mixed.npz"], "mixed.npz", "draft blocks differ in length (3 rows in evals 0; 4 rows in evals 4)"),
        (["--run", "nodraft.npz"], "nodraft.npz", "no draft eval"),
    ],
)
def test_cli_refuses_an_unusable_block_length_with_one_line(variant_dir, tmp_path, args, names_it, message):
    files = _run_files(tmp_path)
    result = _reference_cli(variant_dir("clean"), tmp_path / "ref.npz", *(str(files.get(a, a)) for a in args))
    assert result.exit_code == 2, result.output
    line = _one_line(result)
    assert names_it in line and message in line
    assert not (tmp_path / "ref.npz").exists()
