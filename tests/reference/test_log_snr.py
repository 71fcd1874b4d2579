"""The log-SNR embedding recomputed independently from the formula (numpy, float64) matches the
reference's records, each under the name of the graph node that computes it (docs/records.md):
`dspark_log_snr_feat`, `dspark_log_snr_fc1`, `dspark_log_snr_fc2` (the term); `inp_noise_embd`
holds the table rows before the term and `dspark_draft_embd_snr` their sum."""

from __future__ import annotations

import json

import numpy as np
from safetensors.numpy import load_file

from featdiff.core import names
from featdiff.dump.reader import read_dump

FORMULA_BOUND = 1e-5  # rel L2: float32 MLP in the reference vs this float64 recomputation
B, N_EMBD = 4, 64  # the fixture drafter's block and width


def _formula_rows(hf_dir) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(phi, silu(fc1 phi + b1), e) of the anchor row, then of a mask row:
    e = fc2(silu(fc1(phi(tau)))) + b2, tau = 1000 (lambda - min) / (max - min)."""
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
        rows.append((phi, h, w["log_snr_fc2.weight"].astype(np.float64) @ h + w["log_snr_fc2.bias"]))
    return rows


def _draft_evals(dump):
    return [e for e in dump.manifest.evals if e.phase == "draft"]


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    return bool(np.linalg.norm(got - want) <= FORMULA_BOUND * np.linalg.norm(want))


def test_log_snr_stages_match_the_formula(ref_dump, variant_dir):
    anchor, mask = _formula_rows(variant_dir("log-snr") / "draft-hf")
    with read_dump(ref_dump("log-snr", model="draft-hf")) as d:
        for ev in _draft_evals(d):
            key = f"e{ev.eval:05d}.draft.%s.0"
            stages = [
                d.array(key % n)
                for n in (names.DSPARK_LOG_SNR_FEAT, names.DSPARK_LOG_SNR_FC1, names.DSPARK_LOG_SNR_FC2)
            ]
            assert [a.shape for a in stages] == [(B, names.LOG_SNR_N_FREQ), (B, N_EMBD), (B, N_EMBD)]
            for got, want_anchor, want_mask in zip(stages, anchor, mask):
                assert _close(got[0], want_anchor)
                assert all(_close(row, want_mask) for row in got[1:])
            assert not np.allclose(anchor[2], mask[2])


def test_first_layer_input_is_table_rows_plus_log_snr_term(ref_dump, variant_dir):
    table = load_file(str(variant_dir("log-snr") / "target-hf" / "model.safetensors"))["model.embed_tokens.weight"]
    with read_dump(ref_dump("log-snr")) as d:
        for ev in _draft_evals(d):
            key = f"e{ev.eval:05d}.draft.%s.0"
            rows = d.array(key % names.INP_NOISE_EMBD)
            np.testing.assert_array_equal(rows, table[list(ev.token_ids)])  # before the term
            term = d.array(key % names.DSPARK_LOG_SNR_FC2)
            np.testing.assert_array_equal(d.array(key % names.DSPARK_DRAFT_EMBD_SNR), rows + term)
            plain = d.array(key % names.candidate_name(names.DSPARK_DRAFT_EMBD_SNR, names.HYP_NO_LOG_SNR))
            np.testing.assert_array_equal(plain, rows)


def test_log_snr_records_are_written_in_every_draft_eval_in_graph_order(ref_dump):
    with read_dump(ref_dump("log-snr")) as d:
        for ev in _draft_evals(d):
            order = [r.name for r in d.records() if r.eval == ev.eval]
            got = [n for n in order if n == names.INP_NOISE_EMBD or n in names.LOG_SNR_RECORDS]
            assert got == [names.INP_NOISE_EMBD, *names.LOG_SNR_RECORDS]
        assert not [r for r in d.records() if r.name in names.OLD_RECORD_NAMES]
        assert not [r for r in d.records() if r.name in names.LOG_SNR_RECORDS and r.phase != "draft"]


def test_unconditioned_drafter_has_no_log_snr_records(ref_dump):
    with read_dump(ref_dump("clean")) as d:
        assert not [
            r
            for r in d.records()
            if r.name in names.LOG_SNR_RECORDS or r.name in names.OLD_RECORD_NAMES or "log_snr" in r.name
        ]
        assert d.manifest.models["draft"]["log_snr"] == {"enabled": False, "min": None, "max": None}


def test_default_capture_keeps_every_log_snr_record_the_reference_writes(ref_dump):
    """A capture of a build that implements the term (same names) keeps what compare pairs."""
    from fnmatch import fnmatchcase

    from featdiff.diff.align import is_reference_only
    from featdiff.core.filters import capture_filters

    kept = capture_filters(None, (2, 4))
    with read_dump(ref_dump("log-snr")) as d:
        written = {r.name for r in d.records() if r.phase == "draft" and not is_reference_only(r.name)}
    assert set(names.LOG_SNR_RECORDS) <= written
    assert all(
        kept.keeps("draft", n) and any(fnmatchcase(n, g) for g in names.WIRING_NAMES) for n in names.LOG_SNR_RECORDS
    )
