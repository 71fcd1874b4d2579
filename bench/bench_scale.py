"""The reference at scale: memory and time of `reference --follow` on an 8B-shaped pair.

    nice -n 10 .venv/bin/python bench/bench_scale.py [--small] [--make-only]

Makes once, cached under `cache_root()/bench-scale/<shape>`: a qwen3 target (default 36 layers x
4096, GQA 32/8, head 128, ffn 12288, vocab 32768; --small: 4 x 1024) with random weights, written
as an f16 GGUF tensor by tensor (never whole in memory) and quantized to Q4_K_M by the tools build's
`llama-quantize`; and a b16 DFlash drafter shaped like z-lab's Qwen3-8B drafter (5 layers, 5 taps
spread over the target), as an f16 HF directory (the reference's) and an f16 GGUF (the run's).
Then it runs capture in-process (512 random prompt ids, 4 rounds), `featdiff reference --follow`
in a subprocess (its own peak RSS, from a small intermediate's RUSAGE_CHILDREN), compare, and one numpy pass over both dumps,
and prints the ratios side by side with their goals (issue 14).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFWriter
from safetensors.torch import save_file

from featdiff.core import names
from featdiff.core.cache_dir import cache_root
from featdiff.diff import compare_dumps
from featdiff.driver.capture import capture
from featdiff.dump.reader import read_dump
from featdiff.factory.fixtures import _add_stack_keys, _add_vocab, drafter_hf_config  # the fixtures' layout
from featdiff.factory.pairs import Shape, Sizes
from featdiff.llama.binding import find_build
from featdiff.llama.tools import ensure_tools

FULL = Sizes(Shape(36, 4096, 32, 8, 128, 12288), Shape(5, 4096, 32, 8, 128, 12288), 32768)
SMALL = Sizes(Shape(4, 1024, 8, 2, 128, 3072), Shape(2, 1024, 8, 2, 128, 3072), 32768)
BLOCK_SIZE = 16  # z-lab's b16 drafters
N_PROMPT, ROUNDS = 512, 4
GOALS = {"rss_ratio": 3.0, "rss_gb": 6.0, "wall_ratio": 4.0, "compare_ratio": 2.0}  # issue 14
GB = 1e9


@dataclass(frozen=True)
class Files:
    target_f16: Path
    target: Path  # Q4_K_M
    draft_gguf: Path
    draft_hf: Path


def tap_ids(n_target_layer: int, n_taps: int = 5) -> list[int]:
    """HF output-of-layer ids spread evenly over the target (z-lab's 8B drafter: 1, 9, 17, 25, 33)."""
    step = (n_target_layer - 2) // (n_taps - 1)
    return [1 + i * step for i in range(n_taps)]


def _layer_specs(prefix: str, s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape) of one qwen3 layer's tensors, norms last in each group as qwen3 orders them."""
    q, kv = s.n_head * s.n_embd_head, s.n_head_kv * s.n_embd_head
    return [
        (f"{prefix}attn_norm.weight", (s.n_embd,)),
        (f"{prefix}attn_q.weight", (q, s.n_embd)),
        (f"{prefix}attn_k.weight", (kv, s.n_embd)),
        (f"{prefix}attn_v.weight", (kv, s.n_embd)),
        (f"{prefix}attn_output.weight", (s.n_embd, q)),
        (f"{prefix}attn_q_norm.weight", (s.n_embd_head,)),
        (f"{prefix}attn_k_norm.weight", (s.n_embd_head,)),
        (f"{prefix}ffn_norm.weight", (s.n_embd,)),
        (f"{prefix}ffn_gate.weight", (s.n_ff, s.n_embd)),
        (f"{prefix}ffn_up.weight", (s.n_ff, s.n_embd)),
        (f"{prefix}ffn_down.weight", (s.n_embd, s.n_ff)),
    ]


def _draw(seed: int, index: int, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor's random values, from its own stream: the same for the GGUF and the HF file.
    Norms near 1 (f32, as ggml wants them), matrices scaled by 1/sqrt(n_in) in f16."""
    rng = np.random.default_rng([seed, index])
    if len(shape) == 1:
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return (rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1]))).astype(np.float16)


def _write_streamed(path: Path, wr: GGUFWriter, specs: list[tuple[str, tuple[int, ...]]], seed: int) -> None:
    """Tensor infos first, then each tensor's data drawn and written in turn: one tensor in memory."""
    for name, shape in specs:
        dtype = np.dtype(np.float32 if len(shape) == 1 else np.float16)
        wr.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    wr.write_header_to_file(path)
    wr.write_kv_data_to_file()
    wr.write_ti_data_to_file()
    for i, (_, shape) in enumerate(specs):
        wr.write_tensor_data(_draw(seed, i, shape))
    wr.close()


def write_target(path: Path, sz: Sizes) -> None:
    wr = GGUFWriter(None, "qwen3")
    wr.add_name("featdiff bench-scale qwen3 target")
    _add_stack_keys(wr, "qwen3", sz.target)
    _add_vocab(wr, sz)
    specs = [
        (names.T_TOKEN_EMBD, (sz.n_vocab, sz.target.n_embd)),
        (names.T_OUTPUT_NORM, (sz.target.n_embd,)),
        (names.T_OUTPUT, (sz.n_vocab, sz.target.n_embd)),
    ]
    for il in range(sz.target.n_layer):
        specs += _layer_specs(f"blk.{il}.", sz.target)
    _write_streamed(path, wr, specs, seed=1)


def _draft_specs(sz: Sizes) -> list[tuple[str, tuple[int, ...]]]:
    n_extract = len(tap_ids(sz.target.n_layer))
    specs = [
        (names.T_FC, (sz.draft.n_embd, n_extract * sz.target.n_embd)),
        (names.T_ENC_NORM, (sz.draft.n_embd,)),
        (names.T_OUTPUT_NORM, (sz.draft.n_embd,)),
    ]
    for il in range(sz.draft.n_layer):
        specs += _layer_specs(f"blk.{il}.", sz.draft)
    return specs


def write_draft_gguf(path: Path, sz: Sizes) -> None:
    wr = GGUFWriter(None, names.ARCH_DFLASH)
    wr.add_name("featdiff bench-scale dflash drafter")
    _add_stack_keys(wr, names.ARCH_DFLASH, sz.draft)
    _add_vocab(wr, sz)
    wr.add_array(names.KEY_TARGET_LAYERS, [i + 1 for i in tap_ids(sz.target.n_layer)])  # converter: gguf = hf + 1
    wr.add_uint32(names.KEY_BLOCK_SIZE, BLOCK_SIZE)
    _write_streamed(path, wr, _draft_specs(sz), seed=2)


_HF_OF = {names.T_FC: "fc", names.T_ENC_NORM: "hidden_norm", names.T_OUTPUT_NORM: "norm"}


def write_draft_hf(path: Path, sz: Sizes) -> None:
    """The same drafter as an HF directory: the same draws (f16 matrices, f32 norms)."""
    tensors = {}
    for i, (name, shape) in enumerate(_draft_specs(sz)):
        if name.startswith("blk."):
            il, key = name.split(".")[1], name.split(".")[2]
            hf = f"layers.{il}.{names.GGUF_TO_HF_LAYER[key]}.weight"
        else:
            hf = f"{_HF_OF[name]}.weight"
        tensors[hf] = torch.from_numpy(_draw(2, i, shape))
    dflash_config = {"target_layer_ids": tap_ids(sz.target.n_layer), "mask_token_id": sz.mask_token_id}
    config = drafter_hf_config(sz, dflash_config, block_size=BLOCK_SIZE)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / names.HF_CONFIG).write_text(json.dumps(config, indent=1))


def make(sz: Sizes, root: Path) -> Files:
    """The pair's files, each made once (a file is written under a temporary name, then renamed)."""
    root.mkdir(parents=True, exist_ok=True)
    f = Files(root / "target-f16.gguf", root / "target-q4_k_m.gguf", root / "draft.gguf", root / "draft-hf")
    steps = [
        (f.target_f16, lambda p: write_target(p, sz)),
        (f.target, lambda p: _quantize(f.target_f16, p)),
        (f.draft_gguf, lambda p: write_draft_gguf(p, sz)),
        (f.draft_hf, lambda p: write_draft_hf(p, sz)),
    ]
    for path, write in steps:
        if not path.exists():
            t0 = time.perf_counter()
            tmp = path.with_name(path.name + ".tmp")
            write(tmp)
            tmp.rename(path)
            print(f"made {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return f


def _quantize(src: Path, dst: Path) -> None:
    tool = ensure_tools().program("llama-quantize")
    subprocess.run([str(tool), str(src), str(dst), "Q4_K_M"], check=True, capture_output=True)


def plain_pass(ref: Path, run: Path) -> None:
    """The floor of any comparison: read every run record and the reference records of the same
    role, phase, round and name (what compare pairs), and subtract once where the shapes agree.
    (The dumps' member keys differ, so pairing by key would read next to nothing.)"""
    with read_dump(ref) as a, read_dump(run) as b:
        ref_by = defaultdict(list)
        ref_round = {ev.eval: ev.round for ev in a.manifest.evals}
        for r in a.manifest.records:
            ref_by[(r.role, r.phase, ref_round.get(r.eval, 0), r.name, r.occurrence)].append(r)
        run_round = {ev.eval: ev.round for ev in b.manifest.evals}
        for r in b.manifest.records:
            x = b.array(r)
            for q in ref_by.get((r.role, r.phase, run_round.get(r.eval, 0), r.name, r.occurrence), []):
                y = a.array(q)
                if x.shape == y.shape:
                    _ = x - y


# Runs the command as its child and prints that child's peak RSS (kB). The measured process must
# be forked from a small one: a child's ru_maxrss counts what its parent held at the fork (Linux
# keeps the pre-exec peak), and this bench process holds the capture's models.
_MEASURE = (
    "import resource, subprocess, sys; "
    "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def _peak_of(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of `cmd`, measured by a small intermediate process."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], check=True, capture_output=True, text=True)
    return time.perf_counter() - t0, int(out.stdout.split()[-1]) * 1024  # kB on Linux


def _seconds(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_flow(f: Files, work: Path) -> dict[str, float]:
    """Capture, reference --follow, compare and the numpy pass; seconds and the reference's peak RSS."""
    ids = np.random.default_rng(3).integers(1, 30000, N_PROMPT)
    run_dump, ref_dump = work / "run.npz", work / "ref.npz"
    cpu0 = _cpu_seconds()
    capture(f.target, f.draft_gguf, run_dump, tokens=",".join(map(str, ids)), rounds=ROUNDS)
    capture_cpu = _cpu_seconds() - cpu0
    cmd = [
        str(Path(sys.executable).with_name("featdiff")),
        "reference",
        "--target",
        str(f.target),
        "--model",
        str(f.draft_hf),
    ]
    # the capture's own build dequantizes: what the run read, bit for bit, and faster than gguf-py
    cmd += ["-o", str(ref_dump), "--follow", str(run_dump), "--llama-dir", str(find_build(None).root)]
    ref_wall, peak = _peak_of(cmd)
    # each the best of two, side by side: the first to read a fresh dump would pay for its pages
    compare_s = min(_seconds(compare_dumps, ref_dump, run_dump) for _ in range(2))
    numpy_s = min(_seconds(plain_pass, ref_dump, run_dump) for _ in range(2))
    return {"capture_cpu": capture_cpu, "ref_wall": ref_wall, "peak": peak, "compare": compare_s, "numpy": numpy_s}


def floor_bytes(sz: Sizes) -> int:
    """The largest single layer's f32 weights plus the f32 embedding table: the least a streamed
    reference holds."""
    layer = sum(int(np.prod(shape)) for _, shape in _layer_specs("", sz.target)) * 4
    draft_layer = sum(int(np.prod(shape)) for _, shape in _layer_specs("", sz.draft)) * 4
    return max(layer, draft_layer) + sz.n_vocab * sz.target.n_embd * 4


def render(m: dict[str, float], sz: Sizes) -> str:
    rows = [
        ("reference peak RSS / (largest layer f32 + embd f32)", m["peak"] / floor_bytes(sz), GOALS["rss_ratio"]),
        ("reference peak RSS, GB", m["peak"] / GB, GOALS["rss_gb"]),
        ("reference wall / capture CPU", m["ref_wall"] / m["capture_cpu"], GOALS["wall_ratio"]),
        ("compare / numpy pass", m["compare"] / m["numpy"], GOALS["compare_ratio"]),
    ]
    lines = [f"{'measure':<54}{'value':>9}{'goal':>9}  met"]
    lines += [f"{name:<54}{v:>9.2f}{'<= ' + format(g, 'g'):>9}  {'yes' if v <= g else 'NO'}" for name, v, g in rows]
    lines.append(
        f"(capture CPU {m['capture_cpu']:.1f} s, reference wall {m['ref_wall']:.1f} s, peak {m['peak'] / GB:.2f} GB, "
        f"floor {floor_bytes(sz) / GB:.2f} GB, compare {m['compare']:.2f} s, numpy pass {m['numpy']:.2f} s)"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a 4 x 1024 target, to try the bench quickly")
    ap.add_argument("--make-only", action="store_true", help="make the cached files and stop")
    args = ap.parse_args()
    sz = SMALL if args.small else FULL
    root = cache_root() / "bench-scale" / ("small" if args.small else "8b")
    files = make(sz, root)
    if args.make_only:
        return
    work = root / "work"
    work.mkdir(exist_ok=True)
    print(f"{'small' if args.small else '8B-shaped'} pair, {N_PROMPT} prompt ids, {ROUNDS} rounds:")
    print(render(run_flow(files, work), sz))


if __name__ == "__main__":
    main()
