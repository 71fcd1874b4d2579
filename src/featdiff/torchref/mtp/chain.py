"""The reference's replay of a chained MTP flow (common/speculative.cpp `chain_heads`: a drafter
with n_layer_nextn > 1 trained heads and its own memory, MiMo-V2's three), greedy, as
`llama-speculative-simple` drives `common_speculative_impl_draft_mtp`:

* `process()` decodes each target batch once per head (head k: the graph's layer n_layer + k,
  llama_set_nextn_layer_offset), token j with the target's hidden of row j - 1 and the first with
  the pending row, each head into its own layer's cache;
* `draft()`: step k runs head k over the round's rows so far, (id_last, pending row) at n_past and
  (draft t, the state head t made at its step: `chain_h`) at n_past + 1 + t, head k's cache cut
  back to n_past first; the last row is the step's only output (its logits and `h_nextn`, the
  state the next step is handed); at most as many steps as heads (n_max is capped at the count);
* verify and accept as for one head (torchref/mtp/flow.py).

Each step also records, for every head j, the same step under head j (`<record>@head=<j>`: the
candidates diff/detectors/chain.py names a GGUF whose heads are permuted from).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.phases import PREFILL_ROUND, Phase, inject_after
from featdiff.dump.records import Round
from featdiff.torchref.attention import KvCache, truncated
from featdiff.torchref.mtp.flow import _Hidden, _target_eval
from featdiff.torchref.mtp.head import MtpHead, MtpPass, check_mtp_pair, decode, mtp_from_gguf
from featdiff.torchref.mtp.hf import mimo_head_tensors, mtp_from_hf
from featdiff.torchref.mtp.layer import GRAPHS
from featdiff.torchref.numerics import Numerics
from featdiff.torchref.rounds import (
    EvalTrace,
    FlowTrace,
    _empty,
    _eval,
    _ids,
    accept,
    check_plan,
    play_rounds,
    prefill_batches,
    played_round,
)
from featdiff.torchref.stack import Named
from featdiff.torchref.steps import next_token, own_drafts, top1_probability
from featdiff.torchref.target import TargetPass
from featdiff.torchref.weights import Target

# a step's records of its output rows only (mimo2.cpp takes the rows before naming h_nextn)
_OUTPUT_ROWS = (names.H_NEXTN, names.RESULT_OUTPUT)
_HF_HEAD_LAYER = "model.mtp.layers.{k}."  # MiMo-V2's head k (conversion/mimo.py)
_HF_HEAD_RE = re.compile(r"^model\.mtp\.layers\.(\d+)\.")


@dataclass(frozen=True)
class MtpChain:
    """A drafter's chained heads, head k at layer n_layer + k."""

    heads: tuple[MtpHead, ...]

    @property
    def first(self) -> MtpHead:
        return self.heads[0]


@dataclass(frozen=True)
class _State:
    target_cache: KvCache
    caches: tuple[KvCache, ...]  # each head's layer
    n_past: int
    id_last: int
    pending: torch.Tensor  # (1, n_embd)


def n_heads(model: Path) -> int:
    """The MTP heads at `model`: a GGUF's `<arch>.nextn_predict_layers` (0 when absent), a MiMo-V2
    checkpoint's `model.mtp.layers.<k>` (0 for another family's layout: its loader decides)."""
    if Path(model).is_dir():
        from safetensors import safe_open

        found: set[int] = set()
        for f in Path(model).glob("*.safetensors"):
            with safe_open(str(f), framework="numpy") as st:
                found |= {int(m.group(1)) for m in map(_HF_HEAD_RE.match, st.keys()) if m}
        return len(found)
    from featdiff.core.gguf_reader import int_meta, read_gguf

    return int_meta(read_gguf(Path(model)), names.KEY_NEXTN_LAYERS, 0)


def load_chain(
    model: Path, n: int, dtype: torch.dtype, device: torch.device, llama_dir: Path | None = None
) -> MtpChain:
    """The `n` chained heads at `model` (a GGUF, or a MiMo-V2 checkpoint directory)."""
    if Path(model).is_dir():
        return chain_from_hf(model, n, dtype, device)
    return chain_from_gguf(model, n, dtype, device, llama_dir)


def chain_from_gguf(path: Path, n_heads: int, dtype: torch.dtype, device: torch.device, llama_dir=None) -> MtpChain:
    """The GGUF's `n_heads` chained heads, head k at block n_layer + k."""
    return MtpChain(tuple(mtp_from_gguf(path, dtype, device, llama_dir, offset=k) for k in range(n_heads)))


def chain_from_hf(path: Path, n_heads: int, dtype: torch.dtype, device: torch.device) -> MtpChain:
    """A MiMo-V2 checkpoint's heads `model.mtp.layers.<k>`, held as the converter writes them."""
    import json

    from safetensors.torch import load_file

    first = mtp_from_hf(path, dtype, device)
    text = json.loads((Path(path) / names.HF_CONFIG).read_text())
    tensors = {k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    def hf(name: str) -> torch.Tensor:
        if name not in tensors:
            raise InputError(f"{path}: tensor {name} is missing; the checkpoint's MTP head is incomplete")
        return tensors[name].to(dtype=dtype, device=device)

    later = [
        replace(first, il=first.il + k, **mimo_head_tensors(hf, text, _HF_HEAD_LAYER.format(k=k)))
        for k in range(1, n_heads)
    ]
    return MtpChain((first, *later))


def run_chain_flow(
    target: Target,
    chain: MtpChain,
    prompt: tuple[int, ...],
    rounds: int,
    numerics: Numerics,
    *,
    draft_max: int,
    p_min: float = 0.0,
    follow: tuple[Round, ...] | None = None,
    guide: tuple[Round, ...] | None = None,
    cached: int = 0,
    draft_steps: Mapping[int, tuple[int, ...]] | None = None,
    draft_cached: tuple[int, ...] | None = None,
) -> FlowTrace:
    """Prefill `prompt[:-1]` and process it under every head, then `rounds` rounds of chained
    draft / verify / process; draft_max capped at the head count, as the driver caps n_max."""
    for head in chain.heads:
        check_mtp_pair(target, head)
    if len(prompt) < 2:
        raise InputError(f"prompt of {len(prompt)} tokens: an MTP flow needs at least 2 (a prefill and its next token)")
    n_max = min(draft_max, len(chain.heads))
    state, evals = _prefill(target, chain, prompt, numerics, cached)

    def one_round(state: _State, r: int, first_eval: int, plan: Round | None) -> tuple[_State, Round, list[EvalTrace]]:
        steps = draft_steps.get(r) if draft_steps is not None and plan is not None else None
        return _round(target, chain, state, r, first_eval, numerics, n_max, p_min, plan, steps)

    return play_rounds(state, evals, rounds, follow, guide, one_round)


def _is_prenorm(chain: MtpChain) -> bool:
    return GRAPHS[chain.first.hparams.arch].is_prenorm


def _chain_target_eval(
    target: Target,
    chain: MtpChain,
    tokens: tuple[int, ...],
    positions: tuple[int, ...],
    cache: KvCache,
    outputs: bool,
    numerics: Numerics,
) -> tuple[TargetPass, _Hidden, tuple[Named, ...]]:
    """flow._target_eval with the target's records under the names the arch's graph gives them (MtpGraph.trunk_names)."""
    tp, hidden, records = _target_eval(target, tokens, positions, cache, outputs, numerics, _is_prenorm(chain))
    rename = GRAPHS[chain.first.hparams.arch].trunk_names
    return tp, hidden, rename(records) if rename else records


def _prefill(
    target: Target, chain: MtpChain, prompt: tuple[int, ...], numerics: Numerics, cached: int
) -> tuple[_State, list[EvalTrace]]:
    t_cache = _empty(target.hparams, numerics)
    caches = tuple(_empty(h.hparams, numerics) for h in chain.heads)
    pending = torch.zeros((1, chain.first.hparams.n_embd), dtype=numerics.dtype, device=numerics.device)
    evals: list[EvalTrace] = []
    for phase, tokens, positions in prefill_batches(prompt, cached):
        tp, hidden, records = _chain_target_eval(target, chain, tokens, positions, t_cache, False, numerics)
        evals.append(EvalTrace(_eval(len(evals), names.ROLE_TARGET, phase, positions, tokens, PREFILL_ROUND), records))
        caches, traces = _process(
            chain, tokens, positions, hidden.handed, pending, caches, len(evals), inject_after(phase), 0
        )
        evals += traces
        t_cache, pending = tp.cache, hidden.handed[-1:]
    n = len(prompt) - 1
    return _State(t_cache, caches, n, prompt[n], pending), evals


def _process(
    chain: MtpChain,
    tokens: tuple[int, ...],
    positions: tuple[int, ...],
    hidden: torch.Tensor,
    pending: torch.Tensor,
    caches: tuple[KvCache, ...],
    first_eval: int,
    phase: Phase,
    r: int,
) -> tuple[tuple[KvCache, ...], list[EvalTrace]]:
    """process() of one target batch under every head, one eval each: (token j, hidden j - 1),
    each with the same decode under every other head's weights (`@head=<j>`)."""
    handed = torch.cat([pending, hidden[:-1]])  # (n_tokens, n_embd)
    ids, at = _tensor(tokens, handed), _tensor(positions, handed)
    after, traces = [], []
    for k, (head, cache) in enumerate(zip(chain.heads, caches, strict=True)):
        mp = decode(head, ids, handed, at, cache, outputs=False)
        records = (*mp.records, *_other_heads(chain, k, mp, ids, handed, at, caches, outputs=False))
        traces.append(EvalTrace(_eval(first_eval + k, names.ROLE_DRAFT, phase, positions, tokens, r), records))
        after.append(mp.cache)
    return tuple(after), traces


def _tensor(values: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _round(
    target: Target,
    chain: MtpChain,
    state: _State,
    r: int,
    first_eval: int,
    numerics: Numerics,
    n_max: int,
    p_min: float,
    plan: Round | None,
    steps: tuple[int, ...] | None,
) -> tuple[_State, Round, list[EvalTrace]]:
    """One round: chained draft, verify, process under every head, accept."""
    check_plan(plan, state, r)
    traces: list[EvalTrace] = []
    own = _draft(chain, state, r, first_eval, numerics, n_max, p_min, plan, steps, traces)
    drafts = own if plan is None else tuple(plan.drafts)
    verify = (state.id_last,) + drafts
    positions = tuple(range(state.n_past, state.n_past + len(verify)))
    tp, hidden, records = _chain_target_eval(target, chain, verify, positions, state.target_cache, True, numerics)
    traces.append(
        EvalTrace(_eval(first_eval + len(traces), names.ROLE_TARGET, Phase.VERIFY, positions, verify, r), records)
    )
    caches = tuple(truncated(c, state.n_past) for c in state.caches)
    caches, processed = _process(
        chain, verify, positions, hidden.handed, state.pending, caches, first_eval + len(traces), Phase.INJECT, r
    )
    traces += processed
    accepted, best = accept(r, plan, own, drafts, tp.logits)
    i_h = min(accepted, len(verify) - 1)  # accept(): the verify row at the accepted length
    n_past = state.n_past + accepted + 1
    after = _State(
        truncated(tp.cache, n_past),
        tuple(truncated(c, n_past) for c in caches),
        n_past,
        best[accepted],
        hidden.handed[i_h : i_h + 1],
    )
    return after, played_round(r, state, drafts, accepted, best), traces


def _draft(
    chain: MtpChain,
    state: _State,
    r: int,
    first_eval: int,
    numerics: Numerics,
    n_max: int,
    p_min: float,
    plan: Round | None,
    steps: tuple[int, ...] | None,
    traces: list[EvalTrace],
) -> tuple[int, ...]:
    """draft(): step k runs head k over (id_last, pending) and (draft t, chain_h[t + 1]), the
    head's cache from n_past; each step one eval. Returns the reference's own drafts."""
    if steps is not None and not steps:
        return ()
    tokens, rows = [state.id_last], [state.pending]  # chain_h: the pending row, then each step's h_nextn
    picks: list[tuple[int, bool]] = []
    while True:
        k = len(picks)
        positions = tuple(range(state.n_past, state.n_past + k + 1))
        h = torch.cat(rows)  # (k + 1, n_embd)
        ids, at = _ids(tuple(tokens), numerics), _ids(positions, numerics)
        mp = decode(chain.heads[k], ids, h, at, state.caches[k])
        records = (*_last_rows(mp.records), Named(names.DRAFT_LOGITS, mp.logits[-1:]))
        records += _other_heads(chain, k, mp, ids, h, at, state.caches)
        ev = _eval(first_eval + len(traces), names.ROLE_DRAFT, Phase.DRAFT, positions, tuple(tokens), r)
        traces.append(EvalTrace(ev, records))
        picks.append((int(mp.logits[-1].argmax()), top1_probability(mp.logits[-1]) < p_min))
        following = next_token(picks, plan, _last_tokens(steps), n_max)
        if following is None or len(picks) >= len(chain.heads):
            break
        tokens.append(following)
        rows.append(mp.h_nextn[-1:])  # chain_h: the state this step's head made for its last row
    return own_drafts(picks, plan.drafts if plan is not None else None, n_max)


def _last_tokens(steps: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The token each of the run's chained steps decoded last, from its draft evals' tokens in a
    row (step k re-decodes the round's k + 1 tokens: id_last, d0, ..., d(k-1))."""
    if steps is None:
        return None
    last, k, start = [], 0, 0
    while start + k < len(steps):
        last.append(steps[start + k])
        start, k = start + k + 1, k + 1
    return tuple(last)


def _last_rows(records: tuple[Named, ...]) -> tuple[Named, ...]:
    """A step's records with the output-only ones cut to the last row (the step's only output)."""
    return tuple(Named(n.name, n.array[-1:]) if n.name in _OUTPUT_ROWS else n for n in records)


def _other_heads(
    chain: MtpChain,
    k: int,
    own: MtpPass,
    ids: torch.Tensor,
    h: torch.Tensor,
    at: torch.Tensor,
    caches: tuple[KvCache, ...],
    outputs: bool = True,
) -> tuple[Named, ...]:
    """`<record>@head=<j>` of every head j: head k's decode had head j run it, under head k's
    record names, as a GGUF whose block n_layer + k holds head j's tensors computes it (its cache
    then filled by head j's weights too: the reference's cache of head j); head k's own is `own`."""
    out: list[Named] = []
    for j, head in enumerate(chain.heads):
        mp = own if j == k else decode(replace(head, il=chain.heads[k].il), ids, h, at, caches[j], outputs=outputs)
        rows = _last_rows(mp.records) if outputs else mp.records
        out += [
            Named(names.candidate_name(n.name, f"{names.HYP_HEAD}={j}"), n.array)
            for n in rows
            if names.CANDIDATE_SEP not in n.name
        ]
    return tuple(out)
