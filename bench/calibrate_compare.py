"""Measure the numeric noise between real captures and references of correctly wired fixtures:
the figures behind the constants in src/featdiff/compare/tolerance.py.

    .venv/bin/python bench/calibrate_compare.py [--work DIR]
    .venv/bin/python bench/calibrate_compare.py --deep [--work DIR]

For each clean variant (f32, and with a Q8_0 target) and a few prompts it captures through the
real llama.cpp build, computes the reference, compares, and prints per class of tensor the worst
pair relative error (sqrt NMSE), the worst row relative error, and the worst row / pair ratio.

`--deep`: a 28-layer target (width 256, so the k-quants fit), its weights stored by the tools'
`llama-quantize` as f16, bf16, q8_0, q4_k (Q4_K_S) and q1_0, each captured in-process and compared
against two references that follow the run: one on the f32 weights (what the run's weight type
costs), one on the very file the run loaded (dequantized by the same build's ggml: what is left
when the weights are the same, the activations the CPU kernels round for the dot product).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/quantize.py

from featdiff.compare import compare_dumps  # noqa: E402
from featdiff.compare.tolerance import PRE_ATTENTION  # noqa: E402
from featdiff.fixtures import write_fixture  # noqa: E402
from featdiff.llama.binding import find_build  # noqa: E402
from featdiff.llama.capture import capture  # noqa: E402
from featdiff.llama.tools import ensure_tools  # noqa: E402
from featdiff.pairs import Shape, Sizes  # noqa: E402
from featdiff.reference.run import reference  # noqa: E402

from quantize import quantize_gguf  # noqa: E402

VARIANTS = ("clean", "own-embd", "llama")
PROMPT_LENGTHS = (10, 33)
ROUNDS = 3


def prompts() -> list[str]:
    rng = np.random.default_rng(7)
    return [",".join(str(int(t)) for t in rng.integers(1, 500, n)) for n in PROMPT_LENGTHS]


def run_case(work: Path, variant: str, tokens: str, quantized: bool, i: int) -> list:
    fx = write_fixture(work / variant, variant)
    target = fx / "target.gguf"
    if quantized:
        target = quantize_gguf(target, fx / "target-q8_0.gguf")
    run = capture(target, fx / "draft.gguf", work / f"{variant}-{i}-{quantized}.run.npz", tokens=tokens, rounds=ROUNDS)
    ref = reference(
        fx / "target.gguf",
        fx / "draft-hf",
        work / f"{variant}-{i}.ref.npz",
        prompt=None,
        tokens=tokens,
        rounds=ROUNDS,
        dtype="float32",
        device="cpu",
        kv_dtype="f16",
        llama_dir=None,
    )
    c = compare_dumps(ref, run, None)
    return list(c.pairs)


# --deep: a target as deep as the pairs users debug (Qwen3-8B has 36 layers; >= 28 asked), wide
# enough for the k-quants' 256-wide blocks, with the tiny drafter's layout
DEEP = Sizes(
    target=Shape(n_layer=28, n_embd=256, n_head=4, n_head_kv=2, n_embd_head=64, n_ff=512),
    draft=Shape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_embd_head=64, n_ff=512),
)
DEEP_TYPES = {
    "f16": "F16",
    "bf16": "BF16",
    "q8_0": "Q8_0",
    "q4_k": "Q4_K_S",
    "q1_0": "Q1_0",
}  # label -> llama-quantize's


def deep(work: Path) -> None:
    import subprocess

    fx = write_fixture(work / "deep", "clean", sizes=DEEP)
    quantize = ensure_tools().program("llama-quantize")
    build = find_build(None).root  # the capture's own library: its ggml dequantizes the same file
    rows: list[tuple[str, str, float, float, str]] = []
    for label, ftype in DEEP_TYPES.items():
        target = fx / f"target-{label}.gguf"
        if not target.is_file():
            subprocess.run(
                [str(quantize), str(fx / "target.gguf"), str(target), ftype], check=True, capture_output=True
            )
        for i, tokens in enumerate(prompts()):
            run = capture(target, fx / "draft.gguf", work / f"deep-{label}-{i}.run.npz", tokens=tokens, rounds=ROUNDS)
            for weights, ref_target in (("f32 weights", fx / "target.gguf"), ("same file", target)):
                slug = weights.replace(" ", "-")
                ref = reference(ref_target, fx / "draft-hf", work / f"deep-{label}-{i}-{slug}.ref.npz",
                                prompt=None, tokens=None, rounds=0, dtype="float32", device="cpu", kv_dtype="f16",
                                llama_dir=build, follow=run)  # fmt: skip
                for p in compare_dumps(ref, run, None).pairs:
                    where = "pre-attention" if p.name in PRE_ATTENTION else "post-attention"
                    rows.append((f"{label:5s} {weights:11s} {where}", p.name, math.sqrt(p.nmse), p.rel_p99, p.role))
    print(f"{'weights, reference, class':42s} {'worst pair rel':>15s}  worst tensor")
    for cls in sorted({r[0] for r in rows}):
        worst = max((r for r in rows if r[0] == cls), key=lambda r: r[2])
        print(f"{cls:42s} {worst[2]:15.3g}  {worst[4]} {worst[1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--deep", action="store_true", help="the 28-layer target in f16, bf16, q8_0, q4_k and q1_0")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="featdiff-calib-"))
    if args.deep:
        deep(work)
        return
    stats: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for quantized in (False, True):
        for variant in VARIANTS:
            for i, tokens in enumerate(prompts()):
                for p in run_case(work, variant, tokens, quantized, i):
                    cls = ("q8_0 " if quantized else "f32  ") + (
                        "pre-attention" if p.name in PRE_ATTENTION else "post-attention"
                    )
                    stats[(cls, p.name)].append((math.sqrt(p.nmse), max(p.row_rel_err, default=0.0)))
    by_class: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for (cls, name), vals in stats.items():
        by_class[cls] += [(pair, row, name) for pair, row in vals]
    print(f"{'class':26s} {'worst pair rel':>15s} {'worst row rel':>14s} {'row/pair':>9s}  worst tensor")
    for cls in sorted(by_class):
        vals = by_class[cls]
        pair, _, name = max(vals)
        row = max(v[1] for v in vals)
        ratio = max((r / p if p > 0 else 0.0) for p, r, _ in vals)
        print(f"{cls:26s} {pair:15.3g} {row:14.3g} {ratio:9.3g}  {name}")


if __name__ == "__main__":
    main()
