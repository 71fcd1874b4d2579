"""`featdiff reference`: load the target and the drafter (GGUF or HF), run the DFlash flow in
PyTorch on the same token ids, and write a dump v1 with `source: "reference"`.

`--prompt` is tokenized with llama.cpp's own vocabulary (featdiff.llama.tokenize) from the
target GGUF, else the drafter GGUF (DFlash pairs share one vocabulary); with two HF
directories there is no llama.cpp vocabulary, so `--tokens` is required. Draft blocks are as
long as the run's (`--block`, `--run`; featdiff.core.blocks), by default llama.cpp's default.
`--follow run.npz` replays the run instead of deciding: its prompt, its rounds, its drafts and
accepted prefixes (featdiff.torchref.dflash.flow), so every eval of the run has its reference eval.
`--run run.npz` decides every round itself, on the prompt and rounds it is given; where its
choice parts from the run's (a near-tie of two tokens the numerics cannot tell apart, or a
fault), it decodes the run's tokens from there on, so the rounds after the parting still pair,
and compare judges the parting from this reference's own logits (diff/partings.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from featdiff.core import names
from featdiff.dump.manifest import Manifest
from featdiff.dump.reader import read_dump
from featdiff.dump.records import FlowInfo, Round, record_key
from featdiff.dump.writer import DumpWriter, record_from_array
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import read_gguf, trained_context
from featdiff.llama import ggml_dequant
from featdiff.dump.blocks import asked_block_rows, run_block_rows
from featdiff.core.blocks import check_rounds_fit, checked_block_rows
from featdiff.core.outputs import check_output, output_lock
from featdiff.torchref.dflash.dspark import first_draft_row
from featdiff.torchref.rounds import EvalTrace, FollowError, FlowTrace
from featdiff.torchref.dflash.flow import run_flow
from featdiff.torchref.load_hf import read_config
from featdiff.core.tokens import check_prompt, parse_tokens, require_one
from featdiff.kinds import registry as kinds
from featdiff.torchref.load import load_draft, load_target
from featdiff.torchref.numerics import COMPUTE_DTYPES, KV_DTYPES, Numerics
from featdiff.torchref.weights import Draft, Target, check_pair, models_entry

log = logging.getLogger(__name__)


def reference(
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
    """Compute the reference dump; return its path.

    Draft blocks are `block` rows, else as long as the run dump `run`'s, else llama.cpp's default.
    With `follow` (a run dump), the prompt, the rounds and the blocks are that run's, replayed.
    """
    output = check_output(Path(output), (Path(target), Path(model), run, follow), "-o")
    with output_lock(output):  # held from the start: a second run to it refuses before any work
        r = read_replay(
            target, model, prompt, tokens, rounds, dtype, device, kv_dtype, llama_dir, block, run, p_min, follow
        )
        # --block with --follow: a run that drafted no block that ran (followed_run allowed it)
        asked = asked_block_rows(block, r.run if r.run is not None and (block is None or r.plan is None) else None)
        dft = load_draft(Path(model), r.numerics.dtype, r.numerics.device, llama_dir)
        rows = checked_block_rows(asked, dft.block_size, Path(model), first_draft_row(dft))
        # before the target's weights load: its trained context bounds the flow's positions
        check_rounds_fit(r.rounds, rows.rows, trained_context_of(Path(target)), Path(target), len(r.prompt_ids))
        tgt = load_target(Path(target), r.numerics.dtype, r.numerics.device, llama_dir)
        check_pair(tgt, dft)
        check_prompt(r.prompt_ids, tgt.hparams.n_vocab, Path(target))
        log.info(
            "reference: %d prompt tokens, %d rounds, draft blocks of %d rows (%s; block size %d)",
            *(len(r.prompt_ids), r.rounds, rows.rows, rows.origin, dft.block_size),
        )

        def replay(
            prompt_of: tuple[int, ...],
            n: int,
            follows: tuple[Round, ...] | None,
            guides: tuple[Round, ...] | None,
            flow: int = 0,
            cached: int = 0,
            draft_cached: tuple[int, ...] | None = None,
        ) -> FlowTrace:
            return run_flow(
                tgt, dft, prompt_of, n, r.numerics, block_rows=rows.rows, p_min=r.p_min, follow=follows,
                guide=guides, cached=cached,
            )  # fmt: skip

        trace = r.trace(replay)
        return write_reference(
            output, trace, tgt, dft, r.numerics, r.prompt_ids, rows.rows, r.p_min, followed=r.followed,
            flows=tuple(f.info for f in r.flows) if len(r.flows) > 1 else (),
        )  # fmt: skip


# replay(prompt, rounds, followed rounds, guiding rounds, flow, n_cached, draft_cached): one flow's trace
Replayer = Callable[..., FlowTrace]


@dataclass(frozen=True)
class Replay:
    """What a reference replays, read from its options and from the run it follows (`--follow`)
    or is guided by (`--run`): the numerics, the prompt, the rounds and the run's flows."""

    numerics: Numerics
    plan: FollowedRun | None  # --follow's run as a plan to replay
    run: Path | None  # the run dump read: --follow's, else --run's
    followed: Path | None
    p_min: float
    flows: tuple[RunFlow, ...]  # () for a run of one flow
    prompt_ids: tuple[int, ...]
    rounds: int

    def trace(self, replay: Replayer) -> FlowTrace:
        """The reference's trace: each flow of a run of several replayed alone, else the one flow
        (followed, guided by the run's rounds, or deciding every round)."""
        with torch.no_grad(), followed_errors(self.followed):
            if len(self.flows) > 1:  # a run of several requests or sequences: each flow replayed alone
                return flows_trace(
                    self.flows,
                    self.followed is not None,
                    lambda f, n, fol, gui: replay(
                        f.info.prompt_tokens, n, fol, gui, f.info.flow, f.info.n_cached, f.info.draft_cached
                    ),
                )
            guide = guided_rounds(self.run, self.prompt_ids) if self.run is not None and self.plan is None else None
            return replay(self.prompt_ids, self.rounds, self.plan.rounds if self.plan is not None else None, guide)


def read_replay(
    target: Path,
    model: Path,
    prompt: str | None,
    tokens: str | None,
    rounds: int,
    dtype: str,
    device: str,
    kv_dtype: str,
    llama_dir: Path | None,
    block: int | None,
    run: Path | None,
    p_min: float | None,
    follow: Path | None,
) -> Replay:
    """The options of `featdiff reference` (every kind's), checked and read with the run they name."""
    numerics = numerics_from_options(dtype, device, kv_dtype)
    plan = followed_run(Path(follow), prompt, tokens, block, run) if follow is not None else None
    read = Path(follow) if follow is not None else Path(run) if run is not None else None
    flows = run_flows(read) if read is not None else ()
    return Replay(
        numerics=numerics,
        plan=plan,
        run=read,
        followed=Path(follow) if follow is not None else None,
        p_min=p_min if p_min is not None else run_p_min(read),
        flows=flows,
        prompt_ids=tuple(reference_prompt(flows, plan, target, model, prompt, tokens, llama_dir)),
        rounds=len(plan.rounds) if plan is not None else rounds,
    )


@contextmanager
def followed_errors(follow: Path | None) -> Iterator[None]:
    """A run `--follow` cannot replay (replay.FollowError) as the one-line InputError naming it."""
    try:
        yield
    except FollowError as e:
        raise InputError(f"{follow}: --follow cannot replay this run: {e}; compare it without --follow") from None


@dataclass(frozen=True)
class RunFlow:
    """One flow of a run dump of several (docs/flow.md "Several flows"): what it decoded."""

    info: FlowInfo
    rounds: tuple[Round, ...]


def run_flows(run: Path) -> tuple[RunFlow, ...]:
    """The flows of the run dump `run`, each with its rounds; () for a run of one flow."""
    with read_dump(run) as dump:
        m = dump.manifest
    ids = m.flow_ids()
    if len(ids) < 2:
        return ()
    return tuple(RunFlow(m.flow_info(k), tuple(r for r in m.rounds if r.flow == k)) for k in ids)


def reference_prompt(
    flows: tuple[RunFlow, ...],
    plan: FollowedRun | None,
    target: Path,
    model: Path,
    prompt: str | None,
    tokens: str | None,
    llama_dir: Path | None,
) -> tuple[int, ...]:
    """The prompt a reference replays: a run of several flows' longest replayable one (each flow
    is replayed with its own, flows_trace), else the followed run's, else `--prompt`/`--tokens`."""
    if len(flows) > 1 and prompt is None and tokens is None:
        return replayed_prompt(flows)
    return plan.prompt if plan is not None else prompt_tokens(Path(target), Path(model), prompt, tokens, llama_dir)


def replayed_prompt(flows: tuple[RunFlow, ...]) -> tuple[int, ...]:
    """The longest prompt of the run's flows a reference can replay (what the checks of a prompt's
    length and tokens see); InputError naming the first flow when none can be."""
    why = [f.info.why_unreplayable() for f in flows]
    if all(why):
        more = f" (and {len(why) - 1} more)" if len(why) > 1 else ""
        raise InputError(f"no flow of the run can be replayed: {why[0]}{more}")
    return max((f.info.prompt_tokens for f, w in zip(flows, why) if not w), key=len)


def flows_trace(
    flows: tuple[RunFlow, ...],
    follow: bool,
    replay: Callable[[RunFlow, int, tuple[Round, ...] | None, tuple[Round, ...] | None], FlowTrace],
) -> FlowTrace:
    """Each flow of the run replayed from a fresh state by its kind's flow, `replay(flow, rounds,
    followed rounds, guiding rounds)` (its cached prompt positions as warm-up evals), following
    its rounds (`follow`) or guided by them (`--run`), as one trace: evals numbered on, each with
    its flow."""
    evals: list[EvalTrace] = []
    rounds: list[Round] = []
    why = [f.info.why_unreplayable() for f in flows]  # replayed_prompt refused a run with none
    for f, unreplayable in zip(flows, why):
        if unreplayable:  # compare names it (information) and compares the other flows
            log.warning("%s; the reference leaves it out", unreplayable)
            continue
        n_rounds = len(f.rounds) if follow else sum(1 for r in f.rounds if r.drafts)
        trace = replay(f, n_rounds, f.rounds if follow else None, None if follow else f.rounds)
        evals += [
            EvalTrace(replace(et.eval, eval=len(evals) + i, flow=f.info.flow), et.records)
            for i, et in enumerate(trace.evals)
        ]
        rounds += [replace(r, flow=f.info.flow) for r in trace.rounds]
    return FlowTrace(tuple(evals), tuple(rounds))


@dataclass(frozen=True)
class FollowedRun:
    """What `--follow` replays of a run dump: its prompt and its speculative rounds."""

    prompt: tuple[int, ...]
    rounds: tuple[Round, ...]


def followed_run(
    run: Path, prompt: str | None, tokens: str | None, block: int | None, also_run: Path | None
) -> FollowedRun:
    """The run dump `run` as a plan to replay; InputError for options it replaces, or a dump that
    holds no flow to follow. `--block` stays where the run decoded no draft block that ran (a
    program that failed at its first draft: nothing says how long its blocks were)."""
    with read_dump(run) as dump:
        m = dump.manifest
    # a step drafter's steps may differ in length (chained MTP heads re-decode the round's rows): its block is its verify
    steps = kinds.of_arch(m.models.get(names.ROLE_DRAFT, {}).get("architecture")).row_token is not None
    has_block = run_block_rows(m.evals, str(run), steps) is not None
    given = [
        flag
        for flag, value in (("--prompt", prompt), ("--tokens", tokens), ("--block", block), ("--run", also_run))
        if value is not None and (flag != "--block" or has_block)
    ]
    if given:
        raise InputError(
            f"--follow {run} takes the prompt, the rounds and the draft blocks from the run; drop {', '.join(given)}"
        )
    if not m.prompt_tokens:
        raise InputError(
            f"{run}: no prompt tokens to follow (the program decoded nothing featdiff recorded); --follow "
            "replays a capture's flow: capture the run again, or pass --tokens and --rounds instead"
        )
    if not m.rounds and names.ROLE_DRAFT not in m.models:  # e.g. llama-server started without -md
        raise InputError(
            f"{run}: the run loaded no drafter (its program had no -md), so it drafted nothing to follow or "
            "compare; capture it again with the drafter (-md D.gguf and its --spec-type)"
        )
    if not m.rounds:
        raise InputError(
            f"{run}: no speculative round to follow (the program stopped before its first draft); make the "
            f"reference of its prompt instead: --tokens {','.join(map(str, m.prompt_tokens))} --rounds 1 "
            "in place of --follow"
        )
    return FollowedRun(tuple(m.prompt_tokens), tuple(m.rounds))


def guided_rounds(run: Path, prompt: tuple[int, ...]) -> tuple[Round, ...]:
    """The run dump's rounds, for the reference to take where its own choice parts from them;
    () when the run decoded another prompt (its rounds say nothing about this one's)."""
    with read_dump(run) as dump:
        m = dump.manifest
    return tuple(m.rounds) if tuple(m.prompt_tokens) == tuple(prompt) else ()


def trained_context_of(target: Path) -> int | None:
    """The positions the target was trained on: its GGUF's `{arch}.context_length`, its HF
    config.json's `max_position_embeddings`; None when it does not say."""
    if not target.is_dir():
        return trained_context(read_gguf(target, ggml_dequant.load))
    n = read_config(target).get(names.HF_MAX_POSITIONS)
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InputError(
            f"{target / names.HF_CONFIG}: {names.HF_MAX_POSITIONS} = {n!r}, expected a positive "
            "integer (the trained context length); fix config.json"
        )
    return n


def run_p_min(run: Path | None) -> float:
    """The `--spec-draft-p-min` the run dump `run` drafted with (its build's `p_min`), else 0."""
    if run is None:
        return 0.0
    with read_dump(run) as dump:
        return dump.manifest.build_info.p_min


def numerics_from_options(dtype: str, device: str, kv_dtype: str) -> Numerics:
    """Validated `--dtype`, `--device`, `--kv-dtype`."""
    if dtype not in COMPUTE_DTYPES:
        raise InputError(f"--dtype {dtype!r}: expected one of {', '.join(COMPUTE_DTYPES)}")
    if kv_dtype not in KV_DTYPES:
        raise InputError(f"--kv-dtype {kv_dtype!r}: expected one of {', '.join(KV_DTYPES)} (the run's KV cache type)")
    try:
        dev = torch.device(device)
        torch.zeros(1, device=dev)
    except (RuntimeError, AssertionError) as e:
        raise InputError(
            f"--device {device!r}: unusable by this torch {torch.__version__} ({e}); use --device cpu"
        ) from None
    return Numerics(dtype=COMPUTE_DTYPES[dtype], device=dev, kv_dtype=kv_dtype)


def prompt_tokens(
    target: Path, model: Path, prompt: str | None, tokens: str | None, llama_dir: Path | None
) -> tuple[int, ...]:
    """The prompt's token ids, from exactly one of `--prompt` / `--tokens`."""
    require_one(prompt, tokens)
    return parse_tokens(tokens) if tokens is not None else _tokenize(target, model, prompt or "", llama_dir)


def _tokenize(target: Path, model: Path, text: str, llama_dir: Path | None) -> tuple[int, ...]:
    """Tokenize with llama.cpp's vocabulary of the target GGUF, else the drafter GGUF."""
    vocab = next((p for p in (target, model) if p.is_file()), None)
    if vocab is None:
        raise InputError(
            f"--prompt needs a GGUF vocabulary, but {target} and {model} are HF directories; "
            "pass --tokens or a GGUF target"
        )
    try:
        from featdiff.llama.tokenize import tokenize
    except ImportError as e:
        raise InputError(
            f"--prompt needs the llama.cpp binding (featdiff.llama.tokenize: {e}); pass --tokens"
        ) from None
    return tuple(int(t) for t in tokenize(vocab, text, llama_dir))


def write_reference(
    output: Path,
    trace: FlowTrace,
    target: Target,
    draft: Draft | None,
    numerics: Numerics,
    prompt: tuple[int, ...],
    block_rows: int,
    p_min: float = 0.0,
    followed: Path | None = None,
    flows: tuple[FlowInfo, ...] = (),
    draft_entry: dict | None = None,
) -> Path:
    """Write the flow's records and manifest as a dump v1 with source "reference"; `build` says
    how it was computed, with the rows of its draft blocks. `draft_entry`: the drafter's manifest
    entry where `draft` is another kind's (featdiff.kinds), which describes itself."""
    writer = DumpWriter(output)
    for et in trace.evals:
        e = et.eval
        for named in et.records:
            key = record_key(e.eval, e.role, named.name, 0)
            record, array = record_from_array(
                key, e.role, e.phase, e.eval, named.name, 0, named.array.detach().cpu().numpy()
            )
            writer.add(record, array)
    build = {
        "torch": torch.__version__,
        "device": str(numerics.device),
        "dtype": str(numerics.dtype).removeprefix("torch."),
        "kv_dtype": numerics.kv_dtype,
        "block_rows": block_rows,
        "p_min": p_min,
    }
    if followed is not None:
        build["follow"] = str(followed)  # the run dump whose decisions this reference replayed
    manifest = Manifest(
        source="reference",
        models={"target": models_entry(target), "draft": _draft_entry(draft, draft_entry)},
        build=build,
        evals=tuple(et.eval for et in trace.evals),
        records=(),
        rounds=trace.rounds,
        prompt_tokens=flows[0].prompt_tokens if flows else prompt,
        flows=flows,
    )
    return writer.close(manifest)


def _draft_entry(draft: Draft | None, entry: dict | None) -> dict:
    """The drafter's manifest entry: the one given (a kind that describes its own drafter), else
    the DFlash drafter's."""
    if entry is not None:
        return entry
    if draft is None:
        raise ValueError("write_reference needs the drafter or its manifest entry")
    return models_entry(draft)


# --- the accept probe's side of the DFlash kind (featdiff.verdict.probe, through featdiff.kinds) ---------


def load_pair_draft(target: Target, model: Path, numerics: Numerics) -> Draft:
    """The drafter at `model` (GGUF or HF directory), checked against `target`."""
    draft = load_draft(Path(model), numerics.dtype, numerics.device)
    check_pair(target, draft)
    return draft


def probe_round(target: Target, draft: Draft, prompt: tuple[int, ...], numerics: Numerics, block_rows: int) -> Round:
    """The reference's one round after `prompt`: its draft block of `block_rows` rows, verified."""
    return run_flow(target, draft, prompt, 1, numerics, block_rows=block_rows).rounds[0]
