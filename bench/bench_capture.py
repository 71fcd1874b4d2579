"""Capture overhead: the in-process DFlash flow with the shim's callback and the default
(wiring) filters, against the same flow with no callback, side by side in one run.

Prints the wall-time ratio (goal <= 1.05) and the ratio of asking for every node ("*", goal
<= 1.3), on a fixture pair large enough that the model, not Python, dominates. Each repeat's spool
is deleted once timed: a capture is timed with what it writes, not with the writeback of the
spools of the repeats before it (an every-node spool is hundreds of MB).

    .venv/bin/python bench/bench_capture.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from featdiff.core.filters import capture_filters
from featdiff.driver import capture as cap
from featdiff.driver import dflash as driver
from featdiff.driver import rounds as driver_rounds
from featdiff.factory import fixtures, pairs
from featdiff.llama.runtime import Context, Model, Runtime, Spool

# A 16 x 1024 target (about 250M parameters, f32): big enough that the model, not the fixed
# per-captured-node cost (one sub-graph split and one host copy each), sets the wall time.
SIZES = pairs.Sizes(
    target=pairs.Shape(n_layer=16, n_embd=1024, n_head=16, n_head_kv=4, n_embd_head=64, n_ff=2816),
    draft=pairs.Shape(n_layer=2, n_embd=1024, n_head=16, n_head_kv=4, n_embd_head=64, n_ff=2816),
    n_vocab=8192,
)
PROMPT = [(i * 37) % 4000 + 1 for i in range(192)]
ROUNDS = 8


def _time_flow(rt: Runtime, models: tuple[Model, Model], cfg: driver.FlowConfig, spool: Spool | None) -> float:
    tgt_model, dft_model = models
    tags = (spool.tag(0), spool.tag(1)) if spool else (None, None)
    tgt = Context.new(rt, tgt_model, 512, 2, tag=tags[0])
    dft = Context.new(rt, dft_model, 512, 2, tag=tags[1], ctx_other=tgt)
    driver.enable(tgt, dft, cfg)
    rec = cap.SpoolRecorder(spool) if spool else driver_rounds.NullRecorder()
    t0 = time.perf_counter()
    driver.run_flow(tgt, dft, PROMPT, ROUNDS, cfg, rec)
    elapsed = time.perf_counter() - t0
    dft.free()
    tgt.free()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = fixtures.write_fixture(Path(tmp) / "pair", "clean", sizes=SIZES)
        rt = Runtime.load()
        models = (Model.load(rt, d / "target.gguf"), Model.load(rt, d / "draft.gguf"))
        cfg = cap.flow_config(models[1])
        times: dict[str, list[float]] = {"none": [], "wiring": [], "all": []}
        spooled: dict[str, int] = {"none": 0}
        for i in range(args.repeats):  # interleaved, so drift hits every variant alike
            times["none"].append(_time_flow(rt, models, cfg, None))
            for label, filters in (("wiring", None), ("all", ["*"])):
                sp = Spool.open(
                    rt, Path(tmp) / f"s{i}{label}", capture_filters(filters, cfg.target_layers).shim_globs()
                )
                times[label].append(_time_flow(rt, models, cfg, sp))
                sp.close()
                spooled[label] = sum(f.stat().st_size for f in Path(tmp).glob(f"s{i}{label}.*"))
                for f in Path(tmp).glob(f"s{i}{label}.*"):
                    f.unlink()
    base, base_min = statistics.median(times["none"]), min(times["none"])
    print(
        f"flow: {len(PROMPT)}-token prefill + {ROUNDS} rounds, target {SIZES.target.n_layer}x{SIZES.target.n_embd}, {args.repeats} interleaved repeats"
    )
    print(f"{'':22s} {'median':>9s} {'ratio':>6s} {'min':>9s} {'ratio':>6s}")
    for label in ("none", "wiring", "all"):
        t, t_min = statistics.median(times[label]), min(times[label])
        print(
            f"callback {label:13s} {t * 1e3:7.1f}ms {t / base:6.3f} {t_min * 1e3:7.1f}ms {t_min / base_min:6.3f}"
            f"  spool {spooled[label] / 1e6:7.1f} MB"
        )
    print(
        f"ratio wiring/none = {statistics.median(times['wiring']) / base:.3f} (median), "
        f"{min(times['wiring']) / base_min:.3f} (min); goal <= 1.05"
    )
    print(
        f"ratio all/none = {statistics.median(times['all']) / base:.3f} (median), "
        f"{min(times['all']) / base_min:.3f} (min); goal <= 1.3"
    )


if __name__ == "__main__":
    main()
