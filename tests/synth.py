"""Synthetic dumps that follow docs/flow.md: a prefill, its inject, then rounds of draft, verify,
inject, with a toy residual stack standing in for the models. The reference side carries the
reference-only records (`layer_inp-<L>`, `@` candidates); with `log_snr` both sides carry the
log-SNR term and sum under the graph's names (`old_log_snr_names`: the reference layout before
docs/records.md, `inp_noise_embd` holding the sum and `log_snr_embed` the term). The run side can
be perturbed record by record to plant one fault.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from featdiff.dump.manifest import Manifest
from featdiff.dump.records import Eval, Round, record_key
from featdiff.dump.writer import DumpWriter, record_from_array


@dataclass(frozen=True)
class Spec:
    n_layer: int = 6
    n_embd: int = 16
    n_head_kv: int = 2
    target_layers: tuple[int, ...] = (2, 4)
    block_size: int = 4
    prompt: tuple[int, ...] = (5, 9, 2, 7, 3, 8, 1, 6)
    rounds: int = 2
    log_snr: bool = False
    old_log_snr_names: bool = False
    seed: int = 0


Mutation = Callable[[Eval, str, np.ndarray], np.ndarray]
MASK = 99


@dataclass(frozen=True)
class Weights:
    emb: np.ndarray  # (vocab, n_embd)
    pos: np.ndarray  # (n_pos, n_embd)
    layers: np.ndarray  # (n_layer, n_embd, n_embd)
    fc: np.ndarray  # (k * n_embd, n_embd)
    wk: np.ndarray  # (n_embd, n_embd)
    draft_emb: np.ndarray
    target_emb_for_draft: np.ndarray
    snr: np.ndarray  # (2, n_embd): anchor row, mask row


def weights(spec: Spec) -> Weights:
    rng = np.random.default_rng(spec.seed)
    n, k = spec.n_embd, len(spec.target_layers)

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)).astype(np.float32)

    return Weights(
        emb=rng.standard_normal((128, n)).astype(np.float32),
        pos=0.3 * rng.standard_normal((512, n)).astype(np.float32),
        layers=mat(spec.n_layer, n, n),
        fc=mat(k * n, n),
        wk=mat(n, n),
        draft_emb=rng.standard_normal((128, n)).astype(np.float32),
        target_emb_for_draft=rng.standard_normal((128, n)).astype(np.float32),
        snr=rng.standard_normal((2, n)).astype(np.float32),
    )


def layer_inputs(w: Weights, tokens: list[int], positions: list[int]) -> list[np.ndarray]:
    """Input of every target layer 0..n_layer for these rows: n_layer + 1 arrays (T, n_embd)."""
    h = w.emb[tokens] + w.pos[positions]  # (T, n_embd)
    out = [h]
    for W in w.layers:
        h = h + 0.5 * np.tanh(h @ W)  # (T, n_embd)
        out.append(h.astype(np.float32))
    return out


def _inject_records(spec: Spec, w: Weights, inputs: list[np.ndarray], ref: bool) -> list[tuple[str, np.ndarray]]:
    feats = np.concatenate([inputs[L] for L in spec.target_layers], axis=1)  # (T, k * n_embd)
    g = _norm(feats @ w.fc)  # (T, n_embd)
    T = feats.shape[0]
    k = (g @ w.wk).reshape(T, spec.n_head_kv, -1)  # (T, n_head_kv, head_dim)
    recs = [("inp_target_features", feats), ("inp_g_embeddings", g), ("Kcur_injected-0", k)]
    if ref:
        n = spec.n_embd
        swapped = np.concatenate([feats[:, n : 2 * n], feats[:, :n], feats[:, 2 * n :]], axis=1)  # (T, k * n_embd)
        recs.append(("inp_g_embeddings@slots=1,0", _norm(swapped @ w.fc)))
    return recs


def _norm(x: np.ndarray) -> np.ndarray:
    return (x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-6)).astype(np.float32)


def _draft_records(spec: Spec, w: Weights, block: list[int], ref: bool) -> list[tuple[str, np.ndarray]]:
    snr = np.stack([w.snr[0] if i == 0 else w.snr[1] for i in range(len(block))]).astype(np.float32)  # (B, n_embd)
    rows = w.draft_emb[block]  # (B, n_embd)
    x = rows + snr if spec.log_snr else rows  # (B, n_embd): what the first layer reads
    old = spec.log_snr and spec.old_log_snr_names
    recs = [("inp_noise_embd", x if old else rows)]
    if spec.log_snr and not old:
        recs += [("dspark_log_snr_fc2", snr), ("dspark_draft_embd_snr", x)]
    recs.append(("result_output", np.tanh(x @ w.wk).astype(np.float32)))
    if ref:
        borrowed = w.target_emb_for_draft[block]  # (B, n_embd)
        recs.append(("inp_noise_embd@table=target", borrowed + snr if old else borrowed))
        if old:
            recs.append(("log_snr_embed", snr))
    return recs


def _target_records(spec: Spec, inputs: list[np.ndarray], ref: bool) -> list[tuple[str, np.ndarray]]:
    recs = [(f"l_out-{il}", inputs[il + 1]) for il in range(spec.n_layer)]
    if ref:
        recs += [(f"layer_inp-{L}", inputs[L]) for L in range(spec.n_layer)]
    return recs


def flow(
    spec: Spec,
) -> tuple[list[tuple[Eval, list[tuple[str, np.ndarray]], list[tuple[str, np.ndarray]]]], list[Round]]:
    """Every eval with its (ref records, run records), and the rounds."""
    w = weights(spec)
    P = list(spec.prompt)
    out, rounds = [], []
    pos = list(range(len(P) - 1))
    inputs = layer_inputs(w, P[:-1], pos)
    out.append(
        (
            Eval(0, "target", "prefill", len(pos), tuple(pos), tuple(P[:-1]), (0,) * len(pos), 0),
            _target_records(spec, inputs, True),
            _target_records(spec, inputs, False),
        )
    )
    out.append(
        (
            Eval(1, "draft", "inject", len(pos), tuple(pos), (), (0,) * len(pos), 0),
            _inject_records(spec, w, inputs, True),
            _inject_records(spec, w, inputs, False),
        )
    )
    n_past, anchor = len(P) - 1, P[-1]
    for r in range(1, spec.rounds + 1):
        B = spec.block_size
        pos = list(range(n_past, n_past + B))
        block = [anchor] + [MASK] * (B - 1)
        drafts = [(anchor * 7 + i + r) % 50 + 10 for i in range(B - 1)]
        e = len(out)
        out.append(
            (
                Eval(e, "draft", "draft", B, tuple(pos), tuple(block), (0,) * B, r),
                _draft_records(spec, w, block, True),
                _draft_records(spec, w, block, False),
            )
        )
        verify = [anchor] + drafts
        inputs = layer_inputs(w, verify, pos)
        out.append(
            (
                Eval(e + 1, "target", "verify", B, tuple(pos), tuple(verify), (0,) * B, r),
                _target_records(spec, inputs, True),
                _target_records(spec, inputs, False),
            )
        )
        out.append(
            (
                Eval(e + 2, "draft", "inject", B, tuple(pos), (), (0,) * B, r),
                _inject_records(spec, w, inputs, True),
                _inject_records(spec, w, inputs, False),
            )
        )
        rounds.append(Round(r, n_past, anchor, tuple(drafts), 1, (drafts[0], 42)))
        n_past, anchor = n_past + 2, 42
    return out, rounds


# What a capture records as op and sources (tests/llama golden: the real graphs).
NODES = {
    "inp_target_features": ("NONE", ()),
    "inp_g_embeddings": ("MUL", ("norm", "enc.output_norm.weight")),
    "Kcur_injected-0": ("ROPE", ("node_6", "inp_pos")),
    "inp_noise_embd": ("GET_ROWS", ("token_embd.weight", "leaf_2")),
    "dspark_log_snr_fc2": ("ADD", ("node_3", "log_snr_fc2.bias")),
    "dspark_draft_embd_snr": ("ADD", ("inp_noise_embd", "dspark_log_snr_fc2")),
    "result_output": ("MUL_MAT", ("output.weight", "result_norm")),
}


def _node(name: str) -> tuple[str, tuple[str, ...]]:
    if name.startswith("l_out-"):
        il = name.split("-")[1]
        return "ADD", (f"ffn_out-{il}", f"ffn_inp-{il}")
    return NODES.get(name, ("NONE", ()))


def write(
    path: Path,
    spec: Spec = Spec(),
    side: str = "ref",
    mutate: Mutation | None = None,
    noise: float = 0.0,
    models: dict | None = None,
    build: dict | None = None,
    drop: Callable[[Eval, str], bool] | None = None,
) -> Path:
    """Write the ref or run side of the synthetic flow; `mutate` rewrites run arrays."""
    evals, rounds = flow(spec)
    rng = np.random.default_rng(1234)
    writer = DumpWriter(Path(path))
    for ev, ref_recs, run_recs in evals:
        for name, arr in ref_recs if side == "ref" else run_recs:
            if drop is not None and drop(ev, name):
                continue
            if side == "run":
                arr = (
                    arr + noise * rng.standard_normal(arr.shape).astype(np.float32) * np.abs(arr).mean()
                    if noise
                    else arr
                )
                arr = mutate(ev, name, arr) if mutate else arr
            rec, stored = record_from_array(
                record_key(ev.eval, ev.role, name, 0),
                ev.role,
                ev.phase,
                ev.eval,
                name,
                0,
                np.asarray(arr, dtype=np.float32),
            )
            op, srcs = _node(name)
            writer.add(replace(rec, op=op, srcs=srcs), stored)
    m = (
        models
        if models is not None
        else {"draft": {"target_layers": list(spec.target_layers)}, "target": {"n_embd": spec.n_embd}}
    )
    manifest = Manifest(
        source="reference" if side == "ref" else "llama.cpp",
        models=m,
        build=build or {},
        evals=tuple(e for e, _, _ in evals),
        records=(),
        rounds=tuple(rounds),
        prompt_tokens=spec.prompt,
    )
    return writer.close(manifest)
