"""compare_dumps end to end on synthetic dumps: one planted fault each gives its finding at the
first divergence, with the inherited errors downstream not reported again."""

from __future__ import annotations

import numpy as np
import pytest

from featdiff.diff import compare_dumps, exit_code
from featdiff.dump.reader import read_dump

import synth

REF_MODELS = {"draft": {"target_layers": [2, 4]}, "target": {"n_embd": 16}}


def errors(c):
    return [f for f in c.findings if f.severity == "error"]


def only_error(c):
    errs = errors(c)
    assert len(errs) == 1, [(f.kind, f.tensor) for f in errs]
    assert exit_code(c) == 1
    return errs[0]


@pytest.mark.parametrize("layers,delta", [((3, 5), 1), ((1, 3), -1)])
def test_layer_offset_found_when_target_layers_are_off(synth_ref, synth_run, layers, delta):
    run = synth_run(spec=synth.Spec(target_layers=layers), models=REF_MODELS)
    c = compare_dumps(synth_ref, run, None)
    f = only_error(c)
    assert (f.kind, f.tensor, f.fields["slot"], f.fields["delta"]) == ("layer_offset", "inp_target_features", 0, delta)
    assert c.pairs[c.first_divergence].name == "inp_target_features" and c.pairs[c.first_divergence].eval == 1


def test_downstream_of_the_root_is_marked_inherited(synth_ref, synth_run):
    c = compare_dumps(synth_ref, synth_run(spec=synth.Spec(target_layers=(3, 5)), models=REF_MODELS), None)
    g = next(p for p in c.pairs if p.name == "inp_g_embeddings" and p.eval == 1)
    assert not g.within and g.inherited


def test_slot_permutation_found_from_the_swapped_fc_candidate(synth_ref, synth_run):
    with read_dump(synth_ref) as ref:
        cand = {r.eval: np.array(ref.array(r)) for r in ref.records() if r.name == "inp_g_embeddings@slots=1,0"}
    run = synth_run(mutate=lambda ev, name, a: cand[ev.eval] if name == "inp_g_embeddings" else a)
    f = only_error(compare_dumps(synth_ref, run, None))
    assert (f.kind, f.tensor, f.fields["permutation"]) == ("slot_permutation", "inp_g_embeddings", [1, 0])


def test_missing_term_found_when_log_snr_is_dropped(tmp_path, synth_run):
    """A graph without the log-SNR nodes: one missing_term at the first record computed from the
    sum (here result_output), no missing_tensor for the nodes themselves."""
    ref = synth.write(tmp_path / "ref-snr.npz", synth.Spec(log_snr=True))
    c = compare_dumps(ref, synth_run(), None)
    f = only_error(c)
    assert (f.kind, f.tensor, f.fields["term"]) == ("missing_term", "result_output", "dspark_log_snr_fc2")
    assert f.fields["expected_in"] == "dspark_draft_embd_snr"
    assert next(p for p in c.pairs if p.name == "inp_noise_embd").within


def test_missing_term_found_at_the_sum_when_the_run_skips_the_term(tmp_path, synth_run):
    ref = synth.write(tmp_path / "ref-snr.npz", synth.Spec(log_snr=True))
    w = synth.weights(synth.Spec())
    run = synth_run(
        spec=synth.Spec(log_snr=True),
        mutate=lambda ev, n, a: w.draft_emb[list(ev.token_ids)] if n == "dspark_draft_embd_snr" else a,
    )
    f = only_error(compare_dumps(ref, run, None))
    assert (f.kind, f.tensor, f.fields["term"]) == ("missing_term", "dspark_draft_embd_snr", "dspark_log_snr_fc2")
    assert "expected_in" not in f.fields


def test_extra_term_found_when_the_run_adds_the_term_to_inp_noise_embd(tmp_path, synth_run):
    """A fork that puts the sum under inp_noise_embd (featdiff's names before docs/records.md)."""
    ref = synth.write(tmp_path / "ref-snr.npz", synth.Spec(log_snr=True))
    run = synth_run(spec=synth.Spec(log_snr=True, old_log_snr_names=True))
    f = only_error(compare_dumps(ref, run, None))
    assert (f.kind, f.tensor, f.fields["term"]) == ("extra_term", "inp_noise_embd", "dspark_log_snr_fc2")


def test_log_snr_run_against_its_reference_is_clean(tmp_path, synth_run):
    ref = synth.write(tmp_path / "ref-snr.npz", synth.Spec(log_snr=True))
    c = compare_dumps(ref, synth_run(spec=synth.Spec(log_snr=True)), None)
    assert exit_code(c) == 0 and c.ok
    assert {"dspark_log_snr_fc2", "dspark_draft_embd_snr"} <= {p.name for p in c.pairs}


def test_log_snr_records_filtered_out_of_the_capture_are_not_called_missing(tmp_path, synth_run):
    """Filters that did not keep the log-SNR names say nothing about the graph: no missing_tensor,
    and no missing_term without the evidence that the graph lacks the sum."""
    ref = synth.write(tmp_path / "ref-snr.npz", synth.Spec(log_snr=True))
    run = synth_run(build={"filters": {"draft": ["inp_noise_embd", "result_output"], "target": ["*"]}})
    kinds = {f.kind for f in errors(compare_dumps(ref, run, None))}
    assert kinds == {"divergence"}


def test_old_reference_dump_with_log_snr_embed_still_names_the_term(tmp_path, synth_run):
    """A reference dump from before the graph names (`log_snr_embed`, `inp_noise_embd` holding the
    sum) still compares: `log_snr_embed` is read as `dspark_log_snr_fc2` (names.OLD_RECORD_NAMES)."""
    ref = synth.write(tmp_path / "ref-old.npz", synth.Spec(log_snr=True, old_log_snr_names=True))
    f = only_error(compare_dumps(ref, synth_run(), None))
    assert (f.kind, f.tensor, f.fields["term"]) == ("missing_term", "inp_noise_embd", "dspark_log_snr_fc2")


def test_unconditioned_run_of_a_conditioned_graph_is_an_unexpected_tensor(synth_ref, synth_run):
    """The run computes log-SNR nodes the checkpoint has none of (a drafter without log-SNR)."""
    c = compare_dumps(synth_ref, synth_run(spec=synth.Spec(log_snr=True)), None)
    assert ("unexpected_tensor", "dspark_log_snr_fc2") in {(f.kind, f.tensor) for f in errors(c)}


def test_wrong_source_found_when_the_target_table_is_borrowed(synth_ref, synth_run):
    w = synth.weights(synth.Spec())
    run = synth_run(mutate=lambda ev, n, a: w.target_emb_for_draft[list(ev.token_ids)] if n == "inp_noise_embd" else a)
    f = only_error(compare_dumps(synth_ref, run, None))
    assert (f.kind, f.fields["source"]) == ("wrong_source", "target")


def test_layer_offset_seen_even_inside_a_wide_tolerance(synth_ref, synth_run):
    """A quantized run's tolerance can swallow a neighbouring layer; the layer match cannot."""
    models = {"draft": {"target_layers": [2, 4], "weight_types": ["q4_0"]}, "target": {"weight_types": ["q4_0"]}}
    run = synth_run(spec=synth.Spec(target_layers=(3, 5)), models=models)
    f = errors(compare_dumps(synth_ref, run, None))[0]
    assert f.kind == "layer_offset" and f.fields["delta"] == 1


def test_several_independent_roots_each_get_a_finding(tmp_path, synth_run):
    ref = synth.write(tmp_path / "ref-snr.npz", synth.Spec(log_snr=True))
    w = synth.weights(synth.Spec())
    run = synth_run(
        spec=synth.Spec(target_layers=(3, 5), log_snr=True),
        models=REF_MODELS,
        mutate=lambda ev, n, a: w.draft_emb[list(ev.token_ids)] if n == "dspark_draft_embd_snr" else a,
    )
    assert {f.kind for f in errors(compare_dumps(ref, run, None))} == {"layer_offset", "missing_term"}


def test_clean_pair_exits_zero(synth_ref, synth_run):
    c = compare_dumps(synth_ref, synth_run(), None)
    assert exit_code(c) == 0 and c.ok
    assert [f.kind for f in c.findings] == ["numeric_noise"]


def test_head_major_keys_are_a_layout_transpose(synth_ref, tmp_path):
    from transform import rewrite

    def head_major(r, a):
        return (
            np.ascontiguousarray(a.transpose(1, 0, 2)) if r.name == "Kcur_injected-0" and r.eval == 1 else a
        )  # (n_head_kv, T, head_dim)

    run = rewrite(synth.write(tmp_path / "run.npz", side="run"), tmp_path / "hm.npz", head_major)
    c = compare_dumps(synth_ref, run, None)
    f = only_error(c)
    assert (f.kind, f.tensor) == ("layout_transpose", "Kcur_injected-0") and "2-block-major" in f.fields["detail"]
    assert not c.alignments[c.first_divergence].comparable


def test_comparison_carries_the_layer_match_and_the_row_shift_it_concluded(synth_ref, synth_run):
    from featdiff.diff import layer_match_matrix

    run = synth_run(spec=synth.Spec(target_layers=(3, 5)), models=REF_MODELS)
    c = compare_dumps(synth_ref, run, None)
    m = c.layer_match
    assert m.layers == tuple(range(6)) and m.expected_layers == (2, 4) and m.closest_layers == (3, 5)
    assert m.run_layers == (2, 4)  # what the run's manifest says: the GGUF stated the expected layers
    assert m.similarity.shape == m.rel_err.shape == (2, 6) and m.similarity[0, 3] == max(m.similarity[0])
    assert m.expected_columns() == (2, 4)
    alone = layer_match_matrix(synth_ref, run)  # the search alone gives the same matrix
    assert np.array_equal(alone.similarity, m.similarity) and alone.closest_layers == m.closest_layers
    assert c.row_shift.record == "inp_target_features (e1 draft inject)" and c.row_shift.similarity.shape == (7, 7)
    assert c.row_shift.best_shift() == 0  # wrong layers, not shifted rows
