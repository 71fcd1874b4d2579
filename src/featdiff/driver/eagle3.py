"""The in-process EAGLE3 flow through the real llama.cpp library (docs/flow.md, "EAGLE3").

Mirrors upstream `examples/speculative-simple` with `--spec-type draft-eagle3` and
`common_speculative_impl_draft_eagle3` (common/speculative.cpp), greedy, one sequence:

* after each target decode (the prefill, a verify) `process()`: the target's layer inputs at the
  drafter's three ids, token-major, through the encoder (`llama_process` ENCODE, in chunks of the
  drafter's n_ubatch, every row an output: `fc_out`), then one decoder batch that places (token
  t+1, encoder row t) at position t for every row but the last, which waits as the pending row;
* `draft()`: the pending row is decoded with the freshest target token (the seed), then one token
  per step, each decoded with the previous step's pre-norm state (`eagle3_prenorm`, read from the
  nextn embeddings) at the next position, top-1 of the sampler's top 10, stopping below `p_min`;
* `accept()`: the pending row becomes the verify's row at the accepted length.

Evals carry the DFlash phases (featdiff.core.phases): the seed and the steps are the round's `draft`
evals, the encoder and decoder batches after a target decode its `inject` evals (the encoder's
with call `encode`, placed at the target rows' positions, which it reads the features of).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from featdiff.core import names
from featdiff.core.blocks import accepted_length
from featdiff.core.errors import InputError
from featdiff.core.phases import PREFILL_ROUND, Phase
from featdiff.driver.rounds import Recorder, close_round, each_round, features, open_eval, rollback, step_drafts
from featdiff.dump.records import Round
from featdiff.llama.runtime import Context, Model

N_TARGET_LAYERS = 3  # llama_model_eagle3::load_arch_hparams: exactly three


@dataclass(frozen=True)
class Eagle3Config:
    target_layers: tuple[int, ...]  # layer-input ids (eagle3.target_layers), slot k = target_layers[k]
    draft_max: int  # drafts per round: --spec-draft-n-max
    p_min: float = 0.0  # --spec-draft-p-min: drafting stops below this top-1 probability
    kind: str = "eagle3"

    @property
    def block_rows(self) -> int:
        """The positions one round may reach past n_past: the verify's anchor and drafts."""
        return self.draft_max + 1

    @property
    def noncausal_rows(self) -> int:
        return 0  # every EAGLE3 batch is causal


def flow_config(draft: Model, draft_max: int, p_min: float = 0.0) -> Eagle3Config:
    """The settings common_speculative_impl_draft_eagle3 reads from the drafter."""
    layers = tuple(draft.target_layer_ids())
    if len(layers) != N_TARGET_LAYERS:
        raise InputError(
            f"{draft.path}: {names.KEY_EAGLE3_TARGET_LAYERS} holds {len(layers)} ids, EAGLE3 reads exactly "
            f"{N_TARGET_LAYERS}; re-convert the drafter"
        )
    if draft_max < 1:
        raise InputError(f"--draft-max {draft_max}: expected >= 1 draft per round (llama.cpp's --spec-draft-n-max)")
    return Eagle3Config(layers, draft_max, p_min)


def enable(tgt: Context, dft: Context, cfg: Eagle3Config) -> None:
    """What common_speculative_impl_draft_eagle3's constructor switches on: the target's layer
    inputs at the drafter's ids, and the drafter's pre-norm rows (the encoder's output, the
    decoder's recycled state). An id equal to the target's layer count reads the target's nextn
    state, which featdiff does not model: preflight refuses it before this."""
    lib = tgt.rt.lib
    for layer in cfg.target_layers:
        lib.fd_set_embeddings_layer_inp(tgt.ptr, layer, True)
    lib.fd_set_embeddings_nextn(dft.ptr, True, True)


@dataclass
class _State:
    n_past: int
    id_last: int
    pending_pos: int = -1  # the deferred boundary: its position and encoder row
    pending_g: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    n_evals: int = 0


def run_flow(
    tgt: Context, dft: Context, prompt: list[int], rounds: int, cfg: Eagle3Config, rec: Recorder, on_round=None
) -> list[Round]:
    """Prefill, then `rounds` x (draft, verify, process); return the rounds."""
    st = _State(n_past=len(prompt) - 1, id_last=prompt[-1])
    positions = list(range(st.n_past))
    open_eval(st, rec, Phase.PREFILL, PREFILL_ROUND, positions, prompt[:-1])
    tgt.decode_tokens(prompt[:-1], positions, outputs=False)
    _process(tgt, dft, st, rec, cfg, prompt[:-1], positions, PREFILL_ROUND)
    return each_round(rounds, lambda r: _round(tgt, dft, st, rec, cfg, r), on_round)


def _process(
    tgt: Context,
    dft: Context,
    st: _State,
    rec: Recorder,
    cfg: Eagle3Config,
    tokens: list[int],
    positions: list[int],
    rnd: int,
) -> np.ndarray:
    """common_speculative_impl_draft_eagle3::process of one target batch: encode its features,
    decode (token t+1, row t) for all rows but the last, keep the last pending; return the rows."""
    feats = features(tgt, cfg.target_layers, len(positions))  # (n_tokens, 3 * n_embd_tgt)
    chunks = []
    for start in range(0, len(positions), dft.n_ubatch):
        end = min(start + dft.n_ubatch, len(positions))
        open_eval(st, rec, Phase.INJECT, rnd, positions[start:end], [], call=names.CALL_ENCODE)
        first = dft.pos_max() + 1  # the encoder reads no positions: upstream's placeholders
        chunks.append(dft.process_encode(feats[start:end], list(range(first, first + end - start))))
    g = np.concatenate(chunks)  # (n_tokens, n_embd)
    if len(positions) > 1:
        open_eval(st, rec, Phase.INJECT, rnd, positions[:-1], tokens[1:])
        dft.decode_tokens_embd(tokens[1:], g[:-1], positions[:-1], outputs=False)
    st.pending_pos, st.pending_g = positions[-1], g[-1]
    return g


def _round(tgt: Context, dft: Context, st: _State, rec: Recorder, cfg: Eagle3Config, rnd: int) -> Round:
    pos0, anchor = st.n_past, st.id_last
    drafts = _draft(dft, st, rec, cfg, rnd)
    dft.seq_rm(pos0)  # speculative-simple: the drafter back to the target's n_past
    verify = [anchor] + drafts
    positions = list(range(pos0, pos0 + len(verify)))
    open_eval(st, rec, Phase.VERIFY, rnd, positions, verify)
    tgt.decode_tokens(verify, positions, outputs=True)
    target_tokens = [int(np.argmax(tgt.logits(i))) for i in range(len(verify))]
    g = _process(tgt, dft, st, rec, cfg, verify, positions, rnd)
    accepted = accepted_length(drafts, target_tokens)
    st.pending_pos, st.pending_g = pos0 + accepted, g[accepted]  # accept(): the row at the accepted length
    st.n_past, st.id_last = pos0 + accepted + 1, target_tokens[accepted]
    rollback(tgt, st.n_past, len(verify) - (accepted + 1))
    dft.seq_rm(st.n_past)
    return close_round(rec, rnd, pos0, anchor, drafts, accepted, target_tokens)


def _draft(dft: Context, st: _State, rec: Recorder, cfg: Eagle3Config, rnd: int) -> list[int]:
    """draft(): the seed (the freshest target token with the pending row, at the pending
    position), then one decode per draft with the previous step's pre-norm row (driver.step_drafts)."""
    dft.seq_rm(st.pending_pos)
    return step_drafts(dft, st, rec, cfg, rnd, st.id_last, st.pending_g, st.pending_pos)
