"""The log-SNR embedding recomputed independently from the formula (numpy, float64) matches
the reference's `log_snr_embed` record; `inp_noise_embd` carries it."""

from __future__ import annotations

import json

import numpy as np
from safetensors.numpy import load_file

from featdiff import names
from featdiff.dump import read_dump

FORMULA_BOUND = 1e-5  # rel L2: float32 MLP in the reference vs this float64 recomputation


def _formula_rows(hf_dir):
    """(anchor row, mask row) of e = fc2(silu(fc1(phi(tau)))), tau = 1000 (lambda - min) / (max - min)."""
    w = load_file(str(hf_dir / "model.safetensors"))
    cfg = json.loads((hf_dir / "config.json").read_text())["dflash_config"]
    lo, hi = cfg["min_log_snr"], cfg["max_log_snr"]
    rows = []
    for lam in (hi, lo):  # anchor rows sit at max_log_snr, mask rows at min_log_snr
        tau = 1000.0 * (lam - lo) / (hi - lo)
        f = 10000.0 ** (-np.arange(64) / 64.0)
        phi = np.concatenate([np.sin(tau * f), np.cos(tau * f)])  # (128,): sines first
        h = w["log_snr_fc1.weight"].astype(np.float64) @ phi + w["log_snr_fc1.bias"]
        h = h / (1.0 + np.exp(-h))
        rows.append(w["log_snr_fc2.weight"].astype(np.float64) @ h + w["log_snr_fc2.bias"])
    return rows


def _draft_evals(dump):
    return [e.eval for e in dump.manifest.evals if e.phase == "draft"]


def test_log_snr_embed_rows_match_the_formula(ref_dump, variant_dir):
    anchor, mask = _formula_rows(variant_dir("log-snr") / "draft-hf")
    with read_dump(ref_dump("log-snr", model="draft-hf")) as d:
        for ev in _draft_evals(d):
            got = d.array(f"e{ev:05d}.draft.{names.LOG_SNR_EMBED}.0")
            assert got.shape == (4, 64)
            assert np.linalg.norm(got[0] - anchor) <= FORMULA_BOUND * np.linalg.norm(anchor)
            for row in got[1:]:
                assert np.linalg.norm(row - mask) <= FORMULA_BOUND * np.linalg.norm(mask)
            assert not np.allclose(anchor, mask)


def test_noise_embedding_is_table_rows_plus_log_snr_term(ref_dump):
    with read_dump(ref_dump("log-snr")) as d:
        for ev in _draft_evals(d):
            key = f"e{ev:05d}.draft.%s.0"
            plain = d.array(key % names.candidate_name(names.INP_NOISE_EMBD, names.HYP_NO_LOG_SNR))
            term = d.array(key % names.LOG_SNR_EMBED)
            np.testing.assert_array_equal(d.array(key % names.INP_NOISE_EMBD), plain + term)


def test_unconditioned_drafter_has_no_log_snr_records(ref_dump):
    with read_dump(ref_dump("clean")) as d:
        assert not [r for r in d.records() if r.name == names.LOG_SNR_EMBED or "log_snr" in r.name]
        assert d.manifest.models["draft"]["log_snr"] == {"enabled": False, "min": None, "max": None}
