"""A feature the reference left out (docs/findings.md, `unmodelled`): compare sets aside the drafter
records computed after the feature's first read and says so in one info finding, and judges the
rest as always: a fault before the first read, or on the target, is still an error.

The synthetic pair (synth.py) has, per draft eval, `inp_noise_embd` then `result_output`, and per
inject eval `inp_target_features`, `inp_g_embeddings`, `Kcur_injected-0`; the run's manifest lists
the unmodelled feature as a capture writes it (`models.draft.unmodelled`, docs/dump.md)."""

from __future__ import annotations

from featdiff.core import names
from featdiff.diff import compare_dumps, exit_code, verdict
from featdiff.diff.dependence import Gap, gap_of, graph_rank
from featdiff.diff.detectors import detect_unmodelled
from featdiff.dump.reader import read_dump
from featdiff.kinds.dflash import modelled

import synth

ATTN_SCALE = modelled.KEY_ATTN_SCALE  # first read at kqv_out-0 of the draft eval
UNKNOWN = "dflash.some_future_key"  # first read unknown: every record the drafter computes
SPEC = synth.Spec()


def _models(draft_unmodelled: list[str], target_unmodelled: list[str] = ()) -> dict:
    return {
        "draft": {"target_layers": list(SPEC.target_layers), "unmodelled": draft_unmodelled},
        "target": {"n_embd": SPEC.n_embd, "unmodelled": list(target_unmodelled)},
    }


def _scaled(record: str, role: str = "draft"):
    """A run mutation: `record` of every `role` eval times 1.5 (a planted fault, or the feature)."""
    return lambda ev, name, a: a * 1.5 if (ev.role, name) == (role, record) else a


def _gap(*found: str) -> Gap:
    return Gap(draft=found, target=(), uses=tuple(modelled.first_use(n) for n in found))


# --- the rule and the detector ------------------------------------------------------------------


def test_the_rule_sets_aside_what_follows_the_first_read():
    gap = _gap(ATTN_SCALE)
    assert modelled.first_use(modelled.KEY_SLIDING_WINDOW) == gap.uses[0]  # a dump made before it was modelled
    assert not gap.depends("draft", "draft", names.INP_NOISE_EMBD)  # before the first attention
    assert not gap.depends("draft", "draft", names.layer_name(names.QCUR, 0))
    assert gap.depends("draft", "draft", names.layer_name(names.KQV_OUT, 0))
    assert gap.depends("draft", "draft", names.layer_name(names.L_OUT, 0))
    assert gap.depends("draft", "draft", names.RESULT_OUTPUT)
    assert gap.depends("draft", "draft", names.DRAFT_LOGITS)  # a readback after the graph: last
    assert not gap.depends("draft", "inject", names.layer_name(names.KCUR_INJECTED, 1))  # the cache is alike
    assert not gap.depends("target", "verify", names.RESULT_OUTPUT)
    fc = _gap("fc.scale")  # first read at inject: every later drafter record, the staged features not
    assert not fc.depends("draft", "inject", names.INP_TARGET_FEATURES)
    assert fc.depends("draft", "inject", names.INP_G_EMBEDDINGS)
    assert fc.depends("draft", "draft", names.INP_NOISE_EMBD)
    assert _gap(UNKNOWN).uses == (modelled.FIRST_USE_UNKNOWN,)
    assert graph_rank("draft", "l_out-1") > graph_rank("draft", "kqv_out-0") > graph_rank("draft", "Qcur-0")


def test_detect_unmodelled_names_the_feature_and_what_it_set_aside():
    assert detect_unmodelled(None, (), ()) is None
    f = detect_unmodelled(_gap(ATTN_SCALE), ("result_output (draft, round 1)",), ("result_output (draft, round 1)",))
    assert f is not None and f.kind == "unmodelled" and f.severity == "info" and f.tensor == ATTN_SCALE
    assert f.message.startswith(
        f"the drafter uses {ATTN_SCALE}, which featdiff's reference does not model: no verdict on"
    )
    assert f.fields == {
        "names": [ATTN_SCALE],
        "role": "draft",
        "first_use": ["kqv_out-0 (draft)"],
        "not_judged": ["result_output (draft, round 1)"],
        "diverged": ["result_output (draft, round 1)"],
    }


def test_gap_reads_both_manifests_and_ignores_what_is_modelled_now(tmp_path):
    ref = synth.write(tmp_path / "ref.npz", SPEC)
    modelled_now = [modelled.KEY_EMBEDDING_SCALE, modelled.KEY_SLIDING_WINDOW, "fc.scale"]
    run = synth.write(tmp_path / "run.npz", SPEC, side="run", models=_models([ATTN_SCALE, *modelled_now], [UNKNOWN]))
    with read_dump(ref) as r, read_dump(run) as u:
        gap = gap_of(r.manifest, u.manifest)
        assert gap is not None and gap.draft == (ATTN_SCALE,) and gap.target == (UNKNOWN,)
        assert gap.depends("target", "verify", names.RESULT_OUTPUT)  # a target feature reaches everything
        assert gap_of(r.manifest, r.manifest) is None


# --- compare, end to end ------------------------------------------------------------------------


def test_a_difference_after_the_first_read_is_no_error_but_one_info_finding(synth_ref, synth_run):
    """The run's drafter logits differ (what the feature does): without the manifest entry compare
    blames the wiring; with it, exit 0, one `unmodelled` finding, and the verdict says what it skipped."""
    blamed = compare_dumps(synth_ref, synth_run(mutate=_scaled(names.RESULT_OUTPUT)))
    assert exit_code(blamed) == 1
    c = compare_dumps(synth_ref, synth_run(mutate=_scaled(names.RESULT_OUTPUT), models=_models([ATTN_SCALE])))
    assert [f.kind for f in c.findings if f.severity == "error"] == []
    assert exit_code(c) == 0
    (f,) = [f for f in c.findings if f.kind == "unmodelled"]
    assert f.fields["diverged"] and all(n.startswith(names.RESULT_OUTPUT) for n in f.fields["not_judged"])
    assert "no verdict on" in verdict(c) and ATTN_SCALE in verdict(c)


def test_a_fault_before_the_first_read_is_still_an_error(synth_ref, synth_run):
    c = compare_dumps(synth_ref, synth_run(mutate=_scaled(names.INP_NOISE_EMBD), models=_models([ATTN_SCALE])))
    errors = [f for f in c.findings if f.severity == "error"]
    assert exit_code(c) == 1 and [(f.kind, f.tensor) for f in errors][:1] == [("scale", names.INP_NOISE_EMBD)]
    assert any(f.kind == "unmodelled" for f in c.findings)


def test_an_unknown_feature_sets_aside_the_fused_features_on(synth_ref, synth_run):
    c = compare_dumps(synth_ref, synth_run(mutate=_scaled(names.INP_G_EMBEDDINGS), models=_models([UNKNOWN])))
    assert exit_code(c) == 0
    (f,) = [f for f in c.findings if f.kind == "unmodelled"]
    assert any(n.startswith(names.INP_G_EMBEDDINGS) for n in f.fields["diverged"])


def test_the_target_side_is_still_judged(synth_ref, synth_run):
    def fault(ev, name, a):  # a target layer's output, read by the drafter as a feature
        return a + 1.0 if (ev.role, name) == ("target", "l_out-3") else a

    c = compare_dumps(synth_ref, synth_run(mutate=fault, models=_models([ATTN_SCALE])))
    assert exit_code(c) == 1
    assert any(f.severity == "error" and f.tensor.startswith("l_out-") for f in c.findings)
