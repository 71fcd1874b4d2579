"""Measure the numeric noise between real captures and references of correctly wired fixtures:
the figures behind the constants in src/featdiff/diff/tolerance.py.

    .venv/bin/python bench/calibrate_compare.py [--work DIR]
    .venv/bin/python bench/calibrate_compare.py --deep [--work DIR]
    .venv/bin/python bench/calibrate_compare.py --held-out [--work DIR]

For each clean variant (f32, and with a Q8_0 target) and a few prompts it captures through the
real llama.cpp build, computes the reference, compares, and prints per class of tensor the worst
pair relative error (sqrt NMSE), the worst row relative error, and the worst row / pair ratio.

`--deep`: a 28-layer target (width 256, so the k-quants fit), its weights stored by the tools'
`llama-quantize` as f16, bf16, q8_0, q4_k (Q4_K_S) and q1_0, each captured in-process and compared
against two references that follow the run: one on the f32 weights (what the run's weight type
costs), one on the very file the run loaded (dequantized by the same build's ggml: what is left
when the weights are the same, the activations the CPU kernels round for the dot product).

`--held-out`: the KV cache figures measured on models no test uses (the tests' fixtures are all
seed 0, 16- or 32-wide heads, 6 layers, prompts of at most 33 tokens): seeds 101, 202 and 303,
heads 16, 32 and 64 wide, 6 to 24 target layers, GQA ratios 1, 2, 4 and 8 (MHA to MQA), prompts of
64 and 200 tokens over 6 rounds and of 6 tokens over 16 rounds of 3-draft blocks. Each is captured
in-process with llama.cpp's default f16 cache and, where the heads are a multiple of q8_0's 32-wide
blocks, with `-ctk q8_0 -ctv q8_0 -ctkd q8_0 -ctvd q8_0 -fa on`, against a reference that follows
the run (f32, K/V rounded to f16). Prints the worst pair and row relative error per class, then per
shape, and the cases compare judged other than clean. About 25 minutes on 2 busy cores.

`--vulkan`: the same held-out models and flows captured on ggml's Vulkan backend (the pinned tree
built with -DGGML_VULKAN=ON, `featdiff.llama.extra_builds.ensure_vulkan`) with every layer of both models
on the device (`-ngl 99 -ngld 99`, f16 cache), here Mesa's llvmpipe; against the same references.
The figures behind tolerance.py's word on device backends.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/quantize.py

from featdiff.diff import compare_dumps  # noqa: E402
from featdiff.diff.tolerance import PRE_ATTENTION  # noqa: E402
from featdiff.driver.capture import capture  # noqa: E402
from featdiff.factory.fixtures import write_fixture  # noqa: E402
from featdiff.factory.pairs import Shape, Sizes  # noqa: E402
from featdiff.llama.binding import find_build  # noqa: E402
from featdiff.llama.extra_builds import SOFTWARE_VULKAN_ENV, ensure_vulkan  # noqa: E402
from featdiff.llama.options import parse_run_options  # noqa: E402
from featdiff.llama.tools import ensure_tools  # noqa: E402
from featdiff.torchref.dflash.run import reference  # noqa: E402

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


# --held-out: (target, drafter) shapes no test uses; the drafter shares the target's width and heads
HELD_OUT_SHAPES: dict[str, tuple[Shape, Shape]] = {
    "h32 l8 gqa2": (
        Shape(n_layer=8, n_embd=128, n_head=4, n_head_kv=2, n_embd_head=32, n_ff=256),
        Shape(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_embd_head=32, n_ff=256),
    ),
    "h64 l6 gqa4": (
        Shape(n_layer=6, n_embd=256, n_head=4, n_head_kv=1, n_embd_head=64, n_ff=512),
        Shape(n_layer=3, n_embd=256, n_head=4, n_head_kv=1, n_embd_head=64, n_ff=512),
    ),
    "h32 l12 mha": (
        Shape(n_layer=12, n_embd=256, n_head=8, n_head_kv=8, n_embd_head=32, n_ff=512),
        Shape(n_layer=2, n_embd=256, n_head=8, n_head_kv=8, n_embd_head=32, n_ff=512),
    ),
    "h16 l10 mqa": (
        Shape(n_layer=10, n_embd=128, n_head=8, n_head_kv=1, n_embd_head=16, n_ff=256),
        Shape(n_layer=2, n_embd=128, n_head=8, n_head_kv=1, n_embd_head=16, n_ff=256),
    ),
    "h64 l24 gqa2": (  # depth: does the cache's error grow with the layers it passes through?
        Shape(n_layer=24, n_embd=256, n_head=4, n_head_kv=2, n_embd_head=64, n_ff=512),
        Shape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_embd_head=64, n_ff=512),
    ),
}
HELD_OUT_SEEDS = (101, 202, 303)
# (prompt tokens, rounds, drafts per block): long prompts, and a short one with many small blocks
# like the `--exec` runs of tests/llama/test_kv_types.py (a short context averages less noise out)
HELD_OUT_FLOWS = ((6, 16, 3), (64, 6, None), (200, 6, None))
Q8_0_BLOCK = 32  # q8_0 stores K/V in blocks of 32: the heads must be a multiple of it
HELD_OUT_KV = {
    "f16": ["-t", "1"],  # llama.cpp's default cache; flash attention at its default (auto)
    "q8_0": ["-ctk", "q8_0", "-ctv", "q8_0", "-ctkd", "q8_0", "-ctvd", "q8_0", "-fa", "on", "-t", "1"],
}
# --vulkan: both models wholly on the Vulkan device, llama.cpp's default f16 cache
HELD_OUT_VULKAN = {"vulkan f16": ["-ngl", "99", "-ngld", "99", "-t", "1"]}


def held_out_flows() -> list[tuple[str, int, int | None]]:
    """(tokens, rounds, drafts per block) of each held-out flow."""
    rng = np.random.default_rng(2026)  # not the tests' prompts, nor the default mode's (7)
    return [(",".join(str(int(t)) for t in rng.integers(1, 500, n)), r, b) for n, r, b in HELD_OUT_FLOWS]


def held_out(
    work: Path, only: str | None = None, kv_options: dict[str, list[str]] = HELD_OUT_KV, llama_dir: Path | None = None
) -> None:
    # (kv, class, shape, worst pair rel, worst row rel, tensor, case) per pair
    rows: list[tuple[str, str, str, float, float, str, str]] = []
    verdicts: list[str] = []
    for si, (shape_name, (target_shape, draft_shape)) in enumerate(HELD_OUT_SHAPES.items()):
        if only and only not in shape_name:
            continue
        sizes = Sizes(target=target_shape, draft=draft_shape)
        for vi, variant in enumerate(VARIANTS):
            seed = HELD_OUT_SEEDS[(si + vi) % len(HELD_OUT_SEEDS)]
            slug = f"{shape_name.replace(' ', '-')}-{variant}-{seed}"
            fx = write_fixture(work / slug, variant, seed=seed, sizes=sizes)
            for kv, extra in kv_options.items():
                if "q8_0" in kv and target_shape.n_embd_head % Q8_0_BLOCK:
                    continue
                for tokens, rounds, block in held_out_flows():
                    n = tokens.count(",") + 1
                    case = f"{slug} {kv} {n}t x{rounds}"
                    out = work / f"{slug}-{kv}-{n}"
                    run = capture(fx / "target.gguf", fx / "draft.gguf", out.with_suffix(".run.npz"), tokens=tokens,
                                  rounds=rounds, draft_max=block, options=parse_run_options(extra),
                                  llama_dir=llama_dir)  # fmt: skip
                    ref = reference(fx / "target-hf", fx / "draft-hf", out.with_suffix(".ref.npz"), prompt=None,
                                    tokens=None, rounds=0, dtype="float32", device="cpu", kv_dtype="f16",
                                    llama_dir=None, follow=run)  # fmt: skip
                    c = compare_dumps(ref, run, None)
                    errors = sorted({f"{f.kind} {f.tensor}" for f in c.findings if f.severity == "error"})
                    verdicts.append(f"{case}: {'clean' if not errors else '; '.join(errors)}")
                    for p in c.pairs:
                        where = "pre-attention" if p.name in PRE_ATTENTION else "post-attention"
                        row = max(p.row_rel_err, default=0.0)
                        rows.append((kv, where, shape_name, math.sqrt(p.nmse), row, f"{p.role} {p.name}", case))
                    print(f"  {case}: worst pair {max(math.sqrt(p.nmse) for p in c.pairs):.3g}", flush=True)
    print(f"\n{'kv, class':22s} {'worst pair rel':>15s} {'worst row rel':>14s} {'row/pair':>9s}  worst tensor (case)")
    for key in sorted({(r[0], r[1]) for r in rows}):
        sel = [r for r in rows if (r[0], r[1]) == key]
        worst = max(sel, key=lambda r: r[3])
        ratio = max((r[4] / r[3] if r[3] > 0 else 0.0) for r in sel)
        print(
            f"{' '.join(key):22s} {worst[3]:15.3g} {max(r[4] for r in sel):14.3g} {ratio:9.3g}  {worst[5]} ({worst[6]})"
        )
    print(f"\n{'kv, shape (post-attention)':30s} {'worst pair rel':>15s}  worst tensor (case)")
    for key in sorted({(r[0], r[2]) for r in rows if r[1] == "post-attention"}):
        worst = max((r for r in rows if (r[0], r[2]) == key and r[1] == "post-attention"), key=lambda r: r[3])
        print(f"{' '.join(key):30s} {worst[3]:15.3g}  {worst[5]} ({worst[6]})")
    print("\ncompare's verdict with the current tolerances:")
    for v in verdicts:
        print(f"  {v}")


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
    ap.add_argument("--held-out", action="store_true", help="KV cache figures on seeds and shapes no test uses")
    ap.add_argument("--shape", default=None, help="--held-out: only the shapes whose name contains this")
    ap.add_argument(
        "--vulkan", action="store_true", help="the held-out models on the Vulkan build, all layers offloaded"
    )
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="featdiff-calib-"))
    if args.held_out:
        held_out(work, args.shape)
        return
    if args.vulkan:  # this process binds the Vulkan build only (the builds' sonames clash)
        os.environ.update(SOFTWARE_VULKAN_ENV)
        held_out(work, args.shape, HELD_OUT_VULKAN, ensure_vulkan().root)
        return
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
