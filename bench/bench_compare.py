"""How fast compare is, against the least any comparison must do.

    .venv/bin/python bench/bench_compare.py [--n-layer 16 --n-embd 1024 --n-tokens 512]
                                            [--search-layers 64 --search-embd 4096 --search-tokens 2048]

1. Throughput: writes a synthetic ref/run dump pair of the flow's shape (a prefill with every
   `l_out-<il>` and the reference's `layer_inp-<L>`, an inject with the features), then times
   `compare_dumps` and one plain numpy pass over the same two dumps (np.load every paired array,
   one subtraction), in the same process, best of a few runs each. Goal: ratio <= 3.
2. Layer-match search at scale: the slot x layer matrix of the injected features against every
   `layer_inp-<L>` (default 64 layers x 4096 wide x 2048 tokens). Goal: seconds.
Pass --search-layers 0 to skip part 2 (it writes ~2 GB of dump to --work).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from featdiff.diff import compare_dumps, layer_match_matrix
from featdiff.dump.manifest import Manifest
from featdiff.dump.records import Eval, record_key
from featdiff.dump.writer import DumpWriter, record_from_array

TARGET_LAYERS = (2, 4)
NOISE = 1e-7  # far below every tolerance: a clean run
REPEATS = 3


def write_pair(work: Path, n_layer: int, n_embd: int, n_tokens: int, all_l_out: bool = True) -> tuple[Path, Path]:
    """A ref and a run dump: a prefill (l_out-*, ref: layer_inp-*) and its inject (features)."""
    rng = np.random.default_rng(0)
    layers = [0, *(L for L in TARGET_LAYERS if L < n_layer)] if not all_l_out else list(range(n_layer))
    positions = tuple(range(n_tokens))
    evals = (
        Eval(0, "target", "prefill", n_tokens, positions, tuple(p % 500 for p in positions), (0,) * n_tokens),
        Eval(1, "draft", "inject", n_tokens, positions, (), (0,) * n_tokens),
    )
    ref_w, run_w = DumpWriter(work / "ref.npz"), DumpWriter(work / "run.npz")
    h = rng.standard_normal((n_tokens, n_embd), dtype=np.float32)
    slots = {}
    for L in range(n_layer):
        if L in TARGET_LAYERS:
            slots[L] = h
        _add(ref_w, 0, "target", "prefill", f"layer_inp-{L}", h)
        h = h + 0.3 * rng.standard_normal((n_tokens, n_embd), dtype=np.float32)
        if L in layers:
            _add(ref_w, 0, "target", "prefill", f"l_out-{L}", h)
            _add(
                run_w, 0, "target", "prefill", f"l_out-{L}", h + NOISE * rng.standard_normal(h.shape, dtype=np.float32)
            )
    feats = np.concatenate([slots[L] for L in TARGET_LAYERS if L in slots], axis=1)  # (n_tokens, n_extract * n_embd)
    _add(ref_w, 1, "draft", "inject", "inp_target_features", feats)
    _add(
        run_w,
        1,
        "draft",
        "inject",
        "inp_target_features",
        feats + NOISE * rng.standard_normal(feats.shape, dtype=np.float32),
    )
    models = {"draft": {"target_layers": list(TARGET_LAYERS)}, "target": {}}
    return (
        ref_w.close(Manifest("reference", models, {}, evals, ())),
        run_w.close(Manifest("llama.cpp", models, {}, evals, ())),
    )


def _add(writer: DumpWriter, eval_index: int, role: str, phase: str, name: str, a: np.ndarray) -> None:
    rec, stored = record_from_array(record_key(eval_index, role, name, 0), role, phase, eval_index, name, 0, a)
    writer.add(rec, stored)


def plain_pass(ref: Path, run: Path) -> None:
    """The floor: load every array the two dumps share and subtract once."""
    with np.load(ref) as a, np.load(run) as b:
        for key in set(a.files) & set(b.files) - {"manifest.json"}:
            _ = b[key] - a[key]


def best_of(fn, *args) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def throughput(work: Path, n_layer: int, n_embd: int, n_tokens: int) -> None:
    ref, run = write_pair(work, n_layer, n_embd, n_tokens)
    mb = (ref.stat().st_size + run.stat().st_size) / 2**20
    c = compare_dumps(ref, run, None)
    assert c.ok, [f.message for f in c.findings]
    t_plain, t_compare = best_of(plain_pass, ref, run), best_of(compare_dumps, ref, run, None)
    print(f"throughput: {n_layer} layers x {n_embd} wide x {n_tokens} tokens, dumps {mb:.0f} MiB, {len(c.pairs)} pairs")
    print(f"  plain numpy pass {t_plain:.3f} s, compare {t_compare:.3f} s, ratio {t_compare / t_plain:.2f} (goal <= 3)")


def search(work: Path, n_layer: int, n_embd: int, n_tokens: int) -> None:
    ref, run = write_pair(work, n_layer, n_embd, n_tokens, all_l_out=False)
    t0 = time.perf_counter()
    match = layer_match_matrix(ref, run)
    dt = time.perf_counter() - t0
    assert match is not None and match.closest_layers == TARGET_LAYERS
    print(
        f"layer-match search: {n_layer} layers x {n_embd} wide x {n_tokens} tokens: {dt:.2f} s "
        f"(matrix {match.rel_err.shape}, closest layers {match.closest_layers})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=16)
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--n-tokens", type=int, default=512)
    ap.add_argument("--search-layers", type=int, default=64)
    ap.add_argument("--search-embd", type=int, default=4096)
    ap.add_argument("--search-tokens", type=int, default=2048)
    ap.add_argument("--work", type=Path, default=None, help="Where to write the dumps (default: a temp dir, removed).")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="featdiff-bench-"))
    try:
        (work / "t").mkdir(parents=True, exist_ok=True)
        throughput(work / "t", args.n_layer, args.n_embd, args.n_tokens)
        if args.search_layers:
            (work / "s").mkdir(exist_ok=True)
            search(work / "s", args.search_layers, args.search_embd, args.search_tokens)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
