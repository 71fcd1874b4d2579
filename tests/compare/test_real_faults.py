"""compare on real dumps: the fixture models captured through the pinned llama.cpp build against
the PyTorch reference of the trained checkpoint. Faults planted at the GGUF level (fixture
variants), faults planted by transforming a correct capture, and a Q8_0 target."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from featdiff.core import names
from featdiff.diff import compare_dumps, exit_code
from featdiff.diff.result import Finding
from featdiff.dump.reader import read_dump
from featdiff.dump.records import record_key
from featdiff.dump.writer import DumpWriter

from findings_schema import validate_findings, written
from quantize import quantize_gguf
from real_flow import DEFAULT_ROUNDS, DEFAULT_TOKENS
from transform import rewrite

FIRST_INJECT = 1  # eval of the prefill's inject (docs/flow.md)


def errors(c) -> list[Finding]:
    validate_findings(written(c.to_json()))  # every real comparison's JSON follows the schema
    return [f for f in c.findings if f.severity == "error"]


def the_error(c) -> Finding:
    errs = errors(c)
    assert len(errs) == 1, [(f.kind, f.tensor, f.message) for f in errs]
    assert exit_code(c) == 1 and not c.ok
    return errs[0]


@pytest.fixture(scope="module")
def clean(captured, checkpoint_ref) -> tuple[Path, Path]:
    return checkpoint_ref("clean"), captured("clean")


# --- the correct pair --------------------------------------------------------------------------


def test_correct_fixture_pair_exits_zero_with_no_error(clean):
    c = compare_dumps(*clean, None)
    assert exit_code(c) == 0 and c.ok and not errors(c)
    assert c.first_divergence is None and len(c.pairs) > 40
    assert {f.kind for f in c.findings} <= {"numeric_noise"}


def test_in_process_capture_is_judged_by_llama_cpps_f16_cache(clean):
    with read_dump(clean[1]) as d:
        assert d.manifest.build["kv_types"] == {"draft": {"k": "f16", "v": "f16"}, "target": {"k": "f16", "v": "f16"}}
    assert compare_dumps(*clean, None).types["kv_type"] == "f16"


def test_capture_with_an_exclusion_filter_compares_clean(captured, checkpoint_ref):
    """README's `--filter 'l_out-*' --filter '!l_out-0'` on top of the default wiring: the excluded
    records are filtered out, not missing (the manifest keeps the exclusion)."""
    from featdiff.core.filters import default_specs

    with read_dump(captured("clean")) as d:
        layers = tuple(d.manifest.models["draft"]["target_layers"])
    run = captured("clean", filters=(*default_specs(layers), "l_out-*", "!l_out-0"))
    with read_dump(run) as d:
        assert "!l_out-0" in d.manifest.build["filters"]["draft"]
        assert not any(r.name == "l_out-0" for r in d.records()) and any(r.name == "l_out-1" for r in d.records())
    c = compare_dumps(checkpoint_ref("clean"), run, None)
    assert exit_code(c) == 0 and c.ok, [(f.kind, f.tensor, f.message) for f in errors(c)]
    assert c.coverage.ref_only > 0  # the reference's l_out-0: left out on purpose, so no finding
    assert not any(f.kind == "missing_tensor" for f in c.findings)


def test_q8_0_target_gives_numeric_noise_only(clean, fixture_models, tmp_path_factory):
    from featdiff.driver.capture import capture

    d = fixture_models("clean")
    work = tmp_path_factory.mktemp("q8_0")
    target = quantize_gguf(d / "target.gguf", work / "target-q8_0.gguf")
    run = capture(target, d / "draft.gguf", work / "run.npz", tokens=DEFAULT_TOKENS, rounds=DEFAULT_ROUNDS)
    c = compare_dumps(clean[0], run, None)
    assert exit_code(c) == 0, [(f.kind, f.tensor, f.message) for f in errors(c)]
    assert [f.kind for f in c.findings] == ["numeric_noise"]
    assert "q8_0 weights" in c.findings[0].message and c.types["quant_types"] == ["q8_0"]


# --- faults planted in the GGUF the run loads --------------------------------------------------


@pytest.mark.parametrize("variant,delta,observed", [("layers-plus1", 1, [3, 5]), ("layers-minus1", -1, [1, 3])])
def test_layer_offset_found_when_target_layers_are_off(captured, checkpoint_ref, variant, delta, observed):
    c = compare_dumps(checkpoint_ref(variant), captured(variant), None)
    f = the_error(c)
    assert (f.kind, f.tensor) == ("layer_offset", "inp_target_features")
    assert (f.fields["slot"], f.fields["expected_layer"], f.fields["observed_layer"], f.fields["delta"]) == (
        0,
        2,
        2 + delta,
        delta,
    )
    assert f.fields["observed_layers"] == observed
    assert f.fields["where"] == "export" and "target_layers" in f.fields["where_reason"]  # the GGUF's key
    assert c.pairs[c.first_divergence].eval == FIRST_INJECT


def test_slot_permutation_found_when_fc_column_blocks_are_swapped(captured, checkpoint_ref):
    f = the_error(compare_dumps(checkpoint_ref("slots-swapped"), captured("slots-swapped"), None))
    assert (f.kind, f.tensor, f.fields["permutation"]) == ("slot_permutation", "inp_g_embeddings", [1, 0])
    assert f.fields["where"] == "export" and "fc.weight" in f.fields["where_reason"]  # found by value


def test_missing_term_found_when_log_snr_conditioning_is_dropped(captured, checkpoint_ref):
    """Upstream's graph has no log-SNR node: the first layer reads inp_noise_embd (which matches
    the reference's rows) where the checkpoint reads dspark_draft_embd_snr; the first record
    computed from it is named, and the absent log-SNR nodes are not missing_tensor findings."""
    c = compare_dumps(checkpoint_ref("no-log-snr"), captured("no-log-snr"), None)
    f = the_error(c)
    assert (f.kind, f.tensor, f.fields["term"]) == ("missing_term", "l_out-0", "dspark_log_snr_fc2")
    assert f.fields["expected_in"] == "dspark_draft_embd_snr"
    assert f.fields["where"] == "export" and "log_snr" in f.fields["where_reason"]
    first = c.pairs[c.first_divergence]
    assert (first.name, first.phase) == ("l_out-0", "draft")
    assert all(p.within for p in c.pairs if p.name == "inp_noise_embd")


def test_missing_term_found_against_an_old_reference_dump(captured, checkpoint_ref, tmp_path):
    """A reference dump written before the graph names (`inp_noise_embd` = the sum, the term as
    `log_snr_embed`) still compares: the term is named by its current name."""
    old = _old_log_snr_layout(checkpoint_ref("no-log-snr"), tmp_path / "ref-old.npz")
    f = the_error(compare_dumps(old, captured("no-log-snr"), None))
    assert (f.kind, f.tensor, f.fields["term"]) == ("missing_term", "inp_noise_embd", "dspark_log_snr_fc2")
    assert set(f.fields) == {"term", "where", "where_reason"}
    assert f.fields["where"] == "export" and "log_snr" in f.fields["where_reason"]


def _old_log_snr_layout(src: Path, dst: Path) -> Path:
    """The reference dump as featdiff wrote it before docs/records.md: `inp_noise_embd` holds the
    sum, `log_snr_embed` the term, `inp_noise_embd@log_snr=none` the rows."""
    renamed = {
        names.DSPARK_DRAFT_EMBD_SNR: names.INP_NOISE_EMBD,
        names.DSPARK_LOG_SNR_FC2: names.LOG_SNR_EMBED,
        names.INP_NOISE_EMBD: names.candidate_name(names.INP_NOISE_EMBD, names.HYP_NO_LOG_SNR),
    }
    dropped = (
        names.DSPARK_LOG_SNR_FEAT,
        names.DSPARK_LOG_SNR_FC1,
        names.candidate_name(names.DSPARK_DRAFT_EMBD_SNR, names.HYP_NO_LOG_SNR),
    )
    with read_dump(src) as dump:
        writer = DumpWriter(dst)
        for r in dump.records():
            if r.name in dropped:
                continue
            name = renamed.get(r.name, r.name)
            key = record_key(r.eval, r.role, name, r.occurrence)
            writer.add(replace(r, name=name, key=key), np.array(dump.array(r)))
        return writer.close(dump.manifest)


def test_wrong_source_found_when_the_run_borrows_the_target_embeddings(captured, checkpoint_ref):
    f = the_error(compare_dumps(checkpoint_ref("borrowed-embd"), captured("borrowed-embd"), None))
    assert (f.kind, f.tensor, f.fields["source"]) == ("wrong_source", "inp_noise_embd", "target")
    assert f.fields["where"] == "export" and "has_own_embeddings" in f.fields["where_reason"]


# --- faults planted by transforming the correct capture ----------------------------------------


def transformed(clean, tmp_path, fn) -> object:
    return compare_dumps(clean[0], rewrite(clean[1], tmp_path / "run.npz", fn), None)


def at(name: str, eval_index: int, change):
    """A rewrite that changes one record of one eval."""

    def fn(r, a):
        return change(a) if r.name == name and r.eval == eval_index else a

    return fn


@pytest.mark.parametrize("shift", [1, -1])
def test_row_shift_found_in_shifted_features(clean, tmp_path, shift):
    c = transformed(clean, tmp_path, at("inp_target_features", FIRST_INJECT, lambda a: np.roll(a, -shift, axis=0)))
    f = the_error(c)
    assert (f.kind, f.tensor, f.fields["shift"]) == ("row_shift", "inp_target_features", shift)


def test_layout_transpose_found_in_layer_major_staging(clean, tmp_path):
    def layer_major(a):
        n_tokens, width = a.shape
        return (
            a.reshape(n_tokens, 2, width // 2).transpose(1, 0, 2).reshape(n_tokens, width)
        )  # (2, T, n_embd) read as (T, 2 * n_embd)

    f = the_error(transformed(clean, tmp_path, at("inp_target_features", FIRST_INJECT, layer_major)))
    assert (f.kind, f.tensor) == ("layout_transpose", "inp_target_features") and "layer-major" in f.fields["detail"]


def test_scale_found_in_a_scaled_tensor(clean, tmp_path):
    f = the_error(transformed(clean, tmp_path, at("inp_g_embeddings", FIRST_INJECT, lambda a: 0.5 * a)))
    assert (f.kind, f.tensor) == ("scale", "inp_g_embeddings") and f.fields["factor"] == pytest.approx(0.5, rel=1e-3)


def test_zeros_found_in_zeroed_features(clean, tmp_path):
    c = transformed(clean, tmp_path, at("inp_target_features", FIRST_INJECT, np.zeros_like))
    f = the_error(c)
    assert (f.kind, f.tensor) == ("zeros", "inp_target_features")
    assert f.fields["rows"] == list(c.pairs[c.first_divergence].positions)


def test_nonfinite_found_in_nan_and_inf(clean, tmp_path):
    def poison(a):
        a = a.copy()
        a[2, 5], a[6, 0] = np.nan, np.inf
        return a

    f = the_error(transformed(clean, tmp_path, at("inp_g_embeddings", FIRST_INJECT, poison)))
    assert (f.kind, f.tensor, f.fields["rows"]) == ("nonfinite", "inp_g_embeddings", [2, 6])


def test_stale_found_in_data_from_the_previous_round(clean, tmp_path):
    from featdiff.dump.reader import read_dump

    with read_dump(clean[1]) as run:
        injects = [
            e for e in run.manifest.evals if e.phase == "inject" and e.n_tokens == run.manifest.evals[-1].n_tokens
        ]
        previous, current = injects[-2], injects[-1]
        old = np.array(
            run.array(next(r for r in run.records() if r.eval == previous.eval and r.name == "inp_target_features"))
        )
    f = the_error(transformed(clean, tmp_path, at("inp_target_features", current.eval, lambda a: old)))
    assert (f.kind, f.tensor, f.fields["source_eval"]) == ("stale", "inp_target_features", previous.eval)
    assert f.fields["rows"] == list(current.positions)


def test_position_offset_found_in_keys_roped_two_positions_late(clean, tmp_path):
    from featdiff.diff.detectors import Rope, rotate

    def late(a):
        n_tokens, n_head, head_dim = a.shape
        rows = rotate(a.reshape(n_tokens, -1), 2, Rope(n_head, head_dim), neox=True)  # (T, n_head * head_dim)
        return rows.reshape(a.shape)  # (T, n_head, head_dim)

    f = the_error(transformed(clean, tmp_path, at("Kcur_injected-0", FIRST_INJECT, late)))
    assert (f.kind, f.tensor, f.fields["offset"]) == ("position_offset", "Kcur_injected-0", 2)


# --- faults in the token ids and positions of the flow -------------------------------------------


def test_draft_block_without_its_anchor_is_a_block_token_not_an_ok(clean, tmp_path):
    """The driver put the mask token in row 0: every draft row has another token history, so
    nothing of the draft block pairs; the verdict must say why instead of OK."""
    from dataclasses import replace

    from featdiff.dump.reader import read_dump

    with read_dump(clean[1]) as run:
        m = run.manifest
        mask = m.models["draft"]["mask_token_id"]
        block = next(e for e in m.evals if e.phase == "draft")
        evals = tuple(replace(e, token_ids=(mask,) + e.token_ids[1:]) if e.eval == block.eval else e for e in m.evals)
    c = compare_dumps(clean[0], rewrite(clean[1], tmp_path / "run.npz", evals=evals), None)
    f = the_error(c)
    assert (f.kind, f.fields["row"], f.fields["observed"], f.fields["expected"], f.fields["round"]) == (
        "block_token",
        0,
        mask,
        block.token_ids[0],
        1,
    )
    unpaired = next(u for u in c.findings if u.kind == "unpaired")
    assert unpaired.fields["reason"] == "token_history" and unpaired.tensor == "inp_noise_embd"
    assert c.coverage.rows_skipped > 0
