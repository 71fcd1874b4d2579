"""`featdiff probe`: greedy accept rates of the real speculative loop (in-process driver, or
llama-server under the preload) next to the reference drafter's, on the same target tokens.

Consumes a GGUF pair, the reference's models and prompts; produces a `Probe` of rounds. The
reference is teacher-forced: for each run round it drafts once after the run's own tokens up to
that round's anchor, with draft blocks as long as the run's (in-process: `--draft-max` + 1 rows;
through llama-server: the length of its own draft decodes), so the two sides' accepts differ
only where their drafts do. Where the run sampled its target's tokens (a capture's `samplers`),
the reference's accept is the expected count under the run's sampler (`expected_ref_accepted`).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from featdiff.core import names
from featdiff.core.blocks import DEFAULT_DRAFT_MAX
from featdiff.core.errors import InputError
from featdiff.core.filters import capture_filters
from featdiff.core.phases import Phase
from featdiff.dump.blocks import run_block_rows
from featdiff.dump.records import Eval, Round
from featdiff.dump.sampling import Sampler, chain_probs, expected_accepted

log = logging.getLogger(__name__)

DEFAULT_ROUNDS = 6  # in-process: rounds per prompt
DEFAULT_N_PREDICT = 16  # through llama-server: tokens per request
DEFAULT_PROMPTS = ("The quick brown fox jumps over the lazy dog.", "Speculative decoding drafts tokens in blocks.")
TOKENS_PREFIX = "tokens:"  # a prompts-file line `tokens: 1,2,3` gives token ids instead of text
PROBE_FILTERS = (f"target:{names.RESULT_OUTPUT}",)  # the last verify's greedy tokens; nothing else is needed


@dataclass(frozen=True)
class Prompt:
    """One probe prompt: text (tokenized by llama.cpp) or token ids."""

    text: str | None = None
    tokens: tuple[int, ...] | None = None

    @property
    def label(self) -> str:
        return self.text if self.text is not None else TOKENS_PREFIX + ",".join(map(str, self.tokens or ()))


@dataclass(frozen=True)
class RoundPair:
    """One run round and what the reference drafter does at the same place."""

    pos0: int
    run_drafts: tuple[int, ...]
    ref_drafts: tuple[int, ...]
    run_accepted: int
    # the reference's accepted drafts: greedy, a count; where the run sampled, the expected count
    # under the run's sampler (`expected_ref_accepted`)
    ref_accepted: float

    @property
    def drafts_differ(self) -> bool:
        return self.run_drafts != self.ref_drafts


@dataclass(frozen=True)
class AcceptStats:
    """Accept figures over some rounds (verify steps)."""

    rounds: int
    drafted: int
    accepted: float  # a count, or a sum of expected counts (the reference of a sampled run)

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verify step, counting the target's own token (llama-server's "mean len")."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0


@dataclass(frozen=True)
class PromptProbe:
    """The probe of one prompt: the tokens the run decoded and its rounds, both sides."""

    label: str
    prompt_tokens: tuple[int, ...]
    rounds: tuple[RoundPair, ...]
    server_draft_n: int | None = None  # what llama-server itself reported, when probed through it
    server_draft_n_accepted: int | None = None

    @property
    def run(self) -> AcceptStats:
        return _stats(self.rounds, lambda r: (len(r.run_drafts), r.run_accepted))

    @property
    def ref(self) -> AcceptStats:
        return _stats(self.rounds, lambda r: (len(r.ref_drafts), r.ref_accepted))


@dataclass(frozen=True)
class Probe:
    prompts: tuple[PromptProbe, ...]

    @property
    def run(self) -> AcceptStats:
        return _total([p.run for p in self.prompts])

    @property
    def ref(self) -> AcceptStats:
        return _total([p.ref for p in self.prompts])

    @property
    def has_gap(self) -> bool:
        """Whether run and reference accept differently in any round."""
        return any(r.run_accepted != r.ref_accepted for p in self.prompts for r in p.rounds)


def _stats(rounds: tuple[RoundPair, ...], pick) -> AcceptStats:
    drafted_accepted = [pick(r) for r in rounds if r.run_drafts]  # draftless verifies are no draft
    return AcceptStats(len(drafted_accepted), sum(d for d, _ in drafted_accepted), sum(a for _, a in drafted_accepted))


def _total(stats: list[AcceptStats]) -> AcceptStats:
    return AcceptStats(sum(s.rounds for s in stats), sum(s.drafted for s in stats), sum(s.accepted for s in stats))


def exit_code(probe_result: Probe) -> int:
    """1 when run and reference accept differently somewhere (a wiring gap), else 0."""
    return 1 if probe_result.has_gap else 0


# ---------------------------------------------------------------- prompts


def read_prompts(path: Path | None) -> tuple[Prompt, ...]:
    """One prompt per non-empty line of `path` (`tokens: 1,2,3` for ids); DEFAULT_PROMPTS without one."""
    from featdiff.core.tokens import parse_tokens

    if path is None:
        return tuple(Prompt(text=t) for t in DEFAULT_PROMPTS)
    lines = [ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip()]
    if not lines:
        raise InputError(f"{path}: no prompts; expected one prompt per line (or `{TOKENS_PREFIX} 1,2,3`)")
    return tuple(
        Prompt(tokens=tuple(parse_tokens(ln[len(TOKENS_PREFIX) :])))
        if ln.startswith(TOKENS_PREFIX)
        else Prompt(text=ln)
        for ln in lines
    )


# ---------------------------------------------------------------- run side


@dataclass(frozen=True)
class RunTrace:
    """What the run decoded for one prompt: its prompt tokens and rounds."""

    label: str
    prompt_tokens: tuple[int, ...]
    rounds: tuple[Round, ...]
    block_rows: int | None  # rows of the run's draft blocks; None: it decoded no draft block
    server_draft_n: int | None = None
    server_draft_n_accepted: int | None = None
    sampler: Sampler | None = None  # how the run sampled its target's tokens; None: greedily


def run_in_process(
    target: Path, model: Path, prompts: tuple[Prompt, ...], rounds: int, llama_dir: Path | None, draft_max: int
) -> tuple[RunTrace, ...]:
    """Each prompt through the in-process DFlash driver, `rounds` rounds of `draft_max` drafts
    (clamped as llama.cpp clamps them), nothing captured."""
    from featdiff.driver.capture import DEFAULT_OPTIONS, flow_config, free_models, load_models
    from featdiff.kinds.preflight import preflight
    from featdiff.llama import ggml_dequant
    from featdiff.llama.runtime import Runtime

    preflight(Path(model), Path(target), rounds=rounds, draft_max=draft_max, ggml=ggml_dequant.load)
    rt = Runtime.load(llama_dir)
    tgt_model, dft_model = models = load_models(rt, Path(target), Path(model), DEFAULT_OPTIONS)
    try:
        cfg = flow_config(dft_model, draft_max)
        return tuple(_run_prompt(rt, tgt_model, dft_model, p, rounds, cfg) for p in prompts)
    finally:
        free_models(models)


def _run_prompt(rt, tgt_model, dft_model, prompt: Prompt, rounds: int, cfg) -> RunTrace:
    from featdiff.driver import rounds as driver_rounds
    from featdiff.driver.capture import driver_of, new_contexts, prompt_ids

    tokens = ",".join(map(str, prompt.tokens)) if prompt.tokens is not None else None
    ids = prompt_ids(tgt_model, prompt.text, tokens)
    tgt, dft = new_contexts(rt, (tgt_model, dft_model), len(ids), rounds, cfg)
    try:
        done = driver_of(cfg).run_flow(tgt, dft, ids, rounds, cfg, driver_rounds.NullRecorder())
    finally:
        dft.free()
        tgt.free()
    return RunTrace(prompt.label, tuple(ids), tuple(done), cfg.block_rows)


def run_through_server(
    command: list[str], prompts: tuple[Prompt, ...], n_predict: int, llama_dir: Path | None
) -> tuple[RunTrace, ...]:
    """Each prompt as one greedy request to llama-server under the preload; rounds from its decodes."""
    from featdiff.programs import exec as exec_capture
    from featdiff.programs import server
    from featdiff.programs.phases import one_token_steps
    from featdiff.programs.preload import build_of_program, preload

    exec_capture.program_path(command)
    if not server.is_server(command):
        raise InputError(
            f"{command[0]}: probe --exec drives llama-server (one request per prompt); give a llama-server command"
        )
    requests = [
        server.CompletionRequest(p.text if p.text is not None else tuple(p.tokens or ()), n_predict) for p in prompts
    ]
    with tempfile.TemporaryDirectory(prefix="featdiff-probe-") as work:
        prefix = Path(work) / "probe.spool"
        built = build_of_program(exec_capture.program_path(command), llama_dir)
        answers = server.serve(command, preload(prefix, capture_filters(PROBE_FILTERS), built), requests, prefix)
        flow = exec_capture.read_flow(prefix)
    parts = split_requests(flow.evals)
    if len(parts) != len(prompts):
        raise InputError(
            f"{command[0]}: {len(prompts)} requests but {len(parts)} prompts decoded from position 0; is the prompt cache on?"
        )
    block_rows = run_block_rows(flow.evals, command[0], one_token_steps(flow.log))  # what --spec-draft-n-max made of it
    return tuple(_trace_of(p, part, flow.rounds, a, block_rows) for p, part, a in zip(prompts, parts, answers))


def split_requests(evals: tuple[Eval, ...]) -> list[tuple[Eval, ...]]:
    """The real evals of each request, in order: one flow each (docs/flow.md "Several flows")."""
    real = [e for e in evals if e.phase != Phase.WARMUP]
    return [tuple(e for e in real if e.flow == k) for k in dict.fromkeys(e.flow for e in real)]


def _trace_of(
    prompt: Prompt, part: tuple[Eval, ...], rounds: tuple[Round, ...], answer, block_rows: int | None
) -> RunTrace:
    from featdiff.programs.exec import prompt_from_evals

    mine = tuple(r for r in rounds if r.flow == part[0].flow)
    return RunTrace(prompt.label, prompt_from_evals(part), mine, block_rows, answer.draft_n, answer.draft_n_accepted)


# ---------------------------------------------------------------- reference side


def contexts(trace: RunTrace) -> tuple[tuple[int, ...] | None, ...]:
    """Per run round: the run's tokens up to and including the one at its `pos0` (what the
    reference drafts after), or None where the run's earlier rounds do not reach `pos0`.

    The tokens are the prompt, then each round's target tokens after the token at its `pos0`.
    A round's recorded `anchor` is what the run's drafter read, not necessarily the token there:
    a wiring fault (a masked or stale anchor) is compare's `block_token`, and the probe still
    teacher-forces the reference on the run's own tokens. A round that starts past the tokens
    known (positions the run skipped) cannot be paired: None, and the rounds after it chain
    from wherever the run went on (a program that rewinds starts a round inside what it knows).
    """
    out: list[int] = list(trace.prompt_tokens)
    known: list[tuple[int, ...] | None] = []
    for r in trace.rounds:
        if not 0 <= r.pos0 < len(out):
            known.append(None)
            continue
        del out[r.pos0 + 1 :]  # a round that starts inside the known tokens rewinds to its pos0
        known.append(tuple(out))
        out += r.target_tokens
    return tuple(known)


def reference_rounds(trace: RunTrace, ref_target, ref_draft, numerics, flow=None) -> tuple[RoundPair, ...]:
    """Per run round that the probe can place (`contexts`): the reference drafter's block at the
    same position, after the same tokens (`flow`: the reference module of the drafter's kind,
    featdiff.kinds; default DFlash's). A round it cannot place is left out of the pairs."""
    import torch

    from featdiff.torchref.dflash import run as dflash_reference

    flow = flow or dflash_reference
    out = []
    with torch.no_grad():
        for r, tokens in zip(trace.rounds, contexts(trace)):
            if tokens is None:
                log.info(
                    "%s: round %d at %d follows no known tokens of the run; not probed", trace.label, r.round, r.pos0
                )
                continue
            if not r.drafts:  # a verify of no drafts: nothing to draft on either side
                out.append(RoundPair(r.pos0, (), (), 0, 0))
                continue
            ref = flow.probe_round(ref_target, ref_draft, tokens, numerics, _block_rows(trace))
            n = len(r.drafts)  # the same budget: upstream truncates a draft to what fits
            accepted: float = min(ref.accepted, n)
            if trace.sampler is not None:
                accepted = expected_ref_accepted(ref_target, tokens, ref.drafts[:n], numerics, trace.sampler)
            out.append(RoundPair(r.pos0, r.drafts, ref.drafts[:n], r.accepted, accepted))
    return tuple(out)


def expected_ref_accepted(ref_target, tokens: tuple[int, ...], drafts: tuple[int, ...], numerics, s: Sampler) -> float:
    """The drafts the run's sampler would accept on average where the reference target verifies
    `drafts` after `tokens`: llama.cpp samples the target's token at each verify row through the
    chain and keeps drafts while the sample equals the draft (common_sampler_sample_and_accept_n),
    so E[accepted] = sum_k prod_{j <= k} p_j(draft_j), p_j the chain's probabilities at row j."""
    import torch

    from featdiff.torchref.attention import empty_cache
    from featdiff.torchref.target import forward_target

    hp = ref_target.hparams
    seq = (*tokens, *drafts)
    ids = torch.tensor(seq, dtype=torch.int64, device=numerics.device)
    positions = torch.arange(len(seq), dtype=torch.int64, device=numerics.device)
    cache = empty_cache(hp.n_layer, hp.n_head_kv, hp.n_embd_head, numerics.kv_dtype, numerics.device)
    logits = forward_target(ref_target, ids, positions, cache, True).logits  # (len(seq), n_vocab)
    rows = logits[len(tokens) - 1 : len(tokens) - 1 + len(drafts)].double().cpu().numpy()  # (n_drafts, n_vocab)
    return expected_accepted([float(chain_probs(rows[j], s)[d]) for j, d in enumerate(drafts)])


def _block_rows(trace: RunTrace) -> int:
    if trace.block_rows is None:
        raise RuntimeError(f"{trace.label}: a round with drafts but no draft block of the run")
    return trace.block_rows


# ---------------------------------------------------------------- the probe


def probe(
    target: Path,
    model: Path,
    *,
    prompts: Path | None = None,
    rounds: int = DEFAULT_ROUNDS,
    ref_target: Path | None = None,
    ref_model: Path | None = None,
    command: list[str] | None = None,
    n_predict: int = DEFAULT_N_PREDICT,
    dtype: str = "float32",
    kv_dtype: str = "f16",
    llama_dir: Path | None = None,
    draft_max: int | None = None,
    layer_ids_mean: str | None = None,
) -> Probe:
    """Run the accept-rate probe; see the module docstring. `draft_max` (in-process only; default
    llama.cpp's `--spec-draft-n-max` default) sets the drafts per block."""
    chosen = read_prompts(prompts)
    if command and draft_max is not None:
        raise InputError(
            f"--draft-max {draft_max} drives the in-process run; with --exec pass --spec-draft-n-max "
            "in the llama-server command line instead"
        )
    if command:
        traces = run_through_server(command, chosen, n_predict, llama_dir)
    else:
        traces = run_in_process(
            target, model, chosen, rounds, llama_dir, DEFAULT_DRAFT_MAX if draft_max is None else draft_max
        )
    return probe_traces(traces, Path(ref_target or target), Path(ref_model or model), dtype, kv_dtype, layer_ids_mean)


def probe_traces(
    traces: tuple[RunTrace, ...],
    ref_target: Path,
    ref_model: Path,
    dtype: str = "float32",
    kv_dtype: str = "f16",
    layer_ids_mean: str | None = None,
) -> Probe:
    """The probe of runs already made: each trace's rounds beside the reference drafter's
    (`layer_ids_mean`: what an EAGLE3 HF checkpoint's ids name, where it cannot tell)."""
    from featdiff.torchref.dflash.run import numerics_from_options
    from featdiff.torchref.kind import drafter_kind, drafter_options
    from featdiff.torchref.load import load_target

    numerics = numerics_from_options(dtype, "cpu", kv_dtype)
    flow = drafter_kind(Path(ref_model)).reference_module()
    ref_t = load_target(ref_target, numerics.dtype, numerics.device)
    ref_d = flow.load_pair_draft(ref_t, ref_model, numerics, **drafter_options(Path(ref_model), layer_ids_mean))
    return Probe(
        tuple(
            PromptProbe(
                t.label,
                t.prompt_tokens,
                reference_rounds(t, ref_t, ref_d, numerics, flow),
                t.server_draft_n,
                t.server_draft_n_accepted,
            )
            for t in traces
        )
    )


def render_probe(result: Probe) -> str:
    """The probe as a plain-text table: one line per prompt, then the total."""
    head = f"{'prompt':40s} {'run drafted/accepted  mean len':>30s} {'ref drafted/accepted  mean len':>31s}  rounds with other drafts"
    lines = [head]
    for p in result.prompts:
        other = [str(i + 1) for i, r in enumerate(p.rounds) if r.drafts_differ]
        lines.append(f"{_short(p.label):40s} {_fmt(p.run):>30s} {_fmt(p.ref):>31s}  {','.join(other) or '-'}")
    lines.append(f"{'overall':40s} {_fmt(result.run):>30s} {_fmt(result.ref):>31s}")
    verdict = (
        "GAP: run and reference accept differently; compare a capture against the reference to find why"
        if result.has_gap
        else "agree: run and reference accept the same drafts"
    )
    return "\n".join(lines + [verdict])


def _fmt(s: AcceptStats) -> str:
    return f"{s.drafted:4d} / {s.accepted:4.4g}  ({s.rate:6.1%})  {s.mean_accepted_length:5.2f}"


def _short(label: str, width: int = 40) -> str:
    return label if len(label) <= width else label[: width - 3] + "..."
