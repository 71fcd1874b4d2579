"""How long `featdiff report` takes next to `featdiff compare` alone, on the same dumps.

Writes a synthetic ref/run pair shaped like the DFlash flow (tests/report/synthetic_dumps.py:
a 36-layer target, a 600-token prompt, 8 rounds, n_embd 256: a few hundred records, the
off-by-one layer bug planted), then times, side by side in one run, best of --repeat:

  compare  featdiff.compare.compare_dumps(ref, run)
  report   compare_dumps + featdiff.report.write_report (what `featdiff report` does)

and prints both times and the ratio report / compare. Without featdiff.compare.compare_dumps
(not landed yet) it times the report on a hand-measured comparison and says so.

    .venv/bin/python bench/bench_report.py [--repeat 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "report"))

from featdiff.dump import read_dump  # noqa: E402
from featdiff.report import write_report  # noqa: E402

from synthetic_dumps import Shape, compare_by_hand, planted_findings, write_pair  # noqa: E402

SHAPE = Shape(n_layer=36, n_embd=256, n_prompt=600, rounds=8)
VARIANT = "layers-plus1"


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of `repeat` runs of `fn`, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def compare_function() -> Callable | None:
    """compare's entry point when it has landed, else None."""
    try:
        from featdiff.compare import compare_dumps
    except ImportError:
        return None
    return compare_dumps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="write the dumps and report here instead of a temp dir")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp)
        ref, run = write_pair(out, VARIANT, SHAPE)
        with read_dump(ref) as r, read_dump(run) as u:
            n_ref, n_run = len(r.manifest.records), len(u.manifest.records)
        print(f"dumps: {n_ref} ref records, {n_run} run records ({VARIANT}, {SHAPE})")
        compare_dumps = compare_function()
        if compare_dumps is None:
            comparison = compare_by_hand(ref, run, planted_findings(VARIANT))
            t_report = best_time(
                lambda: write_report(ref, run, out / "report.html", comparison=comparison), args.repeat
            )
            print(
                f"report (write_report only, hand-measured comparison of {len(comparison.pairs)} pairs): "
                f"{t_report:.2f} s; featdiff.compare.compare_dumps not available, no ratio"
            )
            return
        t_compare = best_time(lambda: compare_dumps(ref, run, None), args.repeat)
        t_report = best_time(
            lambda: write_report(ref, run, out / "report.html", comparison=compare_dumps(ref, run, None)), args.repeat
        )
        print(
            f"compare alone: {t_compare:.2f} s   report (compare + write_report): {t_report:.2f} s   "
            f"ratio report / compare: {t_report / t_compare:.2f}x"
        )


if __name__ == "__main__":
    main()
