"""The EAGLE3 pairs' real flow, shared by the tests that capture one on the real library: the
prompt and rounds, and a run with the reference that follows its tokens and rounds."""

from __future__ import annotations

from pathlib import Path

from featdiff.driver.capture import capture
from featdiff.torchref.kind import reference

TOKENS = "7,21,3,99,140,5,260,33,18,402,77,9"
ROUNDS = 3


def run_and_ref(d: Path, model: Path, tmp: Path) -> tuple[Path, Path]:
    """An in-process capture of `model` on `d`'s target, and the reference of `d`'s correct
    drafter GGUF guided by it."""
    run = capture(d / "target.gguf", model, tmp / "run.npz", tokens=TOKENS, rounds=ROUNDS)
    ref = reference(
        d / "target.gguf", d / "draft.gguf", tmp / "ref.npz", prompt=None, tokens=TOKENS, rounds=ROUNDS,
        dtype="float32", device="cpu", kv_dtype="f16", llama_dir=None, run=run,
    )  # fmt: skip
    return run, ref
