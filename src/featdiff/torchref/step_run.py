"""`featdiff reference` of the kinds that draft one token per decode (featdiff.kinds: EAGLE3,
MTP): load the target and the drafter, replay the kind's flow on the same token ids, write a dump
v1 with `source: "reference"`. The options are torchref.run.reference's; a round drafts `--block`
- 1 tokens, else the run's own (its build's `draft_max`), else llama.cpp's `--spec-draft-n-max`
default. Each kind gives a `StepKind`: how it loads its drafter, replays its flow and describes
its drafter in the manifest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from featdiff.core.blocks import DEFAULT_DRAFT_MAX, check_rounds_fit
from featdiff.dump.reader import read_dump
from featdiff.dump.records import Round
from featdiff.core.errors import InputError
from featdiff.core.outputs import check_output, output_lock
from featdiff.core.names import ROLE_TARGET
from featdiff.core.phases import Phase
from featdiff.core.tokens import check_prompt
from featdiff.torchref.dflash import run as dflash_run
from featdiff.torchref.load import load_target
from featdiff.torchref.numerics import Numerics
from featdiff.torchref.rounds import FlowTrace
from featdiff.torchref.weights import Target

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepKind:
    """What the shared reference command needs of a one-token-per-step kind."""

    name: str  # for the log line
    load: Callable[[Path, Target, Numerics, Path | None], Any]  # (model, target, numerics, llama_dir) -> drafter
    run_flow: Callable[..., FlowTrace]  # eagle3_flow.run_flow's signature
    entry: Callable[[Any], dict]  # the drafter's manifest entry
    # run_flow takes `target_batches`, the first position of each of the run's prefill decode calls
    # (EAGLE3's and MTP's batch_last candidates pair by the run's batches)
    reads_run_batches: bool = False


def step_reference(
    kind: StepKind,
    target: Path,
    model: Path,
    output: Path,
    *,
    prompt: str | None,
    tokens: str | None,
    rounds: int,
    dtype: str,
    device: str,
    kv_dtype: str,
    llama_dir: Path | None,
    block: int | None = None,
    run: Path | None = None,
    p_min: float | None = None,
    follow: Path | None = None,
) -> Path:
    """Compute the reference dump of a `kind` drafter; return its path (torchref.run.reference's contract)."""
    output = check_output(Path(output), (Path(target), Path(model), run, follow), "-o")
    with output_lock(output):
        r = dflash_run.read_replay(
            target, model, prompt, tokens, rounds, dtype, device, kv_dtype, llama_dir, block, run, p_min, follow
        )
        draft_max = _draft_max(block, r.run)
        check_rounds_fit(
            r.rounds, draft_max + 1, dflash_run.trained_context_of(Path(target)), Path(target), len(r.prompt_ids)
        )
        tgt = load_target(Path(target), r.numerics.dtype, r.numerics.device, llama_dir)
        dft = kind.load(Path(model), tgt, r.numerics, llama_dir)
        check_prompt(r.prompt_ids, tgt.hparams.n_vocab, Path(target))
        log.info(
            "reference: %d prompt tokens, %d rounds, up to %d drafts a round (%s)",
            *(len(r.prompt_ids), r.rounds, draft_max, kind.name),
        )
        steps = run_draft_steps(r.run) if r.run is not None else {}
        batches = run_target_batches(r.run) if r.run is not None and kind.reads_run_batches else None

        def replay(
            prompt_of: tuple[int, ...],
            n: int,
            follows: tuple[Round, ...] | None,
            guides: tuple[Round, ...] | None,
            flow: int = 0,
            cached: int = 0,
            draft_cached: tuple[int, ...] | None = None,
        ) -> FlowTrace:
            of_run = {} if batches is None else {"target_batches": batches.get(flow, ())}
            return kind.run_flow(
                tgt, dft, prompt_of, n, r.numerics, draft_max=draft_max, p_min=r.p_min, follow=follows, guide=guides,
                cached=cached, draft_steps=steps.get(flow), draft_cached=draft_cached, **of_run,
            )  # fmt: skip

        return dflash_run.write_reference(
            output, r.trace(replay), tgt, None, r.numerics, r.prompt_ids, draft_max + 1, r.p_min, r.followed,
            flows=tuple(f.info for f in r.flows) if len(r.flows) > 1 else (), draft_entry=kind.entry(dft),
        )  # fmt: skip


def run_draft_steps(run: Path) -> dict[int, dict[int, tuple[int, ...]]]:
    """Flow -> round -> the token ids of the run's draft decodes in order (the first step's first),
    for every round the run verified: the reference decodes what the run decoded."""
    with read_dump(run) as dump:
        m = dump.manifest
    steps: dict[int, dict[int, list[int]]] = {}
    for r in m.rounds:
        steps.setdefault(r.flow, {})[r.round] = []
    for e in m.evals:
        if e.phase == Phase.DRAFT and e.round in steps.get(e.flow, {}) and not e.rc:
            steps[e.flow][e.round] += e.token_ids
    return {f: {r: tuple(t) for r, t in rounds.items()} for f, rounds in steps.items()}


def run_target_batches(run: Path) -> dict[int, tuple[int, ...]]:
    """Flow -> the first position of each target decode call that prefilled its prompt (a call
    computed as several ubatch graphs counts once: its first graph's)."""
    with read_dump(run) as dump:
        m = dump.manifest
    firsts: dict[int, list[int]] = {}
    for e in m.evals:
        if e.role == ROLE_TARGET and e.phase == Phase.PREFILL and e.positions and not e.ubatch:
            firsts.setdefault(e.flow, []).append(e.positions[0])
    return {f: tuple(p) for f, p in firsts.items()}


def _draft_max(block: int | None, run: Path | None) -> int:
    """Drafts per round: `--block` - 1 (a round's verify is the anchor and its drafts), else the
    run's, else llama.cpp's default."""
    if block is not None:
        if block < 2:
            raise InputError(f"--block {block}: a round verifies the anchor and at least one draft; pass 2 or more")
        return block - 1
    if run is not None:
        with read_dump(run) as dump:
            n = dump.manifest.build.get("draft_max")
        if isinstance(n, int) and n >= 1:
            return n
    return DEFAULT_DRAFT_MAX
