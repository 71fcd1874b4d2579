"""The round machinery every in-process driver shares: recording evals, opening and closing a round, the
target's rollback and a step drafter's drafts (upstream common/speculative.cpp)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.phases import FIRST_ROUND, ROLE_OF, Phase
from featdiff.dump.records import Eval, Round
from featdiff.llama.runtime import Context


class Recorder(Protocol):
    """Told about each eval before it runs, and each round once it is decided."""

    def begin_eval(self, ev: Eval) -> None: ...

    def end_round(self, rnd: Round) -> None: ...

    def readback(self, name: str, rows: np.ndarray) -> None: ...


class NullRecorder:
    """Records nothing: the flow alone, for benchmarks."""

    def begin_eval(self, ev: Eval) -> None:
        pass

    def end_round(self, rnd: Round) -> None:
        pass

    def readback(self, name: str, rows: np.ndarray) -> None:
        pass


class EvalCounter(Protocol):
    """A flow's state as far as numbering its evals goes."""

    n_evals: int


def each_round(
    rounds: int, one_round: Callable[[int], Round], on_round: Callable[[], None] | None = None
) -> list[Round]:
    """`rounds` speculative rounds, numbered from FIRST_ROUND, each run by `one_round(r)`; `on_round`
    told after each (progress)."""
    done = []
    for r in range(FIRST_ROUND, FIRST_ROUND + rounds):
        done.append(one_round(r))
        if on_round is not None:
            on_round()
    return done


def open_eval(
    st: EvalCounter,
    rec: Recorder,
    phase: Phase,
    rnd: int,
    positions: list[int],
    tokens: list[int],
    call: str = names.CALL_DECODE,
) -> None:
    """Open the recorder's next eval: a `phase` decode, by the role that runs that phase."""
    rec.begin_eval(
        Eval(
            eval=st.n_evals,
            role=ROLE_OF[phase],
            phase=phase,
            n_tokens=len(positions),
            positions=tuple(positions),
            token_ids=tuple(tokens),
            seq_ids=(0,) * len(positions),
            round=rnd,
            call=call,
        )
    )
    st.n_evals += 1


def features(tgt: Context, layers: tuple[int, ...], n_tokens: int) -> np.ndarray:
    """Token-major feature rows of the last target batch: (n_tokens, n_extract * n_embd_tgt)."""
    return np.concatenate([tgt.layer_input(L, n_tokens) for L in layers], axis=1)  # (n_tokens, n_extract * n_embd_tgt)


def close_round(
    rec: Recorder, rnd: int, pos0: int, anchor: int, drafts: list[int], accepted: int, target_tokens: list[int]
) -> Round:
    """The round as decided (the target tokens it keeps: up to the first rejected draft's), told
    to the recorder."""
    rnd_rec = Round(
        round=rnd,
        pos0=pos0,
        anchor=anchor,
        drafts=tuple(drafts),
        accepted=accepted,
        target_tokens=tuple(target_tokens[: accepted + 1]),
    )
    rec.end_round(rnd_rec)
    return rnd_rec


def rollback(tgt: Context, n_past: int, n_rejected: int) -> None:
    """The rejected rows out of the target's memory. A hybrid target's recurrent state rolls
    back through the per-token snapshots its context keeps (n_rs_seq, set to the draft length
    as upstream's common.cpp does; llama-memory-recurrent.cpp seq_rm restores the snapshot
    `n_rejected` back); a memory that refuses would keep the rejected rows' state, and the next
    verify would run on it, so the flow stops naming it (tools/server falls back to a state
    checkpoint and a replay of the accepted rows there, which this flow does not model)."""
    if not tgt.seq_rm(n_past) and n_rejected > 0:
        raise InputError(
            f"{tgt.model.path}: llama.cpp could not roll the target's recurrent state back {n_rejected} rejected "
            "rows (llama_memory_seq_rm refused: its n_rs_seq snapshots do not reach, or llama.cpp keeps none for "
            "this architecture, llm_arch_supports_rs_rollback: qwen3next); featdiff's in-process flow runs a hybrid "
            "target only where llama.cpp rolls it back (a build with n_rs_seq, an arch with snapshots); capture the "
            "program around it instead (capture --exec)"
        )


# --- the kinds that draft one token per decode (EAGLE3, MTP) --------------------------------------
SAMPLER_TOP_K = 10  # their drafters' samplers (common/speculative.cpp): top-k 10, then the top-1


class StepConfig(Protocol):
    """What the draft steps read of a kind's flow config."""

    @property
    def p_min(self) -> float: ...

    @property
    def draft_max(self) -> int: ...


def step_drafts(
    dft: Context,
    st: EvalCounter,
    rec: Recorder,
    cfg: StepConfig,
    rnd: int,
    token: int,
    row: np.ndarray,
    pos: int,
    advance: int = 1,
    width: int | None = None,
) -> list[int]:
    """A round's draft steps of a one-token-per-decode drafter (EAGLE3's, MTP's draft()): `token`
    with the state `row` (n_embd,) at `pos`, then one decode per draft, each with the previous
    step's nextn row (`width` floats, default the drafter's n_embd) `advance` positions on (0: Gemma
    4's assistant drafts every step at `pos`, its rows at the target's width);
    top-1 of the sampler's top 10, stopping below `p_min` or at `draft_max`. Each step's logits
    are recorded as `draft_logits`."""
    drafts: list[int] = []
    while True:
        open_eval(st, rec, Phase.DRAFT, rnd, [pos], [token])
        dft.decode_tokens_embd([token], row[None, :], [pos], outputs=True)
        logits = dft.logits(0)
        rec.readback(names.DRAFT_LOGITS, logits[None, :])  # (1, n_vocab)
        token, p = top1(logits)
        if p < cfg.p_min:
            return drafts
        drafts.append(token)
        if len(drafts) >= cfg.draft_max:
            return drafts
        row, pos = dft.nextn_row(0, width), pos + advance


def top1(logits: np.ndarray) -> tuple[int, float]:
    """The sampler's pick and its probability: the largest logit, softmax over the top 10."""
    top = np.sort(logits.astype(np.float64))[-SAMPLER_TOP_K:]
    p = np.exp(top - top[-1])
    return int(np.argmax(logits)), float(1.0 / p.sum())
