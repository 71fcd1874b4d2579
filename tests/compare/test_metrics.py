"""Pair metrics, the tolerance model and the layer-match sketches."""

from __future__ import annotations

import numpy as np
import pytest

from featdiff.diff.metrics import measure, relative_error, row_cosine, row_similarity
from featdiff.diff.sketch import compare_sketches, projection, sample_rows, sketch, slot_sketches
from featdiff.diff.tolerance import (
    MAX_REL,
    REL_DEVICE,
    REL_F32,
    REL_KV_F16,
    REL_KV_Q8_0,
    REL_RECURRENT,
    SAFETY,
    Tolerance,
    TypeInfo,
    tolerance_for,
    type_info,
)
from featdiff.dump.manifest import Manifest
from featdiff.dump.records import Record

RNG = np.random.default_rng(0)


def test_measure_reports_nmse_cosine_and_row_errors():
    ref = RNG.standard_normal((5, 32)).astype(np.float32)
    run = ref.copy()
    run[3] *= 1.1
    m = measure(ref, run)
    d = run - ref
    assert m.nmse == pytest.approx(float((d * d).sum() / (ref * ref).sum()), rel=1e-5)
    assert m.row_rel[3] == pytest.approx(0.1, rel=1e-4) and m.row_rel[0] == 0.0
    assert m.cos_min == pytest.approx(1.0) and m.max_abs == pytest.approx(float(np.abs(d).max()))
    assert m.is_finite and m.within(Tolerance(0.2, ())) and not m.within(Tolerance(0.01, ()))


def test_measure_flags_nonfinite_as_not_within():
    ref = np.ones((2, 4), np.float32)
    run = ref.copy()
    run[1, 1] = np.nan
    m = measure(ref, run)
    assert not m.is_finite and not m.within(Tolerance(1.0, ()))


def test_row_similarity_shows_a_shift_on_the_off_diagonal():
    ref = RNG.standard_normal((6, 16))
    run = np.roll(ref, -1, axis=0)
    sim = row_similarity(ref, run)
    assert sim.shape == (6, 6) and np.allclose(np.diag(sim, 1), 1.0)
    assert np.allclose(row_cosine(ref, ref), 1.0)


def test_relative_error_of_zero_reference():
    z = np.zeros((2, 3))
    assert relative_error(z, z) == 0.0 and relative_error(z, z + 1) == float("inf")


def test_tolerance_grows_with_the_types_and_is_capped():
    f32 = TypeInfo("f16", (), "float32")
    q8 = TypeInfo("f16", ("q8_0",), "float32")
    q2 = TypeInfo("f16", ("q2_k",), "float32")
    post, pre = tolerance_for("l_out-3", False, f32), tolerance_for("inp_noise_embd", False, f32)
    assert pre.rel < post.rel == pytest.approx(SAFETY * np.hypot(1e-6, REL_KV_F16), rel=1e-3)
    assert (
        tolerance_for("l_out-3", False, q8).rel > post.rel
        and "q8_0 weights" in tolerance_for("l_out-3", False, q8).sources
    )
    assert tolerance_for("l_out-3", False, q2).rel == MAX_REL
    assert tolerance_for("inp_pos", True, q2).rel == 0.0


def test_type_info_reads_the_manifests():
    run = Manifest(
        "llama.cpp",
        {"target": {"weight_types": ["f32", "q8_0"]}, "draft": {"weight_types": ["f32"]}},
        {"kv_types": {"target": {"k": "q8_0", "v": "f16"}, "draft": {"k": "f16", "v": "f16"}}},
        (),
        (),
    )
    ref = Manifest("reference", {}, {"dtype": "bfloat16", "kv_dtype": "f16"}, (), ())
    assert type_info(ref, run) == TypeInfo("q8_0", ("q8_0",), "bfloat16")  # the coarsest cache of the run


def test_a_model_both_sides_loaded_from_one_file_is_judged_by_the_same_file_bound():
    q4k = {"sha256": "ab" * 32, "weight_types": ["f32", "q4_k"]}
    run = Manifest("llama.cpp", {"target": q4k, "draft": {"sha256": "cd" * 32, "weight_types": ["q8_0"]}}, {}, (), ())
    ref = Manifest("reference", {"target": q4k, "draft": {"sha256": "ef" * 32}}, {}, (), ())
    types = type_info(ref, run)
    assert types.quant_types == ("q8_0",) and types.same_file_types == ("q4_k",)  # the drafter's file differs
    apart = tolerance_for("l_out-3", False, TypeInfo("f16", ("q4_k",), "float32"))
    shared = tolerance_for("l_out-3", False, TypeInfo("f16", (), "float32", ("q4_k",)))
    assert apart.rel == MAX_REL and shared.rel < apart.rel  # q4_k against f32 weights: only the cap
    assert "q4_k weights read by both sides" in shared.sources
    # any quantized type: the activations' q8 rounding; a float type: its own figure
    assert tolerance_for("l_out-3", False, TypeInfo("f16", (), "float32", ("iq2_xs",))).rel == shared.rel


def test_kv_type_defaults_to_llama_cpps_f16_and_reads_the_references_key():
    assert type_info(Manifest("reference", {}, {}, (), ()), Manifest("llama.cpp", {}, {}, (), ())).kv_type == "f16"
    as_ref = Manifest("reference", {}, {"kv_dtype": "f32"}, (), ())
    assert type_info(as_ref, as_ref).kv_type == "f32"


def test_q8_0_cache_bound_is_looser_than_f16_and_names_its_source():
    q8, f16 = TypeInfo("q8_0", (), "float32"), TypeInfo("f16", (), "float32")
    post = tolerance_for("l_out-3", False, q8)
    assert post.rel == pytest.approx(SAFETY * np.hypot(REL_F32, REL_KV_Q8_0)) and "q8_0 KV cache" in post.sources
    assert post.rel > tolerance_for("l_out-3", False, f16).rel
    assert tolerance_for("inp_noise_embd", False, q8) == tolerance_for("inp_noise_embd", False, f16)  # before attention


def test_a_target_with_recurrent_state_adds_its_term_after_attention_only():
    def run_of(arch: str) -> Manifest:
        return Manifest("llama.cpp", {"target": {"architecture": arch, "weight_types": ["f32"]}}, {}, (), ())

    ref = Manifest("reference", {}, {}, (), ())
    hybrid, dense = type_info(ref, run_of("qwen35")), type_info(ref, run_of("qwen3"))
    assert (hybrid.recurrent_arch, dense.recurrent_arch) == ("qwen35", "")
    assert type_info(ref, run_of("nemotron_h_moe")).recurrent_arch == "nemotron_h_moe"
    post = tolerance_for("mtp_hnorm-6", False, hybrid)
    rec = REL_RECURRENT["qwen35"]
    assert post.rel == pytest.approx(SAFETY * np.sqrt(REL_F32**2 + REL_KV_F16**2 + rec**2))
    # a recurrent architecture not measured takes the largest figure
    kimi = tolerance_for("l_out-3", False, type_info(ref, run_of("kimi-linear")))
    assert kimi.rel == pytest.approx(SAFETY * np.sqrt(REL_F32**2 + REL_KV_F16**2 + max(REL_RECURRENT.values()) ** 2))
    assert "qwen35 recurrent state" in post.sources and post.rel > tolerance_for("mtp_hnorm-6", False, dense).rel
    # the token embeddings never pass through the state
    assert tolerance_for("inp_embd", False, hybrid) == tolerance_for("inp_embd", False, dense)


def test_sketches_are_deterministic_and_find_the_layer():
    layers = RNG.standard_normal((6, 40, 64)).astype(np.float32)  # (n_layer, T, n_embd)
    feats = np.concatenate([layers[3], layers[5]], axis=1)  # (T, 2 * n_embd)
    proj = projection(64)
    assert np.array_equal(proj, projection(64))
    err, sim = compare_sketches(slot_sketches(feats, 2, proj), np.stack([sketch(layer, proj) for layer in layers]))
    assert err.shape == (2, 6) and list(err.argmin(axis=1)) == [3, 5]
    assert err[0, 3] < 1e-5 and sim[1, 5] == pytest.approx(1.0)


def test_sample_rows_is_even_and_bounded():
    assert list(sample_rows(5)) == [0, 1, 2, 3, 4]
    picked = sample_rows(10_000, 256)
    assert len(picked) == 256 and picked[0] == 0 and picked[-1] == 9_999


def test_a_run_computed_on_a_device_is_judged_with_its_backends_bound_after_attention():
    rec = {"key": "k", "role": "draft", "phase": "draft", "eval": 0, "occurrence": 0, "op": "ADD"}
    rec |= {"ggml_type": "f32", "ne": [4], "srcs": [], "dtype": "float32", "shape": [4]}
    records = tuple(
        Record.from_json({**rec, "key": f"k{i}", "name": f"l_out-{i}", "backend": b})
        for i, b in enumerate(("CPU", "Vulkan0", "Vulkan1", None))
    )
    run = Manifest("llama.cpp", {}, {}, (), records)
    types = type_info(Manifest("reference", {}, {}, (), ()), run)
    assert types.devices == ("Vulkan0", "Vulkan1")  # the host's records, and the API's, are no device's
    cpu = TypeInfo("f16", (), "float32")
    post = tolerance_for("l_out-3", False, types)
    assert post.rel == pytest.approx(SAFETY * np.sqrt(REL_F32**2 + REL_KV_F16**2 + REL_DEVICE["Vulkan"] ** 2))
    assert "Vulkan backend" in post.sources and post.sources.count("Vulkan backend") == 1  # one per backend
    assert tolerance_for("inp_noise_embd", False, types) == tolerance_for("inp_noise_embd", False, cpu)  # bitwise
    cuda = tolerance_for("l_out-3", False, TypeInfo("f16", (), "float32", devices=("CUDA0",)))
    assert cuda.rel == post.rel and "CUDA backend" in cuda.sources  # not measured: the Vulkan figure
