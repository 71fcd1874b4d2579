"""How long `featdiff report` takes next to `featdiff compare` alone, on the same dumps.

Writes a synthetic ref/run pair of the DFlash flow with tests/synth.py (the suite's one
synthetic-dump writer): a 36-layer target, a 480-token prompt, 8 rounds, n_embd 256: a few
hundred records, the off-by-one layer bug planted (the run's features from layers L+1, as
tests/report/conftest.py plants it), then times, side by side in one run, best of --repeat:

  compare  featdiff.diff.compare_dumps(ref, run)
  report   compare_dumps + featdiff.html.write_report (what `featdiff report` does)
  write    write_report alone, of one comparison made beforehand (the report's own share)

and prints the times and the ratio report / compare (issue 43's goal: at most 1.5x).

    .venv/bin/python bench/bench_report.py [--repeat 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from featdiff.diff import compare_dumps  # noqa: E402
from featdiff.dump.reader import read_dump  # noqa: E402
from featdiff.html import write_report  # noqa: E402

import synth  # noqa: E402

SPEC = synth.Spec(n_layer=36, n_embd=256, prompt=tuple(1 + (7 * i) % 97 for i in range(480)), rounds=8)
RUN_SPEC = replace(SPEC, target_layers=tuple(L + 1 for L in SPEC.target_layers))  # layers-plus1
RUN_NOISE = 1e-7  # below every tolerance: only the planted bug diverges (tests/report/conftest.py)


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of `repeat` runs of `fn`, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="write the dumps and report here instead of a temp dir")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        ref = synth.write(out / "ref.npz", SPEC)
        run = synth.write(out / "run.npz", RUN_SPEC, side="run", noise=RUN_NOISE)
        with read_dump(ref) as r, read_dump(run) as u:
            n_ref, n_run = len(r.manifest.records), len(u.manifest.records)
        print(f"dumps: {n_ref} ref records, {n_run} run records (layers-plus1, {SPEC.n_layer} layers, "
              f"n_embd {SPEC.n_embd}, {len(SPEC.prompt)}-token prompt, {SPEC.rounds} rounds)")  # fmt: skip
        t_compare = best_time(lambda: compare_dumps(ref, run, None), args.repeat)
        t_report = best_time(
            lambda: write_report(ref, run, out / "report.html", comparison=compare_dumps(ref, run, None)), args.repeat
        )
        comparison = compare_dumps(ref, run, None)
        t_write = best_time(lambda: write_report(ref, run, out / "report.html", comparison=comparison), args.repeat)
        print(
            f"compare alone: {t_compare:.2f} s   report (compare + write_report): {t_report:.2f} s   "
            f"write_report alone: {t_write:.2f} s   ratio report / compare: {t_report / t_compare:.2f}x"
        )


if __name__ == "__main__":
    main()
