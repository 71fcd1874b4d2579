"""The target forward (qwen3 / llama) of one batch: the token embeddings `embd`, every layer
input (the DFlash features), `l_out-<il>`, and on batches with outputs `result_norm` / `result_output`.

llama.cpp selects the output rows before the last layer's FFN (`inp_out_ids`), so the last
`l_out`, `result_norm` and `result_output` hold output rows only: zero rows in the prefill,
recorded as such, like llama.cpp's callback sees them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from featdiff.core import names
from featdiff.torchref.attention import KvCache, cache_with
from featdiff.torchref.hf_target import HfTarget, forward_hf
from featdiff.torchref.numerics import linear, rms_norm
from featdiff.torchref.stack import Named, layer_forward
from featdiff.torchref.weights import Target


@dataclass(frozen=True)
class TargetPass:
    """One target eval: the layer inputs, the output rows' logits, the cache after it."""

    layer_inputs: tuple[torch.Tensor, ...]  # input of layer L, (n_tokens, n_embd), L = 0 .. n_layer-1
    logits: torch.Tensor  # (n_outputs, n_vocab): n_tokens or 0 rows
    cache: KvCache
    records: tuple[Named, ...]


def forward_target(
    model: Target, tokens: torch.Tensor, positions: torch.Tensor, cache: KvCache, has_outputs: bool
) -> TargetPass:
    """Run `tokens` at `positions` after the cached cells (causal); all rows or none are outputs."""
    if isinstance(model, HfTarget):  # transformers' own model code (hf_target.py)
        hf = forward_hf(model, tokens, positions, cache, has_outputs)
        return TargetPass(hf.layer_inputs, hf.logits, hf.cache, hf.records)
    hp = model.hparams
    x = model.token_embd[tokens]  # (n_tokens, n_embd)
    inputs, records, ks, vs = [], [Named(names.TARGET_EMBD, x)], [], []
    for il in range(len(model.layers)):
        inputs.append(x)
        records.append(Named(names.layer_name(names.LAYER_INP, il), x))
        is_last = il == hp.n_layer - 1
        rows = slice(0, 0) if is_last and not has_outputs else slice(None)
        # indexed in the call: a streamed layer is freed before the next one is built
        trace = layer_forward(hp, model.layers[il], x, positions, cache, il, causal=True, out_rows=rows)
        ks.append(trace.k_cache)
        vs.append(trace.v_cache)
        x = trace.l_out
        records.append(Named(names.layer_name(names.L_OUT, il), x))
    norm = rms_norm(x, model.output_norm, hp.rms_eps)
    logits = linear(norm, model.output)
    records += [Named(names.RESULT_NORM, norm), Named(names.RESULT_OUTPUT, logits)]
    return TargetPass(tuple(inputs), logits, cache_with(cache, positions, ks, vs), tuple(records))
