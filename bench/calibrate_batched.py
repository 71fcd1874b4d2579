"""Measure the numeric noise of rows llama.cpp computed in batches holding several sequences: the
figure behind `REL_BATCHED` in src/featdiff/diff/tolerance.py.

    .venv/bin/python bench/calibrate_batched.py [--work DIR] [--only KIND]

llama-server with `-np N` serves requests sent at once in shared decodes (the rows of every slot
in one batch, one unified KV cache holding all of them), where a run of one sequence decodes each
alone: the kernels see other row counts and the attention other KV lengths, so they sum in another
order. On pairs no test uses (DFlash pairs of the held-out shapes and seeds of
`bench/calibrate_compare.py --held-out`, an EAGLE3 pair and an MTP head of seed 101), each run is
`featdiff capture --exec` of llama-server `-np N` (N = 2 and 4, f16 cache, CPU draft sampling:
`--no-spec-draft-backend-sampling`) given N greedy `/completion` requests of held-out token
prompts at once, against `reference --follow` of it; and, as the baseline, the same requests one
after the other on `-np 1`. Prints per case the worst post-attention pair relative error (sqrt
NMSE) with the tensor, and whether compare judged it clean; about 15 minutes on 2 busy cores.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/featdiff_process.py

import featdiff_process  # noqa: E402
from featdiff.diff import compare_dumps  # noqa: E402
from featdiff.diff.tolerance import PRE_ATTENTION  # noqa: E402
from featdiff.dump.reader import read_dump  # noqa: E402
from featdiff.factory.eagle3 import write_eagle3_fixture  # noqa: E402
from featdiff.factory.fixtures import write_fixture  # noqa: E402
from featdiff.factory.mtp import write_mtp_fixture  # noqa: E402
from featdiff.factory.pairs import Shape, Sizes  # noqa: E402
from featdiff.llama.tools import ensure_tools  # noqa: E402
from featdiff.torchref.kind import reference  # noqa: E402

WAIT_S = 300
N_PREDICT = 12
SLOTS = (2, 4)
# DFlash held-out shapes (bench/calibrate_compare.py HELD_OUT_SHAPES), each with its own seed
DFLASH_HELD_OUT = {
    "dflash h32 l8 gqa2": (
        101,
        Sizes(
            target=Shape(n_layer=8, n_embd=128, n_head=4, n_head_kv=2, n_embd_head=32, n_ff=256),
            draft=Shape(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_embd_head=32, n_ff=256),
        ),
    ),
    "dflash h64 l6 gqa4": (
        202,
        Sizes(
            target=Shape(n_layer=6, n_embd=256, n_head=4, n_head_kv=1, n_embd_head=64, n_ff=512),
            draft=Shape(n_layer=3, n_embd=256, n_head=4, n_head_kv=1, n_embd_head=64, n_ff=512),
        ),
    ),
}
HELD_OUT_SEED = 101  # the EAGLE3 pair's and the MTP head's (the tests' are seed 0)
SPEC = {"dflash": "draft-dflash", "eagle3": "draft-eagle3", "mtp": "draft-mtp"}


def prompts(n: int) -> list[list[int]]:
    """`n` held-out token prompts of different lengths (not the tests' nor calibrate_compare's)."""
    rng = np.random.default_rng(4646)
    return [[int(t) for t in rng.integers(1, 500, 8 + 7 * i)] for i in range(n)]


def _complete(port: int, tokens: list[int], gate: threading.Barrier | None) -> None:
    body = json.dumps({"prompt": tokens, "n_predict": N_PREDICT, "temperature": 0, "cache_prompt": False}).encode()
    if gate is not None:
        gate.wait()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=WAIT_S) as r:
        r.read()


def _send(port: int, requests: list[list[int]], together: bool) -> None:
    if not together:
        for tokens in requests:
            _complete(port, tokens, None)
        return
    gate = threading.Barrier(len(requests))
    clients = [threading.Thread(target=_complete, args=(port, t, gate)) for t in requests]
    for c in clients:
        c.start()
    for c in clients:
        c.join()


def _pairs(kind: str, work: Path) -> list[tuple[str, Path, Path]]:
    """(case, target GGUF, drafter GGUF or the target for MTP) per held-out pair of `kind`."""
    if kind == "dflash":
        out = []
        for name, (seed, sizes) in DFLASH_HELD_OUT.items():
            fx = write_fixture(work / name.replace(" ", "-"), "clean", seed=seed, sizes=sizes)
            out.append((name, fx / "target.gguf", fx / "draft.gguf"))
        return out
    if kind == "eagle3":
        fx = write_eagle3_fixture(work / "eagle3", "eagle3", seed=HELD_OUT_SEED)
        return [(f"eagle3 seed {HELD_OUT_SEED}", fx / "target.gguf", fx / "draft.gguf")]
    fx = write_mtp_fixture(work / "mtp", "mtp", seed=HELD_OUT_SEED)
    return [(f"mtp seed {HELD_OUT_SEED}", fx / "target.gguf", fx / "target.gguf")]


def run_case(server: Path, kind: str, target: Path, draft: Path, slots: int, together: bool, out: Path) -> list:
    """Capture `slots` requests on llama-server `-np slots` (at once or one by one), compare
    against the reference that follows the run; the comparison's pairs and errors."""
    out.mkdir(parents=True, exist_ok=True)
    command = [str(server), "-m", str(target), "--spec-type", SPEC[kind], "--spec-draft-n-max", "3", "-c", "1024",
               "-np", str(slots if together else 1), "-t", "1", "-td", "1", "--no-spec-draft-backend-sampling",
               "--cache-ram", "0"]  # fmt: skip
    if kind != "mtp":
        command += ["-md", str(draft)]
    requests = prompts(slots)
    proc, run, err, port = featdiff_process.capture_server(command, out, len(requests), WAIT_S)
    _send(port, requests, together)
    if proc.wait(timeout=WAIT_S) != 0:
        raise SystemExit(f"capture failed: {err.read_text()[-2000:]}")
    with read_dump(run) as dump:
        batched = dump.manifest.build_info.seqs_per_decode
    ref_target = target.parent / "target-hf" if kind == "mtp" else target  # qwen35: transformers' model code
    ref = reference(ref_target, draft, out / "ref.npz", prompt=None, tokens=None, rounds=0, dtype="float32",
                    device="cpu", kv_dtype="f16", llama_dir=None, follow=run)  # fmt: skip
    c = compare_dumps(ref, run)
    errors = sorted({f"{f.kind} {f.tensor}" for f in c.findings if f.severity == "error"})
    return [batched, list(c.pairs), errors]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--only", choices=sorted(SPEC), default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="featdiff-batched-"))
    server = ensure_tools().program("llama-server")
    rows: list[tuple[str, float, str, str]] = []  # (mode, worst post-attention pair rel, tensor, case)
    for kind in [args.only] if args.only else list(SPEC):
        for case, target, draft in _pairs(kind, work):
            for slots in SLOTS:
                for together in (True, False):
                    mode = f"np{slots} at once" if together else "one by one"
                    if not together and slots != max(SLOTS):
                        continue  # the baseline once per pair, with the most requests
                    label = f"{case}, {slots} requests {mode}"
                    slug = f"{case}-{slots}-{int(together)}".replace(" ", "-")
                    batched, pairs, errors = run_case(server, kind, target, draft, slots, together, work / slug)
                    post = [p for p in pairs if p.name not in PRE_ATTENTION]
                    worst = max(post, key=lambda p: p.nmse)
                    rel = math.sqrt(worst.nmse)
                    rows.append(
                        ("batched" if batched > 1 else "one sequence", rel, f"{worst.role} {worst.name}", label)
                    )
                    verdict = "clean" if not errors else "; ".join(errors)
                    print(f"  {label} (seqs_per_decode {batched}): worst post-attention pair {rel:.3g} "
                          f"({worst.role} {worst.name}); {verdict}", flush=True)  # fmt: skip
    print(f"\n{'runs':14s} {'worst pair rel':>15s}  tensor (case)")
    for mode in ("one sequence", "batched"):
        sel = [r for r in rows if r[0] == mode]
        if sel:
            w = max(sel, key=lambda r: r[1])
            print(f"{mode:14s} {w[1]:15.3g}  {w[2]} ({w[3]})")


if __name__ == "__main__":
    main()
