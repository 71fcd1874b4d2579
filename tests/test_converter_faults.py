"""Converter faults, planted and named: the pinned converter's correct GGUFs rewritten with one
plausible converter bug each (featdiff.factory.converter_faults), captured in-process with the real build,
compared against the reference from the HF checkpoint (the truth): each is named at the record
where it first shows, by a detector that says what to look at. The detectors' own unit tests
(synthetic rows, no model) come first."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import featdiff
from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.diff import exit_code
from featdiff.diff.detectors import (
    Evidence,
    Rope,
    detect_divergence_in_rope,
    detect_scale_per_channel,
    rotate,
)
from featdiff.diff.tolerance import TypeInfo, tolerance_for
from featdiff.factory.converter import DRAFT_GGUF, TARGET_GGUF
from featdiff.factory.converter_faults import DROP, FAULTS, rewrite_gguf, write_fault_fixture
from featdiff.torchref.rope_params import hf_rope
from test_converter import _contents

from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS

# compare's bound on an attention record of an f32 run with llama.cpp's default f16 KV cache
F32 = tolerance_for("Kcur_injected-0", False, TypeInfo(kv_type="f16", quant_types=(), ref_dtype="float32"))
ROPE = Rope(n_head=2, head_dim=16)
POSITIONS = tuple(range(11))
FLOW = {"tokens": DEFAULT_TOKENS, "rounds": DEFAULT_ROUNDS}

# fault -> (kind, detail) of the first error finding, at FAULTS[fault].first_shows
NAMED = {
    "enc-norm-dropped": ("scale", "per channel"),
    "k-norm-dropped": ("scale", "per channel before RoPE, per head of 16"),
    "rope-base-from-target": ("divergence", "rope"),
    "yarn-from-target": ("divergence", "rope"),
    "rope-freqs-dropped": ("divergence", "rope"),
    "window-dropped": ("wrong_source", None),  # candidate l_out-0@attention=full
}
# fault -> where compare places it (docs/findings.md, `where`): a tensor or converted key that
# differs from the checkpoint's is the export's; a fault only GGUF keys the manifests do not state
# decide (the RoPE's scaling and its rope_freqs, a sliding window) is not placed: its tensors agree
WHERE = {
    "enc-norm-dropped": "export",
    "k-norm-dropped": "export",
    "rope-base-from-target": "export",
    "yarn-from-target": "unknown",
    "rope-freqs-dropped": "unknown",
    "window-dropped": "unknown",
}


# --- the detectors, on synthetic rows -------------------------------------------------------------


def _roped(x: np.ndarray, base: float = ROPE.base, attn: float = 1.0) -> np.ndarray:
    """Each row of x rotated by its position (NeoX pairs) with `base`, cos and sin times `attn`."""
    rope = Rope(ROPE.n_head, ROPE.head_dim, base)
    return attn * np.concatenate([rotate(x[i : i + 1], p, rope, True) for i, p in enumerate(POSITIONS)])


def _ev(ref: np.ndarray, run: np.ndarray, rope: Rope | None = ROPE) -> Evidence:
    return Evidence(tensor="Kcur_injected-0", ref=ref, run=run, tolerance=F32, positions=POSITIONS, rope=rope)


@pytest.fixture
def rows() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((len(POSITIONS), ROPE.n_head * ROPE.head_dim))  # (R, D)


def test_a_factor_per_channel_is_a_per_channel_scale(rows):
    w = np.random.default_rng(1).uniform(0.5, 1.5, rows.shape[1])  # (D,)
    f = detect_scale_per_channel(_ev(rows, rows * w, rope=None))
    assert f is not None and f.kind == "scale" and f.fields["detail"] == "per channel"
    assert np.allclose(f.fields["factors"], w, rtol=1e-5)


def test_a_per_head_factor_before_rope_is_found_after_it(rows):
    w = np.random.default_rng(1).uniform(0.5, 1.5, ROPE.head_dim)  # (head_dim,): a k_norm weight
    f = detect_scale_per_channel(_ev(_roped(rows), _roped(rows * np.tile(w, ROPE.n_head))))
    assert f is not None and f.fields["detail"] == "per channel before RoPE, per head of 16"
    assert np.allclose(f.fields["factors"], w, rtol=1e-5) and "attn_k_norm" in f.message


@pytest.mark.parametrize("case", ["uniform", "unrelated", "few rows"])
def test_per_channel_scale_needs_distinct_factors_on_enough_rows(rows, case):
    if case == "uniform":
        ev = _ev(rows, 2.0 * rows)  # detect_scale's
    elif case == "unrelated":
        ev = _ev(rows, np.random.default_rng(2).standard_normal(rows.shape))
    else:
        ev = Evidence(tensor="x", ref=rows[:3], run=rows[:3] * np.arange(1, 33), tolerance=F32)
    assert detect_scale_per_channel(ev) is None


@pytest.mark.parametrize("base, attn", [(1e6, 1.0), (1e4 / 4, 1.14)])
def test_other_rope_angles_are_a_rope_divergence(rows, base, attn):
    f = detect_divergence_in_rope(_ev(_roped(rows), _roped(rows, base, attn)))
    assert f is not None and f.kind == "divergence" and f.fields["detail"] == "rope"
    assert f.fields["pairs"][0] == 1 and 0 not in f.fields["pairs"]  # the first pair turns at 1 rad/pos
    assert ("1.14 (YaRN" in f.message) == (attn != 1.0) and names.T_ROPE_FREQS in f.message


@pytest.mark.parametrize("case", ["same", "scaled", "per channel", "no rope"])
def test_rope_divergence_needs_equal_pair_lengths_and_other_angles(rows, case):
    run = {"same": _roped(rows), "scaled": 2 * _roped(rows), "per channel": _roped(rows * np.arange(1, 33))}
    ev = _ev(_roped(rows), run.get(case, _roped(rows, 1e6)), rope=None if case == "no rope" else ROPE)
    assert detect_divergence_in_rope(ev) is None


# --- planting -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """(fault, planted) -> a converted fixture with that fault planted (or only its target's RoPE)."""
    made: dict[tuple[str, bool], Path] = {}

    def get(fault: str, planted: bool = True) -> Path:
        if (fault, planted) not in made:
            made[fault, planted] = write_fault_fixture(tmp_path_factory.mktemp(f"cf-{fault}"), fault, planted=planted)
        return made[fault, planted]

    return get


def _compared(d: Path, tmp_path: Path):
    run = featdiff.capture(d / TARGET_GGUF, d / DRAFT_GGUF, tmp_path / "run.npz", **FLOW)
    ref = featdiff.reference(d / TARGET_GGUF, d / "draft-hf", tmp_path / "ref.npz", **FLOW)
    return featdiff.compare(ref, run)


def test_rewrite_copies_every_key_and_tensor_but_the_changed_ones(faulty, tmp_path):
    src = faulty("enc-norm-dropped", planted=False) / DRAFT_GGUF
    ones = np.ones(64, np.float32)
    out = rewrite_gguf(
        src, tmp_path / "d.gguf", {names.KEY_BLOCK_SIZE: DROP, "dflash.x": 2.0}, {names.T_ENC_NORM: ones}
    )
    (ka, ta), (kb, tb) = _contents(src), _contents(out)
    assert ka.keys() - kb.keys() == {names.KEY_BLOCK_SIZE} and kb.keys() - ka.keys() == {"dflash.x"}
    assert list(ta) == list(tb) and np.array_equal(tb[names.T_ENC_NORM][1], ones)
    assert all(np.array_equal(ta[n][1], tb[n][1]) for n in ta if n != names.T_ENC_NORM)
    assert all(ka[k] == kb[k] for k in ka.keys() & kb.keys())


def test_an_unknown_fault_is_refused_by_name(tmp_path):
    with pytest.raises(InputError, match="rope-freqs-dropped"):
        write_fault_fixture(tmp_path / "x", "no-such-fault")


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(NAMED))
def test_each_converter_fault_is_named_where_it_first_shows(faulty, tmp_path, fault):
    assert set(NAMED) == set(FAULTS)
    c = _compared(faulty(fault), tmp_path)
    first = [f for f in c.findings if f.severity == "error"][0]
    assert exit_code(c) == 1
    assert (first.tensor, first.kind, first.fields.get("detail")) == (FAULTS[fault].first_shows, *NAMED[fault])
    assert first.fields["where"] == WHERE[fault], first.fields["where_reason"]
    if fault == "yarn-from-target":
        assert "YaRN's attention factor" in first.message
    if fault == "window-dropped":
        assert first.fields["candidate"] == f"l_out-0@{names.HYP_FULL_ATTENTION}" and "sliding_window" in first.message


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["rope-base-from-target", "yarn-from-target", "window-dropped"])
def test_the_unplanted_controls_compare_clean(faulty, tmp_path, fault):
    """A target with its own RoPE and the converter's drafter; the converter's sliding-window drafter."""
    d = faulty(fault, planted=False)
    target, draft = _contents(d / TARGET_GGUF)[0], _contents(d / DRAFT_GGUF)[0]
    assert {
        "rope-base-from-target": target.get("qwen3.rope.freq_base") == 1e6,
        "yarn-from-target": target.get("qwen3.rope.scaling.type") == "yarn",
        "window-dropped": draft.get("dflash.attention.sliding_window_pattern") == [True, False],
    }[fault]
    c = _compared(d, tmp_path)
    assert exit_code(c) == 0 and c.ok, [(f.kind, f.tensor, f.message) for f in c.findings if f.severity == "error"]


@pytest.mark.slow
def test_the_converters_llama3_drafter_with_its_rope_freqs_restored_compares_clean(faulty, tmp_path):
    """The fix of the pinned converter's fault: the drafter's rope_freqs as its own config.json
    defines them (llama3 scaling; the converter writes the same for its llama target)."""
    d = faulty("rope-freqs-dropped", planted=False)
    assert names.T_ROPE_FREQS not in _contents(d / DRAFT_GGUF)[1]  # the converter planted it already
    config = json.loads((d / "draft-hf" / names.HF_CONFIG).read_text())
    _, scaling, _ = hf_rope(d / "draft-hf", config, config["head_dim"])
    freqs = np.array(scaling.freq_factors, np.float32)
    assert np.array_equal(freqs, _contents(d / TARGET_GGUF)[1][names.T_ROPE_FREQS][1])  # the target's, as written
    rewrite_gguf(d / DRAFT_GGUF, tmp_path / DRAFT_GGUF, tensors={names.T_ROPE_FREQS: freqs})
    (tmp_path / TARGET_GGUF).symlink_to(d / TARGET_GGUF)
    (tmp_path / "draft-hf").symlink_to(d / "draft-hf")
    c = _compared(tmp_path, tmp_path)
    assert exit_code(c) == 0 and c.ok, [(f.kind, f.tensor, f.message) for f in c.findings if f.severity == "error"]
