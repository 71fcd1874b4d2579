"""The accept rate of two requests to llama-server on two slots (`-np 2`), side by side in one
run: sent one after the other, sent at once, and sent at once with the draft sampled on the CPU
(`--no-spec-draft-backend-sampling`). No featdiff in the loop: the server's own `timings`.

With the trained EAGLE3 drafter the pinned llama-server samples both slots' draft steps from one
slot's candidates when they share a decode, so the other slot's accept collapses at once and only
with backend sampling (docs/guide-server.md, "A bug in the pinned llama-server this found"); the trained MTP
head accepts alike in all three.

    .venv/bin/python bench/two_slot_accept.py [--variant trained-eagle3|trained-mtp] [--n-predict 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from featdiff.llama.tools import ensure_tools
from featdiff.programs.server import free_port

WAIT_S = 120
MODES = {
    "one after the other": ([], False),
    "at once": ([], True),
    "at once, CPU sampling": (["--no-spec-draft-backend-sampling"], True),
}


def _pair(variant: str, where: Path) -> tuple[list[str], list[list[int]]]:
    """The server's model arguments for `variant` and the first two prompts of its prompts.txt."""
    if variant == "trained-mtp":
        from featdiff.factory.mtp import write_mtp_fixture

        d = write_mtp_fixture(where, variant)
        models = ["-m", str(d / "target.gguf"), "--spec-type", "draft-mtp"]
    else:
        from featdiff.factory.eagle3 import write_eagle3_fixture

        d = write_eagle3_fixture(where, variant)
        models = ["-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf"), "--spec-type", "draft-eagle3"]
    lines = [line for line in (d / "prompts.txt").read_text().splitlines() if line.startswith("tokens:")]
    return models, [[int(t) for t in line.split(":", 1)[1].split(",")] for line in lines[:2]]


def _complete(port: int, prompt: list[int], n_predict: int, start: threading.Barrier | None) -> tuple[int, int]:
    """(drafted, accepted) of one greedy completion, as the server counts them."""
    body = json.dumps({"prompt": prompt, "n_predict": n_predict, "temperature": 0}).encode()
    if start is not None:
        start.wait()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=WAIT_S) as r:
        timings = json.loads(r.read()).get("timings", {})
    return int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))


def _serve(models: list[str], extra: list[str], prompts: list[list[int]], n_predict: int, together: bool):
    port = free_port()
    server = ensure_tools().program("llama-server")
    args = [str(server), *models, "--spec-draft-n-max", "3", "-c", "512", "-t", "2", "-np", "2", "--port", str(port)]
    proc = subprocess.Popen([*args, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    f"http://127.0.0.1:{port}/health", timeout=1
                ):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{server}: never answered /health") from None
                time.sleep(0.2)
        counts: list[tuple[int, int]] = [(0, 0)] * len(prompts)
        start = threading.Barrier(len(prompts)) if together else None

        def ask(i: int) -> None:
            counts[i] = _complete(port, prompts[i], n_predict, start)

        if together:
            threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for i in range(len(prompts)):
                ask(i)
        return counts
    finally:
        proc.terminate()
        proc.wait(timeout=WAIT_S)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="trained-eagle3", choices=("trained-eagle3", "trained-mtp"))
    ap.add_argument("--n-predict", type=int, default=64)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="featdiff-bench-") as work:
        models, prompts = _pair(a.variant, Path(work))
        print(f"{a.variant}, llama-server -np 2, {a.n_predict} tokens each: accepted / drafted")
        for mode, (extra, together) in MODES.items():
            counts = _serve(models, extra, prompts, a.n_predict, together)
            shown = "   ".join(
                f"request {i}: {acc:3d} / {n:3d} ({acc / max(n, 1):4.0%})" for i, (n, acc) in enumerate(counts)
            )
            print(f"  {mode:24s} {shown}")


if __name__ == "__main__":
    main()
