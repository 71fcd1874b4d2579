"""Measure the numeric noise between real captures and references of correctly wired fixtures:
the figures behind the constants in src/featdiff/compare/tolerance.py.

    .venv/bin/python bench/calibrate_compare.py [--work DIR]

For each clean variant (f32, and with a Q8_0 target) and a few prompts it captures through the
real llama.cpp build, computes the reference, compares, and prints per class of tensor the worst
pair relative error (sqrt NMSE), the worst row relative error, and the worst row / pair ratio.
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
sys.path.insert(0, str(ROOT / "tests" / "compare"))

from featdiff.compare import compare_dumps  # noqa: E402
from featdiff.compare.tolerance import PRE_ATTENTION  # noqa: E402
from featdiff.fixtures import write_fixture  # noqa: E402
from featdiff.llama.capture import capture  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="featdiff-calib-"))
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
