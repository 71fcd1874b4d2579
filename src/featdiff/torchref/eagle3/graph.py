"""The EAGLE3 drafter's two graphs (upstream `src/models/eagle3.cpp`) and its GGUF loader:

* encoder (graph<true>): target features `(n_tokens, 3 * n_embd_tgt)` -> optional RMS norm
  (`enc_input_norm`, with `eagle3.norm_before_fc`) -> `fc` -> `fc_out`, the rows g;
* decoder (graph<false>, one layer): token rows `inp_embd` and g rows `inp_g_embeddings` ->
  `[attn_norm(embd), attn_norm_2(g)]` (`concat_embd-0`) -> causal attention over the draft cache
  -> residual on g (or on g_norm, with `eagle3.norm_before_residual`) -> SwiGLU FFN ->
  `eagle3_prenorm-0` (the next draft step's g) -> final norm -> logits (scattered to the target
  vocabulary through `d2t`).

Besides the graphs' names they record reference-only candidates (`<record>@<hypothesis>`, as
drafter.py does for DFlash): `fc_out@slots=<perm>` and `fc_out@norm=...` (encode_candidates),
`inp_embd@table=target` and `result_output@d2t=offsets` (decode). The flow that drives them is
eagle3_flow.py.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from featdiff.core import names
from featdiff.kinds.problems import d2t_problems
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import GgufModel, array_from_tensor, int_list_meta, int_meta, meta, read_gguf_weights
from featdiff.dump.model_info import model_info
from featdiff.llama import ggml_dequant
from featdiff.dump.manifest_fields import ModelInfo
from featdiff.kinds.eagle3 import LAYER_TENSORS, T_ATTN_NORM_2, unmodelled_eagle3
from featdiff.torchref.attention import KvCache, attend, cache_with, layer_kv
from featdiff.torchref.load_gguf import _draft_n_vocab, _hparams
from featdiff.torchref.numerics import ffn, linear, rms_norm, rope
from featdiff.torchref.stack import Named
from featdiff.torchref.weights import Hparams, Layer, Source, Target, hf_sha256, layer_from_tensors

# --- the eagle3 arch's names featdiff.core.names lacks (src/llama-arch.cpp, src/models/eagle3.cpp) -----
N_TARGET_LAYERS = 3  # load_arch_hparams: "EAGLE3 requires exactly 3 entries in 'extract_layers'"
KEY_VALUE_LENGTH = "{arch}.attention.value_length"  # the graph asserts it equals the key length
# the decoder's callback names besides names.EAGLE3_*
QCUR_ROPE = "Qcur_rope"
KCUR_ROPE = "Kcur_rope"
POST_ATTN_NORM = "post_attn_norm"


@dataclass(frozen=True)
class Eagle3Draft:
    """The EAGLE3 drafter. `target_layers` are GGUF ids: the *input* of that target layer
    (`llama_set_embeddings_layer_inp`), as the converter writes them (unshifted)."""

    source: Source
    hparams: Hparams  # rope_type "normal": llama.cpp runs arch eagle3 with LLAMA_ROPE_TYPE_NORM
    target_layers: tuple[int, int, int]
    n_embd_tgt: int
    norm_before_fc: bool
    norm_before_residual: bool
    fc: torch.Tensor  # (n_embd, 3 * n_embd_tgt)
    enc_norm: torch.Tensor | None  # (3 * n_embd_tgt,): enc.output_norm, only with norm_before_fc
    layer: Layer  # blk.0: wq/wk/wv take 2 * n_embd inputs; no q/k norms
    attn_norm_2: torch.Tensor  # (n_embd,): blk.0.attn_norm_2, on g
    output_norm: torch.Tensor  # (n_embd,)
    output: torch.Tensor | None  # (n_vocab_draft, n_embd); None: the target's head
    token_embd: torch.Tensor | None  # (n_vocab, n_embd); None: the target's table
    d2t: torch.Tensor | None = None  # int64 (n_vocab_draft,): absolute target id of each head row
    # SpecForge's `fc_norm`: one RMSNorm per target slot, each (n_embd_tgt,), before fc (a HF
    # checkpoint only: llama.cpp's graph has no such norm and the pinned converter refuses it)
    fc_norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # a HF checkpoint's trainer and what its layer ids mean (the manifest's `checkpoint`); None: a GGUF
    checkpoint: dict[str, Any] | None = None

    @property
    def has_own_embeddings(self) -> bool:
        return self.token_embd is not None


@dataclass(frozen=True)
class DecodePass:
    """One decoder eval: its logits and pre-norm rows, the records, the cache after it."""

    logits: torch.Tensor  # (n_tokens, n_vocab): result_output, scattered through d2t
    prenorm: torch.Tensor  # (n_tokens, n_embd): eagle3_prenorm-0, the next step's g
    records: tuple[Named, ...]
    cache: KvCache
    offsets_logits: torch.Tensor | None = None  # (n_tokens, n_vocab): result_output@d2t=offsets, if any


def encode(draft: Eagle3Draft, features: torch.Tensor) -> tuple[torch.Tensor, tuple[Named, ...]]:
    """The encoder graph: g `(n_tokens, n_embd)` of the features `(n_tokens, 3 * n_embd_tgt)`."""
    records = [Named(names.INP_TARGET_FEATURES, features)]  # the graph's `inp_embd` (featdiff's name)
    x = features
    if draft.norm_before_fc:
        if draft.enc_norm is None:
            raise ValueError(f"{draft.source.path}: norm_before_fc without enc_norm: the loader let it through")
        x = rms_norm(x, draft.enc_norm, draft.hparams.rms_eps)
        records.append(Named(names.EAGLE3_ENC_INPUT_NORM, x))
    if draft.fc_norm is not None:  # no graph node of llama.cpp's computes it: only fc_out is recorded
        x = slot_norms(draft, x)
    g = linear(x, draft.fc)  # (n_tokens, n_embd)
    records.append(Named(names.EAGLE3_FC_OUT, g))
    return g, tuple(records)


def slot_norms(draft: Eagle3Draft, features: torch.Tensor) -> torch.Tensor:
    """SpecForge's `fc_norm`: each target slot `(n_tokens, n_embd_tgt)` RMS-normalized with its
    own weight, concatenated again `(n_tokens, 3 * n_embd_tgt)`."""
    assert draft.fc_norm is not None  # the caller's branch
    slots = features.split(draft.n_embd_tgt, dim=1)  # 3 x (n_tokens, n_embd_tgt)
    normed = [rms_norm(s, w, draft.hparams.rms_eps) for s, w in zip(slots, draft.fc_norm)]
    return torch.cat(normed, dim=1)  # (n_tokens, 3 * n_embd_tgt)


def encode_candidates(draft: Eagle3Draft, features: torch.Tensor) -> tuple[Named, ...]:
    """What `fc_out` of the features `(n_tokens, 3 * n_embd_tgt)` would be under each export fault
    the encoder can carry (reference-only: docs/records.md):

    * `fc_out@slots=<perm>`, every non-identity order: fc of its input (the features, normalized
      with `norm_before_fc`) whose slot k carries reference slot perm[k]. A GGUF whose fc column
      block perm[k] holds the checkpoint's block k computes exactly this (the features match);
    * `fc_out@norm=none` with `norm_before_fc`: fc of the raw features (the norm dropped);
    * `fc_out@fc_norm=none` with SpecForge's per-slot `fc_norm`: fc of the raw features (a
      converter that drops `fc_norm.{0,1,2}.weight`);
    * `fc_out@norm=unit` without it: fc of the features RMS-normalized with a unit weight (a norm
      the checkpoint does not have)."""
    fc_out = names.EAGLE3_FC_OUT
    if draft.fc_norm is not None:
        fc_input = slot_norms(draft, features)
        norm = Named(names.candidate_name(fc_out, names.HYP_FC_NORM_NONE), linear(features, draft.fc))
    elif draft.norm_before_fc and draft.enc_norm is not None:
        fc_input = rms_norm(features, draft.enc_norm, draft.hparams.rms_eps)
        norm = Named(names.candidate_name(fc_out, names.HYP_NORM_NONE), linear(features, draft.fc))
    else:
        fc_input = features
        unit = torch.ones(features.shape[1], dtype=features.dtype, device=features.device)  # (3 * n_embd_tgt,)
        unit_normed = rms_norm(features, unit, draft.hparams.rms_eps)
        norm = Named(names.candidate_name(fc_out, names.HYP_NORM_UNIT), linear(unit_normed, draft.fc))
    n_tokens = features.shape[0]
    slots = fc_input.reshape(n_tokens, N_TARGET_LAYERS, draft.n_embd_tgt)  # (n_tokens, 3, n_embd_tgt)
    permuted = []
    for perm in itertools.permutations(range(N_TARGET_LAYERS)):
        if perm != tuple(range(N_TARGET_LAYERS)):
            staged = slots[:, list(perm), :].reshape(n_tokens, -1)  # (n_tokens, 3 * n_embd_tgt)
            name = names.candidate_name(fc_out, names.slots_hypothesis(perm))
            permuted.append(Named(name, linear(staged, draft.fc)))
    return (*permuted, norm)


def decode(
    draft: Eagle3Draft,
    target: Target,
    tokens: torch.Tensor,
    g: torch.Tensor,
    positions: torch.Tensor,
    cache: KvCache,
) -> DecodePass:
    """The decoder graph over rows (token, g) at `positions`, causal over the cached cells; the
    returned cache holds this eval's K/V after them."""
    hp, layer = draft.hparams, draft.layer
    table = draft.token_embd if draft.token_embd is not None else target.token_embd
    embd = table[tokens]  # (n_tokens, n_embd)
    candidates = []
    if draft.token_embd is not None and draft.token_embd.shape == target.token_embd.shape:
        borrowed = target.token_embd[tokens]  # (n_tokens, n_embd): the own table dropped, the target's read
        candidates.append(Named(names.candidate_name(names.INP_EMBD, names.HYP_TABLE_TARGET), borrowed))
    embd_norm = rms_norm(embd, layer.attn_norm, hp.rms_eps)
    g_norm = rms_norm(g, draft.attn_norm_2, hp.rms_eps)
    concat = torch.cat([embd_norm, g_norm], dim=1)  # (n_tokens, 2 * n_embd): ggml_concat(embd_norm, g_norm, 0)
    swapped = torch.cat([g_norm, embd_norm], dim=1)  # (n_tokens, 2 * n_embd): the halves the other way
    candidates.append(
        Named(names.candidate_name(names.layer_name(names.EAGLE3_CONCAT, 0), names.slots_hypothesis((1, 0))), swapped)
    )
    attn = _attention(hp, layer, concat, positions, cache)
    ffn_inp = linear(attn.kqv_out, layer.wo) + (g_norm if draft.norm_before_residual else g)  # (n_tokens, n_embd)
    post = rms_norm(ffn_inp, layer.ffn_norm, hp.rms_eps)
    ffn_out = ffn(post, layer)
    prenorm = ffn_out + ffn_inp
    norm = rms_norm(prenorm, draft.output_norm, hp.rms_eps)
    head = linear(norm, draft.output if draft.output is not None else target.output)  # (n_tokens, n_vocab_draft)
    logits = _scattered(draft, head)
    offsets = scattered_at_offsets(draft, head)
    if offsets is not None:
        candidates.append(Named(names.candidate_name(names.RESULT_OUTPUT, names.HYP_D2T_OFFSETS), offsets))
    records = (
        Named(names.INP_EMBD, embd),
        Named(names.INP_G_EMBEDDINGS, g),
        Named(names.layer_name(names.EAGLE3_EMBD_NORM, 0), embd_norm),
        Named(names.layer_name(names.EAGLE3_G_NORM, 0), g_norm),
        Named(names.layer_name(names.EAGLE3_CONCAT, 0), concat),
        *attn.records,
        Named(names.layer_name(names.FFN_INP, 0), ffn_inp),
        Named(names.layer_name(POST_ATTN_NORM, 0), post),
        Named(names.layer_name(names.FFN_OUT, 0), ffn_out),
        Named(names.layer_name(names.EAGLE3_PRENORM, 0), prenorm),
        Named(names.RESULT_NORM, norm),
        Named(names.RESULT_OUTPUT, logits),
        *candidates,
    )
    return DecodePass(logits, prenorm, records, attn.cache, offsets)


@dataclass(frozen=True)
class _Attention:
    kqv_out: torch.Tensor  # (n_tokens, n_head * n_embd_head): before wo
    records: tuple[Named, ...]
    cache: KvCache


def _attention(hp: Hparams, layer: Layer, x: torch.Tensor, positions: torch.Tensor, cache: KvCache) -> _Attention:
    """Q/K/V of the concatenated rows `x`, RoPE at `positions`, through the cache, causal."""
    n_tokens = x.shape[0]
    q_flat, k_flat, v_flat = linear(x, layer.wq), linear(x, layer.wk), linear(x, layer.wv)
    q = rope(q_flat.reshape(n_tokens, hp.n_head, hp.n_embd_head), positions, hp)  # (n_tokens, n_head, n_embd_head)
    k = rope(
        k_flat.reshape(n_tokens, hp.n_head_kv, hp.n_embd_head), positions, hp
    )  # (n_tokens, n_head_kv, n_embd_head)
    v = v_flat.reshape(n_tokens, hp.n_head_kv, hp.n_embd_head)  # (n_tokens, n_head_kv, n_embd_head)
    k_all, v_all = layer_kv(cache, 0, k, v)
    kv_pos = torch.cat([cache.positions, positions])  # (n_cells + n_tokens,)
    kqv_out = attend(q, positions, k_all, v_all, kv_pos, causal=True)
    records = tuple(
        Named(names.layer_name(name, 0), a)
        for name, a in (
            (names.QCUR, q_flat),
            (names.KCUR, k_flat),
            (names.VCUR, v_flat),
            (QCUR_ROPE, q),
            (KCUR_ROPE, k),
            (names.KQV_OUT, kqv_out),
        )
    )
    return _Attention(kqv_out, records, cache_with(cache, positions, [k_all], [v_all]))


def _scattered(draft: Eagle3Draft, logits: torch.Tensor) -> torch.Tensor:
    """A reduced head's rows on the drafter's vocabulary at their `d2t` ids, -inf elsewhere
    (eagle3.cpp: ggml_fill -INFINITY, then ggml_set_rows); unchanged without d2t."""
    if draft.d2t is None:
        return logits
    full = torch.full(
        (logits.shape[0], draft.hparams.n_vocab), float("-inf"), dtype=logits.dtype, device=logits.device
    )  # (n_tokens, n_vocab)
    full[:, draft.d2t] = logits
    return full


def scattered_at_offsets(draft: Eagle3Draft, head: torch.Tensor) -> torch.Tensor | None:
    """The head's rows `(n_tokens, n_vocab_draft)` scattered as llama.cpp scatters them through a
    GGUF d2t that holds the HF offsets (`d2t[i] - i`) instead of absolute ids: row i at target id
    d2t[i] - i, -inf where no row lands, NaN where several do (ggml_set_rows writes them from
    several threads, so which one wins is a race: the hypothesis leaves that value open). None
    without d2t, or when an offset leaves the vocabulary (llama.cpp would assert: such a GGUF is
    refused before it runs)."""
    if draft.d2t is None:
        return None
    offsets = draft.d2t.cpu().numpy() - np.arange(draft.d2t.shape[0])  # (n_vocab_draft,)
    n_vocab = draft.hparams.n_vocab
    if offsets.size == 0 or offsets.min() < 0 or offsets.max() >= n_vocab:
        return None
    ids, counts = np.unique(offsets, return_counts=True)
    full = torch.full((head.shape[0], n_vocab), float("-inf"), dtype=head.dtype, device=head.device)
    full[:, torch.from_numpy(offsets).to(head.device)] = head
    full[:, torch.from_numpy(ids[counts > 1]).to(head.device)] = float("nan")
    return full  # (n_tokens, n_vocab)


def check_eagle3_pair(target: Target, draft: Eagle3Draft) -> None:
    """InputError when the drafter cannot run against this target as featdiff models it."""
    n_layer, path = target.hparams.n_layer, draft.source.path
    for il in draft.target_layers:
        if il == n_layer:
            raise InputError(
                f"{path}: {names.KEY_EAGLE3_TARGET_LAYERS} = {list(draft.target_layers)} names layer {il} = the target's n_layer, "
                f"which llama.cpp reads from the target's t_h_nextn; a {target.hparams.arch} target never sets it and "
                "featdiff does not model it; use ids < n_layer"
            )
        if not 0 <= il < n_layer:
            raise InputError(
                f"{path}: {names.KEY_EAGLE3_TARGET_LAYERS} = {list(draft.target_layers)} but the target {target.source.path} "
                f"has {n_layer} layers; ids must be in 0 .. {n_layer - 1}"
            )
    borrowed = [what for what, own in (("token_embd", draft.token_embd), ("output", draft.output)) if own is None]
    if borrowed and target.hparams.n_embd != draft.hparams.n_embd:
        raise InputError(
            f"{path}: the drafter borrows the target's {' and '.join(borrowed)} but its n_embd is "
            f"{draft.hparams.n_embd}, the target {target.source.path}'s {target.hparams.n_embd}; export the drafter's own"
        )
    expected = N_TARGET_LAYERS * target.hparams.n_embd
    if draft.fc.shape[1] != expected:
        raise InputError(
            f"{path}: fc takes {draft.fc.shape[1]} inputs, expected 3 x target n_embd {target.hparams.n_embd} = "
            f"{expected}; the drafter was trained for another target"
        )
    if draft.d2t is not None and int(draft.d2t.max()) >= target.hparams.n_vocab:
        raise InputError(
            f"{path}: {names.T_D2T} maps to target id {int(draft.d2t.max())}, the target {target.source.path} has "
            f"{target.hparams.n_vocab} tokens; pair the drafter with the target it was trained for"
        )


def eagle3_models_entry(draft: Eagle3Draft) -> dict[str, Any]:
    """The manifest's `models` entry of the drafter, with the fields capture records (`ModelInfo`);
    its target layers and own embeddings as the eagle3 keys and tensors say."""
    if draft.source.is_gguf:
        info = replace(model_info(draft.source.path), dequantized_by=draft.source.dequantized_by)
    else:  # a HF checkpoint (its files' hash), or built in memory (tests): what the record says
        hp = draft.hparams
        is_dir = Path(draft.source.path).is_dir()
        info = ModelInfo(
            path=str(draft.source.path),
            sha256=hf_sha256(Path(draft.source.path)) if is_dir else "",
            architecture=names.ARCH_EAGLE3,
            n_layer=hp.n_layer,
            n_embd=hp.n_embd,
            n_vocab=hp.n_vocab,
            weight_types=(),
            rope_freq_base=hp.rope_base,
        )
    return replace(
        info,
        target_layers=draft.target_layers,
        has_own_embeddings=draft.has_own_embeddings,
        checkpoint=draft.checkpoint,
    ).to_json()


def eagle3_from_gguf(
    path: Path, dtype: torch.dtype, device: torch.device, llama_dir: Path | None = None
) -> Eagle3Draft:
    """An EAGLE3 drafter from its GGUF, dequantized as load_gguf.target_from_gguf does.

    The converter (conversion/llama.py LlamaModel, `undo_permute`) permutes attn_q/attn_k rows
    for ggml's normal RoPE, which arch eagle3 runs (llama_model_rope_type: LLAMA_ROPE_TYPE_NORM):
    the rows are used as stored with `rope_type="normal"`, as a llama target's are.
    """
    g = read_gguf_weights(path, llama_dir, ggml_dequant.load)
    _check_file(g)
    layer_ids = int_list_meta(g, names.KEY_EAGLE3_TARGET_LAYERS)
    hp = _eagle3_hparams(g)
    t = {k: _optional(g, name, dtype, device) for k, name in _layer_names().items()}
    layer = layer_from_tensors({k: v for k, v in t.items() if k != T_ATTN_NORM_2})
    output = _optional(g, names.T_OUTPUT, dtype, device)
    return Eagle3Draft(
        source=Source(Path(path), is_gguf=True, dequantized_by=g.dequantized_by),
        hparams=hp,
        target_layers=(layer_ids[0], layer_ids[1], layer_ids[2]),
        n_embd_tgt=int_meta(g, names.KEY_EAGLE3_TARGET_HIDDEN),
        norm_before_fc=bool(meta(g, names.KEY_EAGLE3_NORM_BEFORE_FC, False)),
        norm_before_residual=bool(meta(g, names.KEY_EAGLE3_NORM_BEFORE_RESIDUAL, False)),
        fc=_tensor(g, names.T_FC, dtype, device),
        enc_norm=_optional(g, names.T_ENC_NORM, dtype, device),
        layer=layer,
        attn_norm_2=_tensor(g, _layer_names()[T_ATTN_NORM_2], dtype, device),
        output_norm=_tensor(g, names.T_OUTPUT_NORM, dtype, device),
        output=output,
        token_embd=_optional(g, names.T_TOKEN_EMBD, dtype, device),
        d2t=_d2t(g, hp.n_vocab, output.shape[0] if output is not None else hp.n_vocab, device),
    )


def _check_file(g: GgufModel) -> None:
    """InputError for a GGUF llama.cpp does not load as eagle3, or one carrying what the
    reference does not model."""
    if g.arch != names.ARCH_EAGLE3:
        raise InputError(f"{g.path}: architecture {g.arch!r}, expected {names.ARCH_EAGLE3!r}; pass the EAGLE3 drafter")
    found = unmodelled_eagle3(g.reader.fields, g.tensors)
    if found:
        raise InputError(
            f"{g.path}: carries {', '.join(found)}, which featdiff's EAGLE3 reference does not model; "
            "compare a drafter without it, or add it to featdiff (src/featdiff/kinds/eagle3.py)"
        )
    layer_ids = int_list_meta(g, names.KEY_EAGLE3_TARGET_LAYERS)
    if len(layer_ids) != N_TARGET_LAYERS:
        raise InputError(
            f"{g.path}: {names.KEY_EAGLE3_TARGET_LAYERS} = {layer_ids}, llama.cpp's eagle3 requires exactly {N_TARGET_LAYERS} "
            "ids; re-export the drafter with its three tapped layers"
        )
    if int_meta(g, names.KEY_BLOCK_COUNT) != 1:
        raise InputError(
            f"{g.path}: {names.KEY_BLOCK_COUNT.format(arch=names.ARCH_EAGLE3)} = {int_meta(g, names.KEY_BLOCK_COUNT)}, "
            "the eagle3 decoder graph has exactly one layer; re-export the drafter"
        )
    _check_tensors(g)


def _check_tensors(g: GgufModel) -> None:
    """The tensors llama_model_eagle3::load_arch_tensors requires, and the encoder norm exactly
    with `norm_before_fc` (llama.cpp refuses a file whose tensors it does not all create)."""
    required = [names.T_FC, names.T_OUTPUT_NORM, *_layer_names().values()]
    missing = [t for t in required if t not in g.tensors]
    if missing:
        raise InputError(f"{g.path}: tensor {missing[0]} is missing; re-export the drafter with it")
    norm_before_fc = bool(meta(g, names.KEY_EAGLE3_NORM_BEFORE_FC, False))
    if norm_before_fc != (names.T_ENC_NORM in g.tensors):
        found = "holds" if names.T_ENC_NORM in g.tensors else "lacks"
        raise InputError(
            f"{g.path}: {names.KEY_EAGLE3_NORM_BEFORE_FC} is {norm_before_fc} but the file {found} {names.T_ENC_NORM}; "
            "llama.cpp loads the encoder norm exactly when the flag is set: re-export the drafter"
        )
    n_tgt, fc = int_meta(g, names.KEY_EAGLE3_TARGET_HIDDEN), g.tensors[names.T_FC].ne  # ggml ne: (in, out)
    if fc[0] != N_TARGET_LAYERS * n_tgt:
        raise InputError(
            f"{g.path}: fc takes {fc[0]} inputs, {names.KEY_EAGLE3_TARGET_HIDDEN} = {n_tgt} says 3 x {n_tgt}; re-export the drafter"
        )


def _eagle3_hparams(g: GgufModel) -> Hparams:
    """The llama-family hparams (load_gguf._hparams) with normal RoPE and `rope_freqs`, which the
    eagle3 graph passes ggml_rope_ext (model.get_rope_factors)."""
    hp = _hparams(g, "normal", _draft_n_vocab(g))
    value_length = int(meta(g, KEY_VALUE_LENGTH, hp.n_embd_head))
    if value_length != hp.n_embd_head:
        raise InputError(
            f"{g.path}: {KEY_VALUE_LENGTH.format(arch=g.arch)} = {value_length} differs from the key length {hp.n_embd_head}, "
            "which the eagle3 graph asserts equal; re-export the drafter"
        )
    if names.T_ROPE_FREQS not in g.tensors:
        return hp
    n_pairs = (hp.n_rot or hp.n_embd_head) // 2
    factors = tuple(float(x) for x in array_from_tensor(g, names.T_ROPE_FREQS).reshape(-1)[:n_pairs])
    return replace(hp, rope_scaling=replace(hp.rope_scaling, freq_factors=factors))


def _layer_names() -> dict[str, str]:
    """blk.0's tensors: GGUF per-layer name -> full tensor name."""
    prefix = names.GGUF_LAYER_PREFIX.format(il=0)
    return {k: f"{prefix}{k}.weight" for k in LAYER_TENSORS}


def _d2t(g: GgufModel, n_vocab: int, head_rows: int, device: torch.device) -> torch.Tensor | None:
    """The reduced head's absolute target ids `(n_vocab_draft,)` int64, as stored (the converter
    writes `d2t + arange`)."""
    if names.T_D2T not in g.data:
        return None
    ids = np.asarray(g.data[names.T_D2T].data).reshape(-1)  # (n_vocab_draft,): I64 read raw
    problems = d2t_problems(ids, n_vocab, head_rows)
    if problems:
        raise InputError(f"{g.path}: " + "; ".join(problems))
    return torch.from_numpy(ids.copy()).to(device)


def _tensor(g: GgufModel, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array_from_tensor(g, name)).to(dtype=dtype, device=device)


def _optional(g: GgufModel, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    return _tensor(g, name, dtype, device) if name in g.tensors else None
