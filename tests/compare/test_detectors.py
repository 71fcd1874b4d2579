"""Each detector on hand-made evidence: it finds its fault, gives the right fields, and stays
silent on a neighbouring fault or on noise."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from featdiff.diff import detectors as d
from featdiff.diff.detectors import Evidence, Rope, best_assignment, rotate
from featdiff.diff.result import KINDS
from featdiff.diff.sketch import LayerMatch
from featdiff.diff.tolerance import Tolerance

TOL = Tolerance(rel=1e-3, sources=("test",))
RNG = np.random.default_rng(0)
T, N, K = 8, 16, 2  # rows, n_embd, n_extract
# what a run graph without the log-SNR conditioning lacks (diagnose.absent_records)
LOG_SNR_ABSENT = ("dspark_log_snr_feat", "dspark_log_snr_fc1", "dspark_log_snr_fc2", "dspark_draft_embd_snr")


def rows(n: int = T, width: int = N * K, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def evidence(ref: np.ndarray, run: np.ndarray, **kw) -> Evidence:
    kw.setdefault("positions", tuple(range(10, 10 + len(ref))))
    kw.setdefault("tensor", "inp_target_features")
    return Evidence(ref=ref, run=run, tolerance=TOL, **kw)


def noisy(a: np.ndarray, scale: float = 1e-5) -> np.ndarray:
    return a + scale * RNG.standard_normal(a.shape).astype(np.float32)


# --- nonfinite, zeros, stale -------------------------------------------------------------------


def test_nonfinite_reports_the_positions_holding_nan_or_inf():
    ref = rows()
    run = ref.copy()
    run[2, 3], run[5, 0] = np.nan, np.inf
    f = d.detect_nonfinite(evidence(ref, run))
    assert f.kind == "nonfinite" and f.fields["rows"] == [12, 15] and f.severity == "error"


def test_nonfinite_is_silent_on_finite_rows():
    assert d.detect_nonfinite(evidence(rows(), rows(seed=1))) is None


def test_zeros_found_when_some_rows_were_never_written():
    ref = rows()
    run = noisy(ref)
    run[[0, 1]] = 0.0
    f = d.detect_zeros(evidence(ref, run))
    assert f.kind == "zeros" and f.fields["rows"] == [10, 11]


def test_zeros_silent_when_the_other_rows_also_differ():
    run = rows(seed=1)
    run[0] = 0.0
    assert d.detect_zeros(evidence(rows(), run)) is None


def test_a_zero_first_row_holding_a_state_is_a_stale_pending_row():
    """An MTP head's first row of a sequence is handed zeros; a driver that kept a pending row from
    an earlier request hands a state there (ref zeros, run not), every other row right."""
    ref = rows(4, N)
    ref[0] = 0.0
    run = noisy(ref)
    run[0] = rows(1, N, seed=5)[0]
    f = d.detect_wrong_source_of_zero_rows(evidence(ref, run, tensor="mtp_hnorm-6", record="mtp_hnorm-6"))
    assert f.kind == "wrong_source" and f.fields["source"] == "stale_pending" and "reset the pending" in f.message
    assert d.detect_wrong_source_of_zero_rows(evidence(ref, run, tensor="l_out-2", record="l_out-2")) is None
    run[1] += 1.0  # another row differs too: not this fault
    assert d.detect_wrong_source_of_zero_rows(evidence(ref, run, tensor="mtp_hnorm-6", record="mtp_hnorm-6")) is None


def test_the_first_row_past_a_kept_prefix_holding_another_hidden_is_a_stale_pending_row():
    """A prompt cache kept positions 0..9 (kept 10): the head's row at 10 takes the hidden of 9;
    upstream's MTP driver hands it the pending row of its last process() call, another request's."""
    ref = rows(4, N)
    run = noisy(ref)
    run[0] = rows(1, N, seed=5)[0]
    mtp = {"tensor": "mtp_hnorm-6", "record": "mtp_hnorm-6"}
    f = d.detect_wrong_source_of_pending_row(evidence(ref, run, kept=10, **mtp))
    assert f.kind == "wrong_source" and f.fields["source"] == "stale_pending" and "pending_h" in f.message
    assert "position 10" in f.message and "position 9" in f.message
    assert d.detect_wrong_source_of_pending_row(evidence(ref, run, **mtp)) is None  # nothing kept
    assert d.detect_wrong_source_of_pending_row(evidence(ref, run, kept=11, **mtp)) is None  # not the first new row
    run[2] += 1.0  # another row differs too: not this fault
    assert d.detect_wrong_source_of_pending_row(evidence(ref, run, kept=10, **mtp)) is None


def test_stale_found_when_rows_repeat_an_earlier_eval():
    ref, earlier = rows(4), rows(4, seed=9)
    f = d.detect_stale_rows(evidence(ref, noisy(earlier), earlier=earlier, earlier_evals=(4,) * 4))
    assert f.kind == "stale" and f.fields["rows"] == [10, 11, 12, 13] and f.fields["source_eval"] == 4


def test_stale_silent_without_a_matching_earlier_row():
    assert (
        d.detect_stale_rows(evidence(rows(4), rows(4, seed=1), earlier=rows(4, seed=2), earlier_evals=(4,) * 4)) is None
    )


# --- rows, layouts, positions ------------------------------------------------------------------


@pytest.mark.parametrize("shift", [1, -1, 2])
def test_row_shift_found_with_its_sign(shift):
    ref = rows()
    run = np.roll(ref, -shift, axis=0)  # run row i = ref row i + shift
    positions = tuple(range(10, 10 + T))
    f = d.detect_row_shift(evidence(ref, run, ref_all=ref, ref_all_positions=positions))
    assert f.kind == "row_shift" and f.fields["shift"] == shift


def test_row_shift_silent_on_unrelated_rows():
    ref = rows()
    assert d.detect_row_shift(evidence(ref, rows(seed=1), ref_all=ref, ref_all_positions=tuple(range(10, 18)))) is None


def test_layout_transpose_found_for_layer_major_staging():
    ref = rows()
    run = ref.reshape(T, K, N).transpose(1, 0, 2).reshape(T, K * N)  # (K, T, N) buffer read as (T, K * N)
    f = d.detect_layout_transpose(evidence(ref, run, run_raw=run, n_extract=K))
    assert f.kind == "layout_transpose" and "layer-major" in f.fields["detail"]


def test_layout_transpose_found_for_swapped_axes():
    ref = rows()
    f = d.detect_layout_transpose(evidence(ref, ref.T, run_raw=ref.T.copy()))
    assert f.kind == "layout_transpose" and "transposed" in f.fields["detail"]


def test_layout_transpose_silent_on_other_data():
    run = rows(seed=3)
    assert d.detect_layout_transpose(evidence(rows(), run, run_raw=run, n_extract=K)) is None


@pytest.mark.parametrize("neox", [True, False])
def test_position_offset_found_in_roped_keys(neox):
    rope = Rope(n_head=2, head_dim=8)
    ref = rows(width=16)
    run = rotate(ref, 3, rope, neox)
    f = d.detect_position_offset_of_record(evidence(ref, run, rope=rope, tensor="Kcur_injected-0"))
    assert f.kind == "position_offset" and f.fields["offset"] == 3


def test_rotate_by_k_then_minus_k_is_identity():
    rope = Rope(n_head=2, head_dim=8)
    a = rows(width=16)
    np.testing.assert_allclose(rotate(rotate(a, 5, rope, True), -5, rope, True), a, atol=1e-5)


def test_position_offset_found_in_integer_positions():
    ref = np.arange(10, 14, dtype=np.float64)[:, None]
    f = d.detect_position_offset_of_record(evidence(ref, ref + 1, is_integer=True, tensor="inp_pos"))
    assert f.fields["offset"] == 1


def test_position_offset_silent_on_unrelated_keys():
    ref = rows(width=16)
    assert d.detect_position_offset_of_record(evidence(ref, rows(width=16, seed=5), rope=Rope(2, 8))) is None


# --- feature slots -----------------------------------------------------------------------------


def layer_match(observed: tuple[int, ...], expected=(2, 4), layers=tuple(range(6)), err_match=1e-4) -> LayerMatch:
    err = np.ones((len(expected), len(layers)))
    for k, L in enumerate(observed):
        err[k, layers.index(L)] = err_match
    return LayerMatch("inp_target_features", layers, expected, err, 1 - err, ())


@pytest.mark.parametrize("observed,delta", [((3, 5), 1), ((1, 3), -1)])
def test_layer_offset_names_slot_layers_and_delta(observed, delta):
    f = d.detect_layer_offset(evidence(rows(), rows(seed=1), layers=layer_match(observed)))
    assert f.kind == "layer_offset"
    assert (f.fields["slot"], f.fields["expected_layer"], f.fields["observed_layer"], f.fields["delta"]) == (
        0,
        2,
        observed[0],
        delta,
    )
    assert "slot 0 of inp_target_features is the input of target layer" in f.message


def test_layer_offset_reports_the_first_wrong_slot_only():
    f = d.detect_layer_offset(evidence(rows(), rows(seed=1), layers=layer_match((2, 5))))
    assert (f.fields["slot"], f.fields["delta"]) == (1, 1)


def test_layer_offset_names_every_slot_off_when_they_share_a_layer():
    """Every slot on the first slot's layer (a driver that never advanced the layer with the slot)."""
    f = d.detect_layer_offset(evidence(rows(), rows(seed=1), layers=layer_match((2, 2, 2), expected=(2, 4, 5))))
    assert (f.fields["slot"], f.fields["observed_layers"]) == (1, [2, 2, 2])
    assert "(slots 1, 2 are the inputs of layers 2, 2)" in f.message, f.message


def test_layer_offset_silent_when_slots_are_only_reordered():
    assert d.detect_layer_offset(evidence(rows(), rows(seed=1), layers=layer_match((4, 2)))) is None


def test_layer_offset_silent_when_no_layer_matches():
    lm = layer_match((3, 5), err_match=0.5)
    assert d.detect_layer_offset(evidence(rows(), rows(seed=1), layers=lm)) is None


def test_slot_permutation_found_from_the_layer_matrix():
    f = d.detect_slot_permutation(evidence(rows(), rows(seed=1), layers=layer_match((4, 2))))
    assert f.kind == "slot_permutation" and f.fields["permutation"] == [1, 0]


def test_slot_permutation_found_by_slot_assignment():
    ref = rows(width=3 * N)
    run = ref.reshape(T, 3, N)[:, [2, 0, 1], :].reshape(T, 3 * N)  # (T, 3 * N), slots reordered
    f = d.detect_slot_permutation(evidence(ref, run, n_extract=3))
    assert f.fields["permutation"] == [2, 0, 1]


def test_slot_permutation_found_from_a_reference_candidate():
    ref, cand = rows(width=N), rows(width=N, seed=4)
    f = d.detect_slot_permutation(
        evidence(ref, noisy(cand), tensor="inp_g_embeddings", candidates={"inp_g_embeddings@slots=1,0": cand})
    )
    assert f.fields["permutation"] == [1, 0] and f.tensor == "inp_g_embeddings"


def test_slot_permutation_silent_on_identity():
    ref = rows()
    assert d.detect_slot_permutation(evidence(ref, noisy(ref), n_extract=K, layers=layer_match((2, 4)))) is None


def test_best_assignment_exhaustive_and_greedy_agree_on_a_clear_cost():
    perm = [3, 1, 0, 2, 8, 4, 5, 6, 7]
    cost = np.ones((9, 9))
    cost[np.arange(9), perm] = 0.0
    assert best_assignment(cost) == perm  # 9 slots: greedy
    assert best_assignment(1.0 - np.eye(3)[:, [2, 0, 1]]) == [1, 2, 0]  # 3 slots: exhaustive


# --- terms and sources -------------------------------------------------------------------------


def test_missing_term_names_the_reference_component():
    embd, term = rows(4, N), rows(4, N, seed=2)
    f = d.detect_missing_term(
        evidence(
            embd + term,
            noisy(embd),
            tensor="dspark_draft_embd_snr",
            record="dspark_draft_embd_snr",
            candidates={"dspark_log_snr_fc2": term},
        )
    )
    assert (f.kind, f.tensor, f.fields) == ("missing_term", "dspark_draft_embd_snr", {"term": "dspark_log_snr_fc2"})


def test_missing_term_found_downstream_when_the_run_graph_has_no_sum():
    out, term = rows(4, N), rows(4, N, seed=2)
    f = d.detect_missing_term(
        evidence(
            out,
            rows(4, N, seed=3),
            tensor="l_out-0",
            record="l_out-0",
            candidates={"dspark_log_snr_fc2": term},
            absent=LOG_SNR_ABSENT,
        )
    )
    assert (f.kind, f.tensor) == ("missing_term", "l_out-0")
    assert f.fields == {"term": "dspark_log_snr_fc2", "expected_in": "dspark_draft_embd_snr"}


def test_missing_term_downstream_silent_when_the_sum_is_there_or_the_pair_feeds_it():
    out, term = rows(4, N), rows(4, N, seed=2)
    kw = dict(candidates={"dspark_log_snr_fc2": term})
    assert d.detect_missing_term(evidence(out, rows(4, N, seed=3), tensor="l_out-0", record="l_out-0", **kw)) is None
    for record in ("inp_noise_embd", "dspark_log_snr_fc1"):
        ev = evidence(out, rows(4, N, seed=3), tensor=record, record=record, absent=LOG_SNR_ABSENT, **kw)
        assert d.detect_missing_term(ev) is None
    ev = evidence(out, rows(4, N, seed=3), tensor="l_out-0", record="l_out-0", absent=LOG_SNR_ABSENT)
    assert d.detect_missing_term(ev) is None  # no term in this eval: the checkpoint adds nothing here


def test_extra_term_names_the_reference_component():
    embd, term = rows(4, N), rows(4, N, seed=2)
    f = d.detect_extra_term(
        evidence(embd, noisy(embd + term), tensor="inp_noise_embd", candidates={"dspark_log_snr_fc2": term})
    )
    assert f.kind == "extra_term" and f.fields["term"] == "dspark_log_snr_fc2" and f.tensor == "inp_noise_embd"


def test_terms_silent_when_the_residual_is_something_else():
    embd, term = rows(4, N), rows(4, N, seed=2)
    ev = evidence(embd, rows(4, N, seed=3), candidates={"dspark_log_snr_fc2": term})
    assert d.detect_missing_term(ev) is None and d.detect_extra_term(ev) is None


def test_wrong_source_names_the_table():
    own, target = rows(4, N), rows(4, N, seed=7)
    f = d.detect_wrong_source(
        evidence(own, noisy(target), tensor="inp_noise_embd", candidates={"inp_noise_embd@table=target": target})
    )
    assert f.kind == "wrong_source" and f.fields["source"] == "target"


def test_wrong_source_ignores_candidates_other_detectors_own():
    own, cand = rows(4, N), rows(4, N, seed=7)
    ev = evidence(own, cand, candidates={"dspark_draft_embd_snr@log_snr=none": cand, "x@slots=1,0": cand})
    assert d.detect_wrong_source(ev) is None


def test_scale_reports_the_factor():
    ref = rows()
    f = d.detect_scale(evidence(ref, 1.25 * ref))
    assert f.kind == "scale" and f.fields["factor"] == pytest.approx(1.25, rel=1e-5)


def test_scale_silent_on_noise_and_on_other_data():
    ref = rows()
    assert d.detect_scale(evidence(ref, noisy(ref))) is None
    assert d.detect_scale(evidence(ref, rows(seed=1))) is None


# --- fallbacks ---------------------------------------------------------------------------------


def test_divergence_carries_metric_value_and_tolerance():
    f = d.detect_divergence(evidence(rows(), rows(seed=1)), 0.5)
    assert (f.kind, f.fields["metric"], f.fields["value"], f.fields["tolerance"]) == (
        "divergence",
        "nmse",
        0.5,
        TOL.nmse,
    )


def test_divergence_on_unalignable_shapes_reports_both():
    f = d.detect_divergence(evidence(rows(), rows(T, 3 * N)), float("nan"))
    assert f.fields["metric"] == "shape" and f.fields["value"] == [T, 3 * N]


def test_numeric_noise_is_info_and_absent_for_identical_data():
    f = d.detect_numeric_noise("l_out-3", 1e-8, TOL)
    assert f.severity == "info" and f.kind == "numeric_noise" and f.fields["tolerance"] == TOL.nmse
    assert d.detect_numeric_noise("l_out-3", 0.0, TOL) is None


def _with_nan() -> Evidence:
    ref = rows()
    run = ref.copy()
    run[2, 3] = np.nan
    return evidence(ref, run)


def _with_zeros() -> Evidence:
    ref = rows()
    run = ref.copy()
    run[[0, 1]] = 0.0
    return evidence(ref, run)


def _repeating_an_earlier_eval() -> Evidence:
    earlier = rows(4, seed=9)
    return evidence(rows(4), earlier.copy(), earlier=earlier, earlier_evals=(4,) * 4)


def _shifted() -> Evidence:
    ref = rows()
    return evidence(ref, np.roll(ref, -1, axis=0), ref_all=ref, ref_all_positions=tuple(range(10, 18)))


def _misplaced() -> Evidence:
    ref = rows()
    run = np.concatenate([ref[:4], ref[:4]])  # (8, width): rows 4..7 hold rows 0..3
    return evidence(ref, run, ref_all=ref, ref_all_positions=tuple(range(10, 18)))


def _scaled() -> Evidence:
    ref = rows()
    return evidence(ref, 1.25 * ref)


def _positions_late() -> Evidence:
    ref = np.arange(10, 14, dtype=np.float64)[:, None]
    return evidence(ref, ref + 1, is_integer=True, tensor="inp_pos")


def _layer_major() -> Evidence:
    ref = rows()
    run = ref.reshape(T, K, N).transpose(1, 0, 2).reshape(T, K * N)  # (K, T, N) buffer read as (T, K * N)
    return evidence(ref, run, run_raw=run, n_extract=K)


@pytest.mark.parametrize(
    "detect, planted",
    [
        (d.detect_nonfinite, _with_nan),
        (d.detect_zeros, _with_zeros),
        (d.detect_stale_rows, _repeating_an_earlier_eval),
        (d.detect_row_shift, _shifted),
        (d.detect_misplaced_rows, _misplaced),
        (d.detect_scale, _scaled),
        (d.detect_position_offset_of_record, _positions_late),
        (d.detect_layout_transpose, _layer_major),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_detectors_are_deterministic(detect, planted):
    """Two calls on equal evidence (each built afresh) give one finding, of the detector's own
    kind, the same both times."""
    first, second = detect(planted()), detect(planted())
    assert first is not None and detect.__name__.startswith(f"detect_{first.kind}")
    assert first == second


def test_misplaced_rows_found_when_later_chunks_hold_the_first_chunks_rows():
    """Rows 4..7 hold rows 0..3 (a chunked inject reading chunk 0), rows 0..3 are right."""

    rng = np.random.default_rng(3)
    ref = rng.standard_normal((8, 16)).astype(np.float32)  # (positions 0..7, width)
    run = np.concatenate([ref[:4], ref[:4]])  # (8, 16)
    tol = Tolerance(rel=1e-3, sources=("test",))
    ev = Evidence("inp_target_features", ref, run, tol, positions=tuple(range(8)), ref_all=ref,
                  ref_all_positions=tuple(range(8)))  # fmt: skip
    f = d.detect_misplaced_rows(ev)
    assert f is not None and f.kind == "misplaced_rows"
    assert f.fields["rows"] == [4, 5, 6, 7] and f.fields["sources"] == [0, 1, 2, 3]


def test_misplaced_rows_needs_every_wrong_row_to_be_some_reference_row():

    rng = np.random.default_rng(4)
    ref = rng.standard_normal((8, 16)).astype(np.float32)
    run = ref.copy()
    run[5] = rng.standard_normal(16)  # noise, no reference row
    tol = Tolerance(rel=1e-3, sources=("test",))
    ev = Evidence("x", ref, run, tol, positions=tuple(range(8)), ref_all=ref, ref_all_positions=tuple(range(8)))
    assert d.detect_misplaced_rows(ev) is None
    assert d.detect_misplaced_rows(Evidence("x", ref, ref.copy(), tol, positions=tuple(range(8)), ref_all=ref,
                                          ref_all_positions=tuple(range(8)))) is None  # fmt: skip


# --- the detector contract, for every detector of the package ----------------------------------

PACKAGE = Path(d.__file__).parent
SOURCE = PACKAGE.parents[1]  # src/featdiff
# what a pure detector never imports: files, processes, clocks, logs, randomness
IMPURE_MODULES = {"io", "logging", "os", "pathlib", "random", "shutil", "subprocess", "sys", "tempfile", "time"}


def _detector_defs() -> list[tuple[str, ast.FunctionDef]]:
    """(module, definition) of every module-level `detect_*` function of the detectors package."""
    return [
        (path.name, node)
        for path in sorted(PACKAGE.glob("*.py"))
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("detect_")
    ]


def _kind_of(name: str) -> str | None:
    """The finding kind a detector's name says: `detect_<kind>` or `detect_<kind>_<what it reads>`."""
    rest = name.removeprefix("detect_")
    return max((k for k in KINDS if rest == k or rest.startswith(f"{k}_")), key=len, default=None)


def test_detector_names_are_unique_and_each_names_a_kind():
    names = [f"{module}: {node.name}" for module, node in _detector_defs()]
    assert len({n.split(": ")[1] for n in names}) == len(names), sorted(names)
    assert [n for n in names if _kind_of(n.split(": ")[1]) is None] == []
    assert {_kind_of(node.name) for _, node in _detector_defs()} == set(KINDS)  # each kind has its detector


def test_every_detector_states_its_hypothesis_and_evidence_and_returns_a_finding():
    for module, node in _detector_defs():
        doc = ast.get_docstring(node) or ""
        assert doc.startswith("Hypothesis:") and "Evidence" in doc, f"{module}: {node.name}"
        assert node.returns is not None and ast.unparse(node.returns) in ("Finding | None", "Finding"), node.name


def test_every_detector_is_exported_by_the_package():
    assert {node.name for _, node in _detector_defs()} == {n for n in d.__all__ if n.startswith("detect_")}
    assert all(callable(getattr(d, n)) for n in d.__all__)


def test_detector_modules_do_no_io():
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
            n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
        }
        called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert not imported & IMPURE_MODULES and not called & {"print", "open", "input"}, path.name


def test_every_finding_is_made_from_its_kinds_record():
    """Only `Finding.of(<the kind's record>, ...)` makes a finding (result.py's from_json reads
    one back): no producer writes a kind's fields as a dict of its own."""
    makers = [
        f"{path.relative_to(SOURCE)}:{n.lineno}"
        for path in sorted(SOURCE.rglob("*.py"))
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "Finding"
    ]
    assert [m for m in makers if not m.startswith("diff/result.py:")] == []


# --- the logits a drafter's sampler read ---------------------------------------------------------


def _top_k(logits: np.ndarray, k: int = 3) -> np.ndarray:
    """What llama.cpp's backend top-k sampler reads back: each row's k largest, -inf elsewhere."""
    out = np.full_like(logits, -np.inf)
    top = np.argsort(logits, axis=1)[:, -k:]
    np.put_along_axis(out, top, np.take_along_axis(logits, top, axis=1), axis=1)
    return out


def test_a_sampler_reading_another_rows_logits_is_named_a_wrong_source():
    """Two sequences' draft step: the graph's rows are right, and the sampler read row 1's top-k
    for row 0 as well (llama-server's EAGLE3 drafts with backend sampling, two slots at once)."""
    from featdiff.kinds import registry as kinds

    graph = rows(2, 32, seed=3)
    read = _top_k(graph[[1, 1]])
    ev = evidence(_top_k(graph), read, tensor="draft_logits", sampled=(read, graph), kind=kinds.by_name("eagle3"))
    f = d.detect_wrong_source_of_sampled_logits(ev)
    assert f is not None and f.fields == {"source": "another_output_row", "candidate": "result_output"}
    assert "positions 10 (" in f.message and "--no-spec-draft-backend-sampling" in f.message
    own = _top_k(graph)  # the sampler read each row's own logits: nothing to say
    assert d.detect_wrong_source_of_sampled_logits(replace(ev, sampled=(own, graph))) is None
    assert d.detect_wrong_source_of_sampled_block_rows(ev) is None  # the block drafters' detector: not a step's


def test_a_block_drafters_sampler_reading_another_rows_logits_is_named_a_wrong_source():
    """A DFlash draft block of four rows, every row computed right, the sampler reading row 3's
    top-k for row 2 as well (llama-server's backend draft sampling, several slots at once)."""
    from featdiff.kinds import registry as kinds

    graph = rows(4, 32, seed=3)
    read = _top_k(graph[[0, 1, 3, 3]])
    ev = evidence(noisy(graph), read, tensor="draft_logits", sampled=(read, graph), kind=kinds.by_name("dflash"))
    assert d.detect_wrong_source_of_sampled_logits(ev) is None  # the step drafters' detector: not a block's
    f = d.detect_wrong_source_of_sampled_block_rows(ev)
    assert f is not None and f.fields == {"source": "another_output_row", "candidate": "result_output"}
    assert "positions 12 (" in f.message and "--no-spec-draft-backend-sampling" in f.message
    assert "Markov" not in f.message
    own = _top_k(graph)
    assert d.detect_wrong_source_of_sampled_block_rows(replace(ev, run=own, sampled=(own, graph))) is None
    # DSpark: the reference's Markov bias is what the graph adds before sampling; modelled, not skipped
    bias = rows(4, 32, seed=9)
    biased = _top_k((graph + bias)[[0, 0, 2, 3]])  # row 1 read row 0's biased logits
    dspark = replace(
        ev, ref=noisy(graph + bias), run=biased, sampled=(biased, graph), candidates={"dspark_markov_bias": bias}
    )
    f = d.detect_wrong_source_of_sampled_block_rows(dspark)
    assert f is not None and "positions 11 (" in f.message and "dspark_markov_bias" in f.message


def _ids_swapped(meant: np.ndarray, rows_from: dict[int, int], k: int = 3) -> np.ndarray:
    """A backend sampler's read-back where row i (a key of `rows_from`) holds its own top-k values
    under row rows_from[i]'s top-k ids (the pinned llama-server's DSpark block on a loaded machine)."""
    out = _top_k(meant, k)
    for i, j in rows_from.items():
        out[i] = -np.inf
        out[i, np.argsort(meant[j])[::-1][:k]] = np.sort(meant[i])[::-1][:k]
    return out


def test_rows_read_with_another_rows_ids_name_the_row_whose_ids_they_carry():
    """ids_taken_from: a row read under another row's top-k ids, its values its own, names that row;
    a row read right, or read whole from another row (ids and values), names none."""
    from featdiff.diff.detectors.readback import ids_taken_from

    meant = rows(3, 32, seed=3)
    assert ids_taken_from(_top_k(meant), meant, TOL) == (None, None, None)
    assert ids_taken_from(_ids_swapped(meant, {0: 2, 1: 2}), meant, TOL) == (2, 2, None)
    assert ids_taken_from(_top_k(meant[[2, 1, 2]]), meant, TOL) == (None, None, None)  # values not its own
    assert ids_taken_from(_ids_swapped(meant, {1: 0}, k=5), meant, TOL) == (None, 0, None)


def test_a_block_read_under_another_rows_ids_says_whose_ids_it_read():
    """A DSpark block whose rows 0 and 1 hold their own top-k values under row 2's ids (measured on
    the pinned llama-server): another_output_row, with `ids_from` and the sentence saying so."""
    from featdiff.kinds import registry as kinds

    graph, bias = rows(3, 32, seed=3), rows(3, 32, seed=9)
    read = _ids_swapped(graph + bias, {0: 2, 1: 2})
    ev = evidence(noisy(graph + bias), read, tensor="draft_logits", sampled=(read, graph), kind=kinds.by_name("dspark"))
    f = d.detect_wrong_source_of_sampled_block_rows(replace(ev, candidates={"dspark_markov_bias": bias}))
    assert f is not None and f.fields == {
        "source": "another_output_row",
        "candidate": "result_output",
        "ids_from": [12, 12],
    }
    assert "positions 10..11 (" in f.message and "own top-k values under the token ids" in f.message
    assert "(10, 11 under 12's)" in f.message


def _chain_tie(gap: float):
    """A DSpark block of three rows whose reference row 0 has tokens 5 and 7 `gap` apart (5 first),
    and a run whose chain took 7 there: rows 1 and 2 carry token 7's bias in the run."""
    from featdiff.diff.aligned import comparable_values
    from featdiff.kinds import registry as kinds

    graph, bias, other = rows(3, 32, seed=3), rows(3, 32, seed=9), rows(3, 32, seed=11)
    meant = graph + bias
    meant[0, 5], meant[0, 7] = 4.0 + gap, 4.0  # the reference's chain takes 5
    run = meant.copy()
    run[0, 5], run[0, 7] = 4.0, 4.0 + gap  # the run's takes 7, within its noise
    run[1:] = graph[1:] + other[1:]  # token 7's bias on the rows after
    read = _top_k(run)
    ref, blanked = comparable_values("draft_logits", meant, read)  # as compare pairs them
    ev = evidence(ref, blanked, tensor="draft_logits", sampled=(read, graph), kind=kinds.by_name("dspark"))
    return replace(ev, candidates={"dspark_markov_bias": bias})


def test_a_dspark_chain_taking_the_other_token_of_a_near_tie_is_information():
    """DSpark's Markov head chains each row's bias from the argmax of the row before (in the
    graph); at a near-tie the run may take the other token, and the rows after differ rightly."""
    from featdiff.diff.diagnose import diagnose_root

    f = d.detect_chain_choice(_chain_tie(1e-5))
    assert f is not None and (f.kind, f.severity) == ("chain_choice", "info")
    assert (f.fields["position"], f.fields["expected"], f.fields["observed"], f.fields["rows"]) == (10, 5, 7, [11, 12])
    assert f.fields["margin"] <= f.fields["bound"] and "not judged" in f.message
    assert diagnose_root(_chain_tie(1e-5), 1.0).kind == "chain_choice"  # before the row-read-elsewhere detector


def test_the_drafts_a_dspark_chain_biased_after_a_near_tie_are_not_judged():
    """compare sets aside the partings of the rows a chain_choice names, in its round only."""
    from featdiff.core.phases import Phase
    from featdiff.diff import diagnose
    from featdiff.diff.partings import Parting

    root = d.detect_chain_choice(_chain_tie(1e-5))
    assert root is not None
    chained = diagnose.chain_rows(root, ("draft", "draft", 4))
    assert chained == {(4, 11), (4, 12)}
    draft = Parting(Phase.DRAFT, 4, 1, 11, 9, "draft_logits", 5, 7, 1.0, 1e-3)
    later, verify = replace(draft, round=5), replace(draft, phase=Phase.VERIFY, tensor="result_output")
    assert diagnose.judged_partings((draft, later, verify), None, chained) == (later, verify)
    assert diagnose.chain_rows(replace(root, kind="near_tie"), ("draft", "draft", 4)) == frozenset()


def test_a_dspark_chain_parting_beyond_the_noise_is_not_a_near_tie():
    assert d.detect_chain_choice(_chain_tie(0.5)) is None  # 5 beats 7 by far: the run's chain is wrong
    ev = _chain_tie(1e-5)
    assert d.detect_chain_choice(replace(ev, candidates={})) is None  # no Markov head: nothing chains
    first = ev.run.copy()
    first[0] += 1.0  # row 0 itself differs: not the chain's choice
    assert d.detect_chain_choice(replace(ev, run=first)) is None
    from featdiff.kinds import registry as kinds

    assert d.detect_chain_choice(replace(ev, kind=kinds.by_name("eagle3"))) is None


def test_block_rows_read_elsewhere_are_those_not_read_as_the_drafter_means():
    """rows_read_elsewhere on synthetic blocks: each row's read values against its graph row plus
    the Markov bias (DSpark) or as computed (DFlash), judged only where the graph matches the ref."""
    from featdiff.diff.detectors.readback import rows_read_elsewhere

    graph, bias = rows(4, 32, seed=3), rows(4, 32, seed=9)
    bias[0] = 0.0  # a bonus-anchor block's row 0 passes through unbiased
    meant = graph + bias
    assert rows_read_elsewhere(_top_k(graph), graph, None, graph, TOL) == (False,) * 4
    assert rows_read_elsewhere(graph[[1, 1, 2, 3]], graph, None, graph, TOL) == (True, False, False, False)
    assert rows_read_elsewhere(_top_k(meant), graph, bias, meant, TOL) == (False,) * 4
    assert rows_read_elsewhere(_top_k(meant[[0, 2, 2, 3]]), graph, bias, meant, TOL) == (False, True, False, False)
    assert rows_read_elsewhere(_top_k(meant[[1, 1, 2, 3]]), graph, bias, meant, TOL) == (True, False, False, False)
    # the head left out (the run drafted as plain DFlash): missing_term's finding, not the sampler's
    assert rows_read_elsewhere(_top_k(graph), graph, bias, meant, TOL) == (False,) * 4
    # a graph row that is not the reference's: the graph's fault, no row is judged
    wrong = meant.copy()
    wrong[3] += 1.0
    assert rows_read_elsewhere(_top_k(meant[[0, 2, 2, 3]]), graph, bias, wrong, TOL) == (False,) * 4
    # a bias the reference lays out on other rows: nothing to judge
    assert rows_read_elsewhere(_top_k(meant), graph, bias[:3], meant, TOL) == (False,) * 4
