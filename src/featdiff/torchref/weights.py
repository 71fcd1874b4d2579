"""The models the reference runs, whatever file they came from: a target (qwen3 or llama) and a
DFlash drafter, as frozen records of torch tensors in Hugging Face orientation `(out, in)`
(which is also the GGUF array in numpy order).

`check_pair` validates a target/drafter pair; `models_entry` gives the dump manifest's `models`
entry of one role. The loaders live in `load.py`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, overload

import torch
from safetensors import safe_open

from featdiff.core import names
from featdiff.kinds.problems import layer_id_problems
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import HASH_CHUNK
from featdiff.dump.model_info import model_info
from featdiff.dump.manifest_fields import ModelInfo, dspark_info
from featdiff.kinds.dflash.modelled import LAYER_ATTN_SINKS
from featdiff.torchref.rope_params import RopeScaling


RopeType = Literal["normal", "neox"]  # ggml's GGML_ROPE_TYPE_NORMAL (pairs 2i, 2i+1) / NEOX (i, i+d/2)


@dataclass(frozen=True)
class Source:
    """Where a model came from: a GGUF file or a Hugging Face directory."""

    path: Path
    is_gguf: bool
    dequantized_by: str | None = None  # a GGUF's: gguf-py or the libggml-base file (gguf_reader)


@dataclass(frozen=True)
class Hparams:
    """One transformer stack's dimensions, in llama.cpp's vocabulary."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_embd_head: int
    n_ff: int
    n_vocab: int
    rms_eps: float
    rope_base: float
    rope_type: RopeType
    rope_scaling: RopeScaling = RopeScaling()
    n_rot: int | None = None  # dims RoPE rotates, from the first (partial rotary); None: the whole head
    attn_value_scale: float = 0.0  # dflash.attention.value_scale: multiplies attention's output (0: none)
    # dflash.attention.sliding_window (0: none) and _pattern: which layers attend within the window
    n_swa: int = 0
    swa_layers: tuple[bool, ...] = ()

    def is_swa(self, il: int) -> bool:
        """Layer `il` attends only to keys less than `n_swa` positions behind (llama_hparams::is_swa)."""
        return self.n_swa > 0 and il < len(self.swa_layers) and self.swa_layers[il]


@dataclass(frozen=True)
class Layer:
    """One decoder layer; q/k norms are None for architectures without them (llama)."""

    attn_norm: torch.Tensor  # (n_embd,)
    wq: torch.Tensor  # (n_head * n_embd_head, n_embd)
    wk: torch.Tensor  # (n_head_kv * n_embd_head, n_embd)
    wv: torch.Tensor  # (n_head_kv * n_embd_head, n_embd)
    wo: torch.Tensor  # (n_embd, n_head * n_embd_head)
    q_norm: torch.Tensor | None  # (n_embd_head,)
    k_norm: torch.Tensor | None  # (n_embd_head,)
    ffn_norm: torch.Tensor  # (n_embd,)
    ffn_gate: torch.Tensor  # (n_ff, n_embd)
    ffn_up: torch.Tensor  # (n_ff, n_embd)
    ffn_down: torch.Tensor  # (n_embd, n_ff)
    attn_sinks: torch.Tensor | None = None  # (n_head,) float32: per-head sink logits (`attn_sinks`), or none


class LayerStream(Sequence[Layer]):
    """A stack's layers, each built from its (mapped) file when indexed and not kept: a forward
    holds one layer's compute-dtype weights at a time, so an 8B target runs in a few GB."""

    def __init__(self, n_layer: int, load: Callable[[int], Layer]) -> None:
        self._n_layer = n_layer
        self._load = load

    def __len__(self) -> int:
        return self._n_layer

    @overload
    def __getitem__(self, il: int) -> Layer: ...
    @overload
    def __getitem__(self, il: slice) -> tuple[Layer, ...]: ...
    def __getitem__(self, il: int | slice) -> Layer | tuple[Layer, ...]:
        if isinstance(il, slice):
            return tuple(self[i] for i in range(*il.indices(self._n_layer)))
        if not -self._n_layer <= il < self._n_layer:
            raise IndexError(f"layer {il} of a stack of {self._n_layer}")
        return self._load(il % self._n_layer)


@dataclass(frozen=True)
class Target:
    """The target model."""

    source: Source
    hparams: Hparams
    token_embd: torch.Tensor  # (n_vocab, n_embd)
    output_norm: torch.Tensor  # (n_embd,)
    output: torch.Tensor  # (n_vocab, n_embd); the tied embeddings when there is no head
    layers: Sequence[Layer]  # a LayerStream when loaded from a file


@dataclass(frozen=True)
class LogSnr:
    """GIDD log-SNR conditioning: the range and the two-layer MLP on the sinusoidal features."""

    min_log_snr: float
    max_log_snr: float
    fc1_w: torch.Tensor  # (n_embd, LOG_SNR_N_FREQ)
    fc1_b: torch.Tensor  # (n_embd,)
    fc2_w: torch.Tensor  # (n_embd, n_embd)
    fc2_b: torch.Tensor  # (n_embd,)


@dataclass(frozen=True)
class DSpark:
    """DSpark's heads on a DFlash drafter (upstream `build_dspark_markov_head`) and its layout.

    Block row i's logits get `scale * markov_w2 @ markov_w1[prev]`, `prev` chained by argmax from
    the block's anchor; the confidence head scores `[result_norm(i); markov_w1[prev]]`.
    Anchor-first (`sample_from_anchor`): a block of n_draft rows, drafts read from row 0; bonus
    anchor: n_draft + 1 rows, row 0 unbiased, drafts from row 1.
    """

    markov_w1: torch.Tensor  # (n_vocab, rank): row = previous (target) token
    markov_w2: torch.Tensor  # (n_vocab_draft, rank)
    markov_w2_scale: torch.Tensor | None  # (1,)
    conf_w: torch.Tensor | None  # (1, n_embd + rank)
    conf_b: torch.Tensor | None  # (1,)
    sample_from_anchor: bool

    @property
    def rank(self) -> int:
        return self.markov_w1.shape[1]

    @property
    def has_confidence_head(self) -> bool:
        return self.conf_w is not None

    @staticmethod
    def of_tensors(t: dict[str, torch.Tensor | None], sample_from_anchor: bool) -> DSpark:
        """The heads from tensors keyed by their GGUF names (names.T_MARKOV_W1, ...), which the
        loader has checked: the Markov pair present, the scale and the confidence head optional."""
        return DSpark(
            markov_w1=present(t[names.T_MARKOV_W1], names.T_MARKOV_W1),
            markov_w2=present(t[names.T_MARKOV_W2], names.T_MARKOV_W2),
            markov_w2_scale=t[names.T_MARKOV_W2_SCALE],
            conf_w=t[names.T_CONF_PROJ_W],
            conf_b=t[names.T_CONF_PROJ_B],
            sample_from_anchor=sample_from_anchor,
        )


@dataclass(frozen=True)
class Draft:
    """The DFlash drafter. `target_layers` are GGUF ids: the *input* of that target layer."""

    source: Source
    hparams: Hparams
    target_layers: tuple[int, ...]
    block_size: int
    mask_token_id: int
    fc: torch.Tensor  # (n_embd, n_extract * n_embd_tgt)
    enc_norm: torch.Tensor  # (n_embd,)
    output_norm: torch.Tensor  # (n_embd,)
    token_embd: torch.Tensor | None  # (n_vocab, n_embd); None: borrow the target's
    output: torch.Tensor | None  # (n_vocab, n_embd); None: borrow the target's
    layers: Sequence[Layer]  # a LayerStream when loaded from a file
    log_snr: LogSnr | None
    dspark: DSpark | None = None  # the Markov (and confidence) head of a DSpark drafter
    causal: bool = False  # dflash.attention.causal: block rows attend causally
    d2t: torch.Tensor | None = None  # int64 (n_vocab_draft,): target id of each head row (reduced vocab)
    embedding_scale: float = 0.0  # dflash.embedding_scale: multiplies the noise embedding rows (0: none)
    fc_scale: torch.Tensor | None = None  # (1,) `fc.scale`: multiplies fc's product (build_lora_mm's w_s)
    # (n_embd,) a HF directory's mask_embedding.pt: the embedding table's mask row, as the converter
    # patches it into the GGUF's token_embd (a GGUF's table holds it already: None)
    mask_row: torch.Tensor | None = None
    # DFlash2's local convs and candidate selector: a dflash2.DFlash2 (typed Any here: dflash2.py
    # computes with this module's records, and an import back would close a circle)
    dflash2: Any = None

    @property
    def has_own_embeddings(self) -> bool:
        return self.token_embd is not None

    @property
    def n_extract(self) -> int:
        return len(self.target_layers)


_LAYER_FIELDS = {
    "attn_norm": "attn_norm",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "ffn_gate",
    "ffn_up": "ffn_up",
    "ffn_down": "ffn_down",
    LAYER_ATTN_SINKS: "attn_sinks",
}  # GGUF per-layer name -> field
# Layer's None-able fields: llama has no q/k norm; only a drafter with sinks has them (a caller
# may leave them out of its mapping)
_OPTIONAL_LAYER_TENSORS = ("attn_q_norm", "attn_k_norm", LAYER_ATTN_SINKS)


def layer_from_tensors(t: dict[str, torch.Tensor | None]) -> Layer:
    """A `Layer` from tensors keyed by their GGUF per-layer names (`attn_q`, `ffn_up`, ...)."""
    fields: dict[str, Any] = {
        field: t.get(name) if name in _OPTIONAL_LAYER_TENSORS else present(t[name], name)
        for name, field in _LAYER_FIELDS.items()
    }
    return Layer(**fields)


def tensors_of_layer(layer: Layer) -> dict[str, torch.Tensor | None]:
    """A layer's tensors keyed by their GGUF per-layer names: the inverse of `layer_from_tensors`."""
    return {name: getattr(layer, field) for name, field in _LAYER_FIELDS.items()}


@overload
def aligned(t: torch.Tensor) -> torch.Tensor: ...
@overload
def aligned(t: None) -> None: ...
@overload
def aligned(t: torch.Tensor | None) -> torch.Tensor | None: ...
def aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` in an allocation of its own, which torch aligns: torch's CPU matrix-vector product sums
    in an order that depends on the buffer's alignment, and numpy's and safetensors' buffers differ
    in it, so a GGUF and a HF load would give results that differ in the last bit."""
    return t.clone() if t is not None else None


def present(t: torch.Tensor | None, name: str) -> torch.Tensor:
    """`t`, which its loader has checked the file holds: None here is a bug of featdiff's."""
    if t is None:
        raise ValueError(f"{name}: the loader let a missing tensor through")
    return t


def check_pair(target: Target, draft: Draft) -> None:
    """InputError when the drafter cannot run against this target (ids, widths, vocabulary)."""
    problems = layer_id_problems("target_layers", list(draft.target_layers), target.hparams.n_layer)
    if problems:
        raise InputError(f"{draft.source.path}: {problems[0]} (target {target.source.path})")
    expected = draft.n_extract * target.hparams.n_embd
    if draft.fc.shape[1] != expected:
        raise InputError(
            f"{draft.source.path}: fc takes {draft.fc.shape[1]} inputs, expected n_extract "
            f"{draft.n_extract} x target n_embd {target.hparams.n_embd} = {expected}; "
            "the drafter was trained for another target"
        )
    head_rows = (draft.output if draft.output is not None else target.output).shape[0]
    if head_rows > target.token_embd.shape[0]:
        raise InputError(
            f"{draft.source.path}: the drafter's head scores {head_rows} tokens, the target "
            f"{target.source.path} embeds {target.token_embd.shape[0]}; drafts must be target tokens"
        )
    table = draft.token_embd if draft.token_embd is not None else target.token_embd
    if not 0 <= draft.mask_token_id < table.shape[0]:
        raise InputError(
            f"{draft.source.path}: mask token id {draft.mask_token_id} is outside the noise "
            f"embedding table of {table.shape[0]} rows; set the trained mask token id"
        )


def hf_sha256(path: Path) -> str:
    """sha256 of a HF directory: its config.json, then its safetensors in sorted order."""
    h = hashlib.sha256()
    for f in [path / names.HF_CONFIG, *sorted(path.glob(names.HF_WEIGHTS_GLOB))]:
        with open(f, "rb") as fh:
            while chunk := fh.read(HASH_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def models_entry(model: Target | Draft) -> dict[str, Any]:
    """The manifest's `models` entry of one role, with the fields capture records (`ModelInfo`).

    A GGUF is described exactly as capture describes it; a HF directory from the loaded model.
    """
    if model.source.is_gguf:
        # read without a ggml loader: loading the model taught gguf-py any tensor type it lacked
        return replace(model_info(model.source.path), dequantized_by=model.source.dequantized_by).to_json()
    hp = model.hparams
    draft = model if isinstance(model, Draft) else None
    snr = draft.log_snr if draft is not None else None
    return ModelInfo(
        path=str(model.source.path),
        sha256=hf_sha256(model.source.path),
        architecture=hp.arch,
        n_layer=hp.n_layer,
        n_embd=hp.n_embd,
        n_vocab=hp.n_vocab,
        weight_types=_hf_weight_types(model.source.path),
        target_layers=draft.target_layers if draft else (),
        block_size=draft.block_size if draft else 0,
        mask_token_id=draft.mask_token_id if draft else -1,
        log_snr={
            "enabled": snr is not None,
            "min": snr.min_log_snr if snr else None,
            "max": snr.max_log_snr if snr else None,
        }
        if draft
        else None,
        has_own_embeddings=bool(draft and draft.has_own_embeddings),
        has_log_snr_tensors=snr is not None,
        rope_freq_base=hp.rope_base,
        dspark=_dspark_entry(draft) if draft is not None else None,
    ).to_json()


def _dspark_entry(draft: Draft) -> dict[str, Any] | None:
    """ModelInfo's `dspark` entry of a loaded drafter, as `model_info` reads it from a GGUF."""
    dsp = draft.dspark
    if dsp is None:
        return None
    return dspark_info(
        rank=dsp.rank,
        has_confidence_head=dsp.has_confidence_head,
        sample_from_anchor=dsp.sample_from_anchor,
        causal=draft.causal,
        n_vocab_draft=dsp.markov_w2.shape[0],
    )


def _hf_weight_types(path: Path) -> tuple[str, ...]:
    """Distinct dtypes of the 2-D tensors in a HF directory's safetensors, named like ggml types."""
    types = set()
    for f in sorted(path.glob(names.HF_WEIGHTS_GLOB)):
        with safe_open(str(f), "np") as st:
            types |= {st.get_slice(k).get_dtype().lower() for k in st.keys() if len(st.get_slice(k).get_shape()) == 2}
    return tuple(sorted(types))
