"""Measure the numeric noise of targets with recurrent layers: the figure behind `REL_RECURRENT`
in src/featdiff/diff/tolerance.py.

    .venv/bin/python bench/calibrate_recurrent.py [--work DIR] [--only NAME] [--prompts N]

A hybrid target (Qwen3.5's and Qwen3-Next's gated delta-net layers, Nemotron-H's Mamba2 blocks)
carries a recurrent state from row to row. llama.cpp computes it in f32 in its own order (a chunked
or a per-token scan), the reference in torch's; a small difference the attention layers before it
left in a row is carried on by the state to every later row, and the state's gates and norms (the
delta rule's L2-normalised keys, the decay's exp) can grow it. The attention-only calibration
(`bench/calibrate_compare.py --held-out`) had no such layer.

On pairs no test uses (seeds 101, 202 and 303; the tests' are seed 0), each case is a capture
(in-process through featdiff's driver, `--rounds 12`, token prompts of held-out lengths; and
`capture --exec` around llama-server, one /completion per prompt on -np 1, greedy) compared
against `reference --follow` of it. Prints per run the worst post-attention pair relative error
(sqrt NMSE) with its tensor and compare's verdict under the tolerance of this tree, then the worst
per family and over all: about 20 minutes on 2 idle cores.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/featdiff_process.py

import featdiff_process  # noqa: E402
from featdiff.diff import compare_dumps  # noqa: E402
from featdiff.diff.tolerance import PRE_ATTENTION  # noqa: E402
from featdiff.driver.capture import capture  # noqa: E402
from featdiff.factory.hf_targets import write_family_fixture  # noqa: E402
from featdiff.factory.mtp import write_mtp_fixture  # noqa: E402
from featdiff.llama.tools import ensure_tools  # noqa: E402
from featdiff.torchref.kind import reference  # noqa: E402

WAIT_S = 600
ROUNDS = 12
N_PREDICT = 16


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "mtp" (the head inside target.gguf) or "dflash" (the fixtures' clean drafter)
    variant: str  # write_mtp_fixture's variant, or write_family_fixture's family
    seed: int


CASES = (
    Case("mtp qwen35 s101", "mtp", "mtp", 101),
    Case("mtp qwen35 s202", "mtp", "mtp", 202),
    Case("mtp qwen35 s303", "mtp", "mtp", 303),
    Case("mtp qwen35moe s101", "mtp", "mtp-qwen35moe", 101),
    Case("mtp nemotron-h-moe s101", "mtp", "mtp-nemotron-h-moe", 101),
    Case("dflash qwen35 s202", "dflash", "qwen35", 202),
    Case("dflash nemotron_h s303", "dflash", "nemotron_h", 303),
)


def token_prompts(n: int, seed: int) -> list[list[int]]:
    """`n` held-out token prompts of lengths 6 to 70 (not the tests' nor the other calibrations')."""
    rng = np.random.default_rng(7300 + seed)
    lengths = [6, 13, 29, 47, 70, 9, 21, 38][:n]
    return [[int(t) for t in rng.integers(3, 500, k)] for k in lengths]


def make(case: Case, work: Path) -> tuple[Path, Path, Path]:
    """(target GGUF, drafter GGUF or the target, the reference's target) of `case`."""
    d = work / case.name.replace(" ", "-")
    if (d / "target.gguf").exists():
        pass
    elif case.kind == "mtp":
        write_mtp_fixture(d, case.variant, seed=case.seed)
    else:
        write_family_fixture(d, case.variant, seed=case.seed)
    model = d / "target.gguf" if case.kind == "mtp" else d / "draft.gguf"
    return d / "target.gguf", model, d / "target-hf"


def judged(ref_target: Path, model: Path, run: Path, out: Path) -> tuple[float, str, str]:
    """(worst post-attention pair rel, its tensor, compare's verdict) of `run` against the
    reference that follows it."""
    ref = reference(ref_target, model, out / "ref.npz", prompt=None, tokens=None, rounds=0, dtype="float32",
                    device="cpu", kv_dtype="f16", llama_dir=None, follow=run)  # fmt: skip
    c = compare_dumps(ref, run)
    post = [p for p in c.pairs if p.name not in PRE_ATTENTION and math.isfinite(p.nmse)]
    worst = max(post, key=lambda p: p.nmse)
    errors = sorted({f"{f.kind} {f.tensor}" for f in c.findings if f.severity == "error"})
    return math.sqrt(worst.nmse), f"{worst.role} {worst.name} ({worst.phase.value})", "; ".join(errors) or "clean"


def in_process(case: Case, target: Path, model: Path, ref_target: Path, tokens: list[int], out: Path):
    out.mkdir(parents=True, exist_ok=True)
    run = capture(target, model, out / "run.npz", tokens=",".join(map(str, tokens)), rounds=ROUNDS)
    return judged(ref_target, model, run, out)


def served(case: Case, server: Path, target: Path, model: Path, ref_target: Path, tokens: list[int], out: Path):
    import json
    import urllib.request

    out.mkdir(parents=True, exist_ok=True)
    spec = "draft-mtp" if case.kind == "mtp" else "draft-dflash"
    command = [str(server), "-m", str(target), "--spec-type", spec, "--spec-draft-n-max", "3",
               "--spec-draft-p-min", "0", "-c", "512", "-np", "1", "-t", "2"]  # fmt: skip
    if case.kind != "mtp":
        command += ["-md", str(model)]
    proc, run, err, port = featdiff_process.capture_server(command, out, 1, WAIT_S)
    body = json.dumps({"prompt": tokens, "n_predict": N_PREDICT, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=WAIT_S) as r:
        r.read()
    if proc.wait(timeout=WAIT_S) != 0:
        raise SystemExit(f"capture failed: {err.read_text()[-2000:]}")
    return judged(ref_target, model, run, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--only", default=None, help="only the cases whose name contains this")
    ap.add_argument("--prompts", type=int, default=5, help="in-process prompts per case (server: 2)")
    ap.add_argument("--no-server", action="store_true")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="featdiff-recurrent-"))
    server = None if args.no_server else ensure_tools().program("llama-server")
    rows: list[tuple[float, str, str, str]] = []
    for case in CASES:
        if args.only and args.only not in case.name:
            continue
        target, model, ref_target = make(case, work)
        prompts = token_prompts(args.prompts, case.seed)
        runs = [("in-process", i, p) for i, p in enumerate(prompts)]
        runs += [] if server is None else [("llama-server", i, p) for i, p in enumerate(prompts[2:4])]
        for how, i, tokens in runs:
            out = work / "runs" / f"{case.name}-{how}-{i}".replace(" ", "-")
            if how == "in-process":
                rel, tensor, verdict = in_process(case, target, model, ref_target, tokens, out)
            else:
                rel, tensor, verdict = served(case, server, target, model, ref_target, tokens, out)
            label = f"{case.name}, {how}, {len(tokens)} tokens"
            rows.append((rel, case.name.split(" s")[0], tensor, label))
            print(f"  {label}: worst post-attention pair {rel:.3g} ({tensor}); {verdict}", flush=True)
    print(f"\n{'family':24s} {'worst pair rel':>15s}  tensor (run)")
    for fam in sorted({r[1] for r in rows}):
        w = max((r for r in rows if r[1] == fam), key=lambda r: r[0])
        print(f"{fam:24s} {w[0]:15.3g}  {w[2]} ({w[3]})")
    w = max(rows, key=lambda r: r[0])
    print(f"{'all':24s} {w[0]:15.3g}  {w[2]} ({w[3]})")


if __name__ == "__main__":
    main()
