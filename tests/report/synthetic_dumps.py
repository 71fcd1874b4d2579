"""Synthetic ref/run dump pairs shaped like the DFlash flow (docs/flow.md), with one planted
wiring bug, and a Comparison measured by hand: what bench/bench_report.py times. The tests draw
from tests/synth.py and render compare's own findings (tests/report/conftest.py); the findings
here are written by hand, so no test should render them.

The target's residual stream is a random walk, so neighbouring layer inputs are alike but only
the right one matches exactly, as in a real model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from featdiff import names
from featdiff.compare.result import Alignment, Comparison, Finding, PairMetrics
from featdiff.dump import DumpWriter, Eval, Manifest, Record, record_from_array, record_key

TARGET_LAYERS = (2, 4)  # GGUF ids: the input of layer L
BLOCK_SIZE = 4
N_VOCAB = 64
TOLERANCE = 1e-6  # nmse: the planted run noise is 1e-7 relative, so a clean record sits near 1e-14
ROW_TOLERANCE = 1e-3  # on each row's relative error
RUN_NOISE = 1e-7


@dataclass(frozen=True)
class Shape:
    n_layer: int = 6
    n_embd: int = 32
    n_prompt: int = 12
    rounds: int = 2


@dataclass(frozen=True)
class Fault:
    """What the run gets wrong: a layer offset of every slot, or a row shift of the noise block."""

    layer_delta: int = 0
    noise_row_shift: int = 0


FAULTS = {"clean": Fault(), "layers-plus1": Fault(layer_delta=1), "row-shift": Fault(noise_row_shift=1)}


def write_pair(directory: Path, variant: str = "clean", shape: Shape = Shape(), seed: int = 0) -> tuple[Path, Path]:
    """Write `ref.npz` and `run.npz` of one variant into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    fault = FAULTS[variant]
    ref = _write_side(directory / "ref.npz", "reference", shape, Fault(), seed)
    run = _write_side(directory / "run.npz", "llama.cpp", shape, fault, seed)
    return ref, run


def _write_side(path: Path, source: str, shape: Shape, fault: Fault, seed: int) -> Path:
    weights = _weights(np.random.default_rng(seed), shape)
    noise = np.random.default_rng(seed + 1) if source == "llama.cpp" else None
    writer = DumpWriter(path)
    evals: list[Eval] = []
    layers = tuple(L + fault.layer_delta for L in TARGET_LAYERS)
    n_past = shape.n_prompt - 1
    _target_eval(writer, evals, source, "prefill", 0, list(range(n_past)), weights, noise)
    _inject_eval(writer, evals, 0, list(range(n_past)), layers, weights, noise)
    for r in range(1, shape.rounds + 1):
        positions = list(range(n_past, n_past + BLOCK_SIZE))
        _draft_eval(writer, evals, r, positions, weights, noise, fault)
        _target_eval(writer, evals, source, "verify", r, positions, weights, noise)
        _inject_eval(writer, evals, r, positions, layers, weights, noise)
        n_past += BLOCK_SIZE
    models = {
        "target": {"path": "target.gguf", "architecture": "qwen3", "n_layer": shape.n_layer},
        "draft": {
            "path": "draft.gguf",
            "architecture": "dflash",
            "target_layers": list(layers),
            "block_size": BLOCK_SIZE,
        },
    }
    return writer.close(
        Manifest(source=source, models=models, build={"synthetic": True}, evals=tuple(evals), records=())
    )


def _weights(rng: np.random.Generator, shape: Shape) -> dict:
    e, n_pos = shape.n_embd, shape.n_prompt + shape.rounds * BLOCK_SIZE
    return {
        "n_layer": shape.n_layer,
        "n_embd": e,
        "fc": rng.standard_normal((len(TARGET_LAYERS) * e, e)) / np.sqrt(2 * e),
        "wk": rng.standard_normal((e, e)) / np.sqrt(e),
        "out": rng.standard_normal((e, N_VOCAB)) / np.sqrt(e),
        "steps": rng.standard_normal((shape.n_layer, n_pos, e)) * 0.9,
        "embd": rng.standard_normal((n_pos, e)),
    }


def _residual_stream(w: dict, positions: list[int]) -> list[np.ndarray]:
    """layer_inp-L for L = 0..n_layer-1, each (n_tokens, n_embd): a random walk over layers."""
    x = w["embd"][positions]  # (n_tokens, n_embd)
    stream = [x]
    for L in range(1, w["n_layer"]):
        x = x + w["steps"][L][positions]  # (n_tokens, n_embd)
        stream.append(x)
    return stream


def _add(
    writer: DumpWriter,
    ev: int,
    role: str,
    phase: str,
    name: str,
    array: np.ndarray,
    noise: np.random.Generator | None,
    occurrence: int = 0,
) -> None:
    if noise is not None:
        array = array * (1 + RUN_NOISE * noise.standard_normal(array.shape))
    record, stored = record_from_array(record_key(ev, role, name, occurrence), role, phase, ev, name, occurrence, array)
    writer.add(record, stored)


def _target_eval(writer, evals, source, phase, round_, positions, w, noise) -> None:
    ev = len(evals)
    evals.append(
        Eval(ev, "target", phase, len(positions), tuple(positions), tuple(positions), (0,) * len(positions), round_)
    )
    stream = _residual_stream(w, positions)
    for L, x in enumerate(stream):
        if source == "reference":
            _add(writer, ev, "target", phase, names.layer_name(names.LAYER_INP, L), x, None)
        if L > 0:
            _add(writer, ev, "target", phase, names.layer_name(names.L_OUT, L - 1), x, noise)
    if phase == "verify":
        _add(writer, ev, "target", phase, names.RESULT_OUTPUT, stream[-1] @ w["out"], noise)


def _inject_eval(writer, evals, round_, positions, layers, w, noise) -> None:
    ev = len(evals)
    evals.append(Eval(ev, "draft", "inject", len(positions), tuple(positions), (), (0,) * len(positions), round_))
    stream = _residual_stream(w, positions)
    features = np.concatenate([stream[L] for L in layers], axis=1)  # (n_tokens, n_extract * n_embd)
    g = features @ w["fc"]  # (n_tokens, n_embd)
    _add(writer, ev, "draft", "inject", names.INP_TARGET_FEATURES, features, noise)
    _add(writer, ev, "draft", "inject", names.INP_G_EMBEDDINGS, g, noise)
    for il in range(2):
        _add(writer, ev, "draft", "inject", names.layer_name(names.KCUR_INJECTED, il), g @ w["wk"], noise)


def _draft_eval(writer, evals, round_, positions, w, noise, fault: Fault) -> None:
    ev = len(evals)
    evals.append(
        Eval(ev, "draft", "draft", len(positions), tuple(positions), tuple(positions), (0,) * len(positions), round_)
    )
    embd = w["embd"][positions] * 0.5  # (B, n_embd)
    embd = np.roll(embd, -fault.noise_row_shift, axis=0)  # run row i = ref row i + shift
    _add(writer, ev, "draft", "draft", names.INP_NOISE_EMBD, embd, noise)
    x = embd
    for il in range(2):
        x = np.tanh(x @ w["wk"] + x)  # (B, n_embd)
        _add(writer, ev, "draft", "draft", names.layer_name(names.L_OUT, il), x, noise)
    _add(writer, ev, "draft", "draft", names.RESULT_NORM, x, noise)
    _add(writer, ev, "draft", "draft", names.RESULT_OUTPUT, x @ w["out"], noise)


# --- a comparison measured by hand ------------------------------------------------------------


def compare_by_hand(ref_path: Path, run_path: Path, findings: tuple[Finding, ...] = ()) -> Comparison:
    """Pair each run record with the ref record of the same eval, role, name and occurrence."""
    from featdiff.dump import read_dump

    pairs, alignments = [], []
    with read_dump(ref_path) as ref, read_dump(run_path) as run:
        ref_by = {(r.eval, r.role, r.name, r.occurrence): r for r in ref.records()}
        evals = {e.eval: e for e in run.manifest.evals}
        for rec in run.records():
            ref_rec = ref_by.get((rec.eval, rec.role, rec.name, rec.occurrence))
            if ref_rec is None:
                continue
            ev = evals[rec.eval]
            pairs.append(_metrics(rec, ref.array(ref_rec), run.array(rec), ev.positions, ev.round))
            rows = tuple(range(len(ev.positions)))  # both sides hold the same positions, in order
            alignments.append(
                Alignment(ref_key=ref_rec.key, run_key=rec.key, rows=rows, run_rows=rows, positions=ev.positions)
            )
    first = next((i for i, p in enumerate(pairs) if not p.within), None)
    return Comparison(str(ref_path), str(run_path), findings, tuple(pairs), tuple(alignments), first)


def _metrics(rec: Record, ref: np.ndarray, run: np.ndarray, positions: tuple[int, ...], round_: int) -> PairMetrics:
    ref2, run2 = ref.reshape(len(ref), -1).astype(np.float64), run.reshape(len(run), -1).astype(np.float64)
    diff = run2 - ref2
    ref_norm = np.linalg.norm(ref2, axis=1)
    rel = np.linalg.norm(diff, axis=1) / np.where(ref_norm > 0, ref_norm, 1)
    cos = np.sum(run2 * ref2, axis=1) / np.maximum(ref_norm * np.linalg.norm(run2, axis=1), 1e-30)
    nmse = float(np.sum(diff**2) / max(np.sum(ref2**2), 1e-30))
    return PairMetrics(
        role=rec.role,
        phase=rec.phase,
        eval=rec.eval,
        name=rec.name,
        occurrence=rec.occurrence,
        max_abs=float(np.abs(diff).max()),
        nmse=nmse,
        cos_min=float(cos.min()),
        cos_median=float(np.median(cos)),
        rel_p50=float(np.percentile(rel, 50)),
        rel_p99=float(np.percentile(rel, 99)),
        tolerance=TOLERANCE,
        within=nmse <= TOLERANCE and rel.max() <= ROW_TOLERANCE,
        round=round_,
        row_tolerance=ROW_TOLERANCE,
        row_rel_err=tuple(float(v) for v in rel),
        positions=positions if len(positions) == len(rel) else (),
    )


def planted_findings(variant: str) -> tuple[Finding, ...]:
    """The findings compare should make of a variant, as docs/findings.md's vocabulary writes them."""
    if variant == "layers-plus1":
        return tuple(
            Finding(
                "layer_offset",
                names.INP_TARGET_FEATURES,
                "error",
                f"slot {k} of inp_target_features is the input of target layer {L + 1}; "
                f"the checkpoint expects layer {L}",
                {"slot": k, "expected_layer": L, "observed_layer": L + 1, "delta": 1},
            )
            for k, L in enumerate(TARGET_LAYERS)
        )
    if variant == "row-shift":
        return (
            Finding(
                "row_shift",
                names.INP_NOISE_EMBD,
                "error",
                "rows of inp_noise_embd are shifted by one: run row i is ref row i + 1",
                {"shift": 1},
            ),
        )
    return ()
