"""Memory and time of a transformers-backed target (issue 24): what `featdiff reference` holds
for a target it loads through transformers' model code, against what featdiff.torchref.memory
predicts before loading.

    nice -n 10 .venv/bin/python bench/bench_hf_target.py [--family NAME (hf_targets.FAMILIES)] [--layers N] [--width N]

For each family it writes a seeded checkpoint at the given sizes (transformers' `save_pretrained`,
then stored in bfloat16 as published checkpoints are; default 16 layers x 1024, a 32768-token vocabulary: ~120 M parameters) into a temporary directory, then
in a fresh subprocess imports torch and transformers (its baseline RSS), loads the target the way
the reference does (`reference.load.load_target`) and runs one forward of 128 tokens, and prints
side by side: parameters, the predicted bytes (`loaded_bytes`), the measured peak RSS above the
baseline (resident anonymous memory after the forward: the mapped checkpoint's file pages are the
page cache's, reclaimable), their ratio and the load factor the check uses, the peak RSS with the
mapped pages, and the load and forward times. Then the
figures for an 8B dense and a 30B-A3B MoE target, from the same formula.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from featdiff.factory import pairs
from featdiff.factory.hf_families import FAMILIES
from featdiff.factory.hf_targets import write_hf_target
from featdiff.torchref.memory import GIB, LOAD_FACTOR, checkpoint_parameters, loaded_bytes

PROBE = """
import json, resource, sys, time
import torch, transformers  # noqa: F401 - the baseline: what any reference process holds
from featdiff.torchref.load import load_target
def anon():  # resident anonymous memory: what the process needs, not the files it maps
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))
base = anon()
t0 = time.perf_counter()
target = load_target(sys.argv[1], torch.float32, torch.device("cpu"))
t1 = time.perf_counter()
with torch.no_grad():
    target.model(torch.arange(128).reshape(1, -1) % target.hparams.n_vocab)
t2 = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base": base, "anon": anon(), "peak": peak, "load_s": t1 - t0, "forward_s": t2 - t1}))
"""

# Published shapes (config.json of Qwen3-8B and Qwen3-30B-A3B): parameters, for the README's figures
PUBLISHED = {"an 8B target (8.19 B parameters, Qwen3-8B's)": 8.19e9, "Qwen3-30B-A3B (30.5 B)": 30.5e9}


def _as_bf16(path: Path) -> None:
    """The checkpoint's safetensors in bfloat16, as published checkpoints ship: loading them as
    float32 converts every tensor into memory of the process's own (the float32 files transformers
    would map instead)."""
    from safetensors.torch import load_file, save_file

    for file in path.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), action="append")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    args = ap.parse_args()
    shape = pairs.Shape(
        n_layer=args.layers, n_embd=args.width, n_head=8, n_head_kv=4, n_embd_head=args.width // 8, n_ff=4 * args.width
    )
    sizes = dataclasses.replace(pairs.TINY, target=shape, n_vocab=args.vocab)
    print(
        f"{'family':10} {'params':>8} {'predicted':>10} {'measured':>10} {'ratio':>6} {'factor':>6} {'peak RSS':>9} {'load':>7} {'fwd':>6}"
    )
    for name in args.family or sorted(FAMILIES):
        fam = dataclasses.replace(FAMILIES[name], config=lambda _sz, f=FAMILIES[name]: f.config(sizes))
        with tempfile.TemporaryDirectory(prefix="featdiff-bench-hf-") as tmp:
            path = write_hf_target(Path(tmp) / "target-hf", fam, seed=0)
            _as_bf16(path)
            n = checkpoint_parameters(path)
            out = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, check=True)
        m = json.loads(out.stdout.strip().splitlines()[-1])
        predicted = loaded_bytes(n, torch.float32) - (1 << 30)  # the model part, without the fixed headroom
        measured = m["anon"] - m["base"]  # anonymous memory held after a forward
        print(
            f"{name:10} {n / 1e6:7.1f}M {predicted / GIB:9.3f}G {measured / GIB:9.3f}G "
            f"{measured / (n * 4):6.2f} {LOAD_FACTOR:6.2f} {m['peak'] / GIB:8.3f}G {m['load_s']:6.1f}s {m['forward_s']:5.1f}s"
        )
    print("\nwhat a transformers-backed target needs (float32, the reference's default dtype):")
    for label, n_params in PUBLISHED.items():
        print(f"  {label}: {loaded_bytes(int(n_params), torch.float32) / GIB:.0f} GiB")


if __name__ == "__main__":
    main()
