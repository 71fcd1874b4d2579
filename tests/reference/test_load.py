"""Weights from GGUF and from Hugging Face directories give the same reference; inconsistent
log-SNR exports are refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from featdiff.core import names
from featdiff.dump.reader import read_dump
from featdiff.core.errors import InputError
from featdiff.torchref.load import load_draft, load_target

CPU = torch.device("cpu")
LLAMA_HF_VS_GGUF = 1e-5  # rel L2: ggml's normal RoPE vs rotate-half sum q.k in another order


def _records(path):
    with read_dump(path) as d:
        return {r.key: d.array(r) for r in d.records()}, d.manifest


@pytest.mark.parametrize("variant", ["clean", "own-embd", "log-snr"])
def test_drafter_from_hf_dir_gives_identical_records(ref_dump, variant):
    gguf_arrays, gguf_manifest = _records(ref_dump(variant, model="draft.gguf"))
    hf_arrays, hf_manifest = _records(ref_dump(variant, model="draft-hf"))
    assert hf_manifest.models["draft"]["target_layers"] == gguf_manifest.models["draft"]["target_layers"] == [2, 4]
    assert hf_arrays.keys() == gguf_arrays.keys()
    for key, a in gguf_arrays.items():
        assert np.array_equal(a, hf_arrays[key]), key
    assert hf_manifest.rounds == gguf_manifest.rounds


def test_hf_target_layer_ids_are_stored_plus_one(variant_dir):
    d = variant_dir("clean")
    hf_ids = json.loads((d / "draft-hf" / names.HF_CONFIG).read_text())[names.HF_DFLASH_CONFIG][
        names.HF_TARGET_LAYER_IDS
    ]
    draft = load_draft(d / "draft-hf", torch.float32, CPU)
    assert draft.target_layers == tuple(i + 1 for i in hf_ids)


def test_llama_target_from_hf_matches_gguf_with_permuted_qk(ref_dump):
    gguf_arrays, gguf_manifest = _records(ref_dump("llama", target="target.gguf"))
    hf_arrays, hf_manifest = _records(ref_dump("llama", target="target-hf"))
    assert hf_arrays.keys() == gguf_arrays.keys()
    for key, a in gguf_arrays.items():
        b = hf_arrays[key]
        assert np.linalg.norm(a - b) <= LLAMA_HF_VS_GGUF * max(np.linalg.norm(a), 1e-30), key
    assert hf_manifest.rounds == gguf_manifest.rounds


def test_llama_gguf_runs_normal_rope_and_hf_neox(variant_dir):
    d = variant_dir("llama")
    assert load_target(d / "target.gguf", torch.float32, CPU).hparams.rope_type == "normal"
    assert load_target(d / "target-hf", torch.float32, CPU).hparams.rope_type == "neox"


def test_log_snr_flag_without_tensors_is_refused(variant_dir, edit_gguf, tmp_path):
    broken = edit_gguf(variant_dir("log-snr") / "draft.gguf", tmp_path / "D.gguf", drop_tensors=names.LOG_SNR_TENSORS)
    with pytest.raises(InputError, match=r"D\.gguf: dflash\.log_snr_conditioning = true but log_snr_fc1\.weight"):
        load_draft(broken, torch.float32, CPU)


def test_log_snr_tensors_without_flag_are_refused(variant_dir, edit_gguf, tmp_path):
    broken = edit_gguf(variant_dir("log-snr") / "draft.gguf", tmp_path / "D.gguf", drop_keys=(names.KEY_LOG_SNR,))
    with pytest.raises(
        InputError, match=r"D\.gguf: carries log_snr_fc1\.weight.* but dflash\.log_snr_conditioning is not set"
    ):
        load_draft(broken, torch.float32, CPU)


def test_log_snr_flag_without_range_is_refused(variant_dir, edit_gguf, tmp_path):
    broken = edit_gguf(
        variant_dir("log-snr") / "draft.gguf",
        tmp_path / "D.gguf",
        drop_keys=(names.KEY_MIN_LOG_SNR, names.KEY_MAX_LOG_SNR),
    )
    with pytest.raises(InputError, match="log-SNR range"):
        load_draft(broken, torch.float32, CPU)


def test_hf_log_snr_tensors_without_flag_are_refused(variant_dir, tmp_path):
    hf = shutil.copytree(variant_dir("log-snr") / "draft-hf", tmp_path / "draft-hf")
    config = json.loads((hf / names.HF_CONFIG).read_text())
    config[names.HF_DFLASH_CONFIG][names.HF_LOG_SNR] = False
    (hf / names.HF_CONFIG).write_text(json.dumps(config))
    with pytest.raises(InputError, match="dflash_config.log_snr_conditioning is not set"):
        load_draft(hf, torch.float32, CPU)


def test_gguf_missing_dflash_keys_is_refused(variant_dir, edit_gguf, tmp_path):
    broken = edit_gguf(variant_dir("clean") / "draft.gguf", tmp_path / "D.gguf", drop_keys=(names.KEY_TARGET_LAYERS,))
    with pytest.raises(InputError, match=r"D\.gguf: metadata key 'dflash\.target_layers' is missing"):
        load_draft(broken, torch.float32, CPU)


def test_target_that_is_not_a_gguf_is_refused(tmp_path):
    bogus = tmp_path / "T.gguf"
    bogus.write_bytes(b"not a gguf at all")
    with pytest.raises(InputError, match=r"T\.gguf: not a readable GGUF"):
        load_target(bogus, torch.float32, CPU)


def test_quantized_weights_are_dequantized_by_the_gguf_package(variant_dir, tmp_path):
    src = variant_dir("clean") / "draft.gguf"
    fc = load_draft(src, torch.float32, CPU).fc.numpy()
    q8 = quantize(fc, GGMLQuantizationType.Q8_0)
    path = _with_raw_tensor(src, tmp_path / "q8.gguf", names.T_FC, q8, GGMLQuantizationType.Q8_0)
    loaded = load_draft(path, torch.float32, CPU).fc.numpy()
    assert loaded.shape == fc.shape
    assert np.abs(loaded - fc).max() <= np.abs(fc).max() / 127  # q8_0: one step of the block scale


def _with_raw_tensor(src, dst, name, raw, qtype):
    """A copy of the GGUF `src` with tensor `name` stored as raw `qtype` blocks."""
    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), reader.fields[names.KEY_ARCH].contents())
    for key, f in reader.fields.items():
        if not key.startswith("GGUF.") and key != names.KEY_ARCH:
            writer.add_key_value(
                key, f.contents(), f.types[0], f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
            )
    for t in reader.tensors:
        if t.name == name:
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_reference_refuses_target_layer_equal_to_n_layer(variant_dir, edit_gguf, tmp_path):
    from featdiff.torchref.dflash.run import reference

    d = variant_dir("clean")
    broken = edit_gguf(
        d / "draft.gguf", tmp_path / "D.gguf", set_keys={names.KEY_TARGET_LAYERS: ([2, 6], GGUFValueType.ARRAY)}
    )
    with pytest.raises(InputError, match=r"D\.gguf: target_layers = \[2, 6\] but the target has 6 layers"):
        reference(
            d / "target.gguf",
            broken,
            tmp_path / "ref.npz",
            prompt=None,
            tokens="1,2,3",
            rounds=1,
            dtype="float32",
            device="cpu",
            kv_dtype="f16",
            llama_dir=None,
        )
