"""MoE routing near-ties (issue 24, item 3): a target layer that differs only on rows where the
reference's router had a near-tie between experts is `expert_choice` information, with its
evidence, not a wiring fault; a wiring fault beside it is still named. Synthetic dumps
(tests/synth.py's flow) whose reference carries the router margins a transformers MoE target
records (`l_out-<il>@router_margin`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from featdiff.core import names
from featdiff.diff import compare_dumps, exit_code
from featdiff.diff.detectors import Evidence, detect_expert_choice
from featdiff.diff.tolerance import Tolerance
from featdiff.dump.manifest import Manifest
from featdiff.dump.records import record_key
from featdiff.dump.writer import DumpWriter, record_from_array

import synth
from findings_schema import validate_findings, written

REF_MODELS = {"draft": {"target_layers": [2, 4]}, "target": {"n_embd": 16}}
TIE_LAYER, TIE_ROW = 1, 3  # the prefill row whose router had a near-tie at layer 1
WIDE_MARGIN = 1.0  # every other row's margin: far above any noise bound (router logits rms 1)
SHIFT = 0.5  # the other expert's output on that row, relative to the row (far beyond tolerance)
NOISE = 1e-7  # below every tolerance (tests/compare/conftest.py SYNTH_NOISE)


def _margin_name(il: int) -> str:
    return names.candidate_name(names.layer_name(names.L_OUT, il), names.HYP_ROUTER_MARGIN)


def _margins(n_rows: int, il: int, eval_id: int, tie: float) -> np.ndarray:
    """(n_rows, 2): router margin and rms per row; `tie` at the near-tie row of the prefill."""
    m = np.stack([np.full(n_rows, WIDE_MARGIN), np.ones(n_rows)], axis=1)  # (n_rows, 2)
    if eval_id == 0 and il == TIE_LAYER:
        m[TIE_ROW, 0] = tie
    return m.astype(np.float32)


def _write_ref(path: Path, spec: synth.Spec, tie: float) -> Path:
    """synth.write's reference, plus each target eval's router margins."""
    evals, rounds = synth.flow(spec)
    writer = DumpWriter(path)
    for ev, recs, _ in evals:
        if ev.role == "target":
            recs = recs + [(_margin_name(il), _margins(ev.n_tokens, il, ev.eval, tie)) for il in range(spec.n_layer)]
        for name, arr in recs:
            rec, stored = record_from_array(
                record_key(ev.eval, ev.role, name, 0), ev.role, ev.phase, ev.eval, name, 0, arr
            )
            op, srcs = synth._node(name)
            writer.add(replace(rec, op=op, srcs=srcs), stored)
    manifest = Manifest(
        source="reference", models=REF_MODELS, build={}, evals=tuple(e for e, _, _ in evals), records=(),
        rounds=tuple(rounds), prompt_tokens=spec.prompt,
    )  # fmt: skip
    return writer.close(manifest)


def _other_expert(ev, name: str, a: np.ndarray) -> np.ndarray:
    """The run routed the near-tie row to the other expert at layer TIE_LAYER: that row of its
    l_out and of every later layer (and the features made of them) differs; nothing else does."""
    hit = ev.eval == 0 and name.startswith(names.L_OUT + "-") and int(name.split("-")[1]) >= TIE_LAYER
    hit = hit or (ev.eval == 1 and ev.phase == "inject")
    if not hit:
        return a
    a = a.copy()
    a[TIE_ROW] = a[TIE_ROW] * (1 + SHIFT) + SHIFT  # (D,)
    return a


def _run(tmp_path: Path, spec: synth.Spec | None = None) -> Path:
    spec = spec or synth.Spec()
    return synth.write(tmp_path / "run.npz", spec, side="run", mutate=_other_expert, noise=NOISE, models=REF_MODELS)


def test_expert_choice_on_a_near_tie_is_information(tmp_path):
    c = compare_dumps(_write_ref(tmp_path / "ref.npz", synth.Spec(), tie=0.0), _run(tmp_path), None)
    found = [f for f in c.findings if f.kind == "expert_choice"]
    assert [f.severity for f in found] == ["info"], [(f.kind, f.message) for f in c.findings]
    f = found[0]
    assert f.tensor == "l_out-1" and (f.fields["layer"], f.fields["rows"]) == (1, [TIE_ROW])
    assert f.fields["margins"] == [0.0] and f.fields["bounds"][0] > 0
    assert "expert choice differs at layer 1, token 3 (router margin 0" in f.message
    assert c.ok and exit_code(c) == 0, [(f.kind, f.message) for f in c.findings if f.severity == "error"]
    validate_findings(written(c.to_json()))


def test_the_same_difference_without_a_near_tie_is_an_error(tmp_path):
    c = compare_dumps(_write_ref(tmp_path / "ref.npz", synth.Spec(), tie=WIDE_MARGIN), _run(tmp_path), None)
    assert not [f for f in c.findings if f.kind == "expert_choice"]
    assert exit_code(c) == 1 and any(f.severity == "error" and f.tensor == "l_out-1" for f in c.findings)


def test_a_wiring_fault_beside_the_expert_choice_is_still_named(tmp_path):
    ref = _write_ref(tmp_path / "ref.npz", synth.Spec(), tie=0.0)
    c = compare_dumps(ref, _run(tmp_path, synth.Spec(target_layers=(3, 5))), None)
    kinds = {(f.kind, f.severity) for f in c.findings}
    assert {("expert_choice", "info"), ("layer_offset", "error")} <= kinds, kinds
    f = next(f for f in c.findings if f.kind == "layer_offset")
    assert (f.tensor, f.fields["slot"], f.fields["delta"]) == (names.INP_TARGET_FEATURES, 0, 1)
    assert exit_code(c) == 1


# --- the detector alone --------------------------------------------------------------------------

TOL = Tolerance(1e-3, ("test",))


def _evidence(margin: np.ndarray, bad_rows: list[int]) -> Evidence:
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((6, 8)).astype(np.float32)  # (R, D)
    run = ref.copy()
    run[bad_rows] += 1.0
    rms = np.ones(len(margin), dtype=np.float32)
    cands = {_margin_name(2): np.stack([margin, rms], axis=1)}  # (R, 2)
    return Evidence(tensor="l_out-2", record="l_out-2", ref=ref, run=run, tolerance=TOL,
                    positions=tuple(range(10, 16)), candidates=cands)  # fmt: skip


def test_detector_names_the_near_tie_rows():
    margin = np.array([1.0, 1e-5, 1.0, 0.0, 1.0, 1.0], dtype=np.float32)
    f = detect_expert_choice(_evidence(margin, [1, 3]))
    assert f is not None and f.severity == "info" and f.kind == "expert_choice"
    assert (f.fields["layer"], f.fields["rows"]) == (2, [11, 13])


def test_detector_refuses_a_differing_row_with_a_clear_margin():
    margin = np.array([1.0, 1e-5, 1.0, 0.0, 1.0, 1.0], dtype=np.float32)
    assert detect_expert_choice(_evidence(margin, [1, 2])) is None  # row 2 routed clearly
    assert detect_expert_choice(_evidence(margin, [])) is None  # nothing differs


def test_detector_needs_the_margin_record():
    ev = _evidence(np.zeros(6, dtype=np.float32), [1])
    assert detect_expert_choice(replace(ev, candidates={})) is None
