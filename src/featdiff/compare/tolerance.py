"""The tolerance model: how far a run tensor may sit from the reference before the difference
needs a cause. Built from the types in the two manifests (f32 compute, the run's KV cache types,
its quantized weight types, the reference's compute dtype; `dump.Build`); every constant says
where it comes from. A difference inside the tolerance is `numeric_noise`, never an error.

Tolerances are relative: rms(run - ref) / rms(ref) over a pair (`rel`, so NMSE <= rel**2) and
the same ratio over any single row (`row_rel`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from featdiff import names
from featdiff.dump import Manifest

# Calibration: `bench/calibrate_compare.py` (clean, own-embd and llama fixtures, prompts of 10
# and 33 tokens, 3 rounds, capture through llama-cpp-python 0.3.36 on CPU vs the reference with
# an f16 KV cache): the figures quoted below are the worst over all pairs.
#
# f32 on both sides, different kernels and summation order (ggml vs torch): pre-attention f32
# tensors (embd, inp_noise_embd) agree bitwise; l_out-0 of the target, 1.8e-7 relative.
REL_F32 = 1e-6
# The f16 KV cache plus CPU flash attention, which converts Q to f16 and accumulates V*softmax
# in f16 (ggml-cpu `ggml_compute_forward_flash_attn_ext_f16`); the reference rounds K/V to f16
# but attends in f32. Worst post-attention pair 4.1e-4 relative (result_output of the drafter).
REL_KV_F16 = 5e-4
# A quantized KV cache (llama.cpp `-ctk` / `-ctv`), against a reference that rounds K/V to f16.
# q8_0 measured (tests/llama/test_kv_types.py: `capture --exec` around llama-speculative-simple,
# the clean fixture with 32-wide heads, 17 rounds): K and V in q8_0, worst pair 1.24e-2 relative
# (l_out-5 of the target); K alone, 9.4e-3. The other types are not measured: bf16 scaled from
# f16 by its 3 fewer mantissa bits, the 5- and 4-bit types from q8_0 by their quantization step,
# 2**(8 - bits), and capped by MAX_REL.
REL_KV_Q8_0 = 1.5e-2
REL_KV: dict[str, float] = {
    "f32": 0.0,
    "f16": REL_KV_F16,
    "bf16": 8 * REL_KV_F16,
    "q8_0": REL_KV_Q8_0,
    "q5_0": 8 * REL_KV_Q8_0,
    "q5_1": 8 * REL_KV_Q8_0,
    "q4_0": 16 * REL_KV_Q8_0,
    "q4_1": 16 * REL_KV_Q8_0,
    "iq4_nl": 16 * REL_KV_Q8_0,
}
REL_KV_UNKNOWN = 16 * REL_KV_Q8_0  # a cache type this table does not know: treated like a 4-bit type
# Weights the run dequantizes (and, on CPU, activations it quantizes to q8 for the dot product).
# q8_0 measured (target quantized, reference on the f32 weights): worst pair 2.6e-2 relative,
# the embeddings alone 6.1e-3. The other types are not measured: scaled from q8_0 by their
# quantization step, 2**(8 - bits) (k-quants counted one bit better), and capped by MAX_REL.
REL_WEIGHT: dict[str, float] = {
    "f32": 0.0,
    "f16": 1e-3,
    "bf16": 8e-3,
    "q8_0": 3e-2,
    "q8_1": 3e-2,
    "q8_k": 3e-2,
    "q6_k": 6e-2,
    "q5_0": 1.2e-1,
    "q5_1": 1.2e-1,
    "q5_k": 6e-2,
    "q4_0": 2.4e-1,
    "q4_1": 2.4e-1,
    "q4_k": 1.2e-1,
    "q3_k": 2.4e-1,
    "q2_k": 4.8e-1,
}
REL_WEIGHT_UNKNOWN = 2.4e-1  # a type this table does not know: treated like a 4-bit type
# The reference's own compute dtype (`featdiff reference --dtype`): unit roundoff of the format.
REL_REF_DTYPE: dict[str, float] = {"float32": 0.0, "float16": 1e-3, "bfloat16": 8e-3}
# Observed worst cases come from 6-layer models; deeper ones accumulate more: a margin of 4x in
# relative error (16x in NMSE) over every figure above.
SAFETY = 4.0
# Never allow more than this: the smallest planted wiring fault on the fixtures is 0.39
# relative (the missing log-SNR term), the layer offsets 0.51 and 0.58.
MAX_REL = 0.2
# A single row may be noisier than the pair as a whole (rows with a small norm): worst row /
# pair ratio 4.8 (f32) and 2.7 (q8_0).
ROW_SLACK = 8.0
# Names whose values never pass through attention: token embeddings, positions, the log-SNR
# features, term and sum.
PRE_ATTENTION = (
    names.TARGET_EMBD,
    names.INP_EMBD,
    names.INP_NOISE_EMBD,
    names.INP_POS,
    *names.LOG_SNR_RECORDS,
    names.layer_name(names.LAYER_INP, 0),
)


@dataclass(frozen=True)
class Tolerance:
    """The relative error a pair may show, and what explains it."""

    rel: float
    sources: tuple[str, ...]

    @property
    def nmse(self) -> float:
        return self.rel**2

    @property
    def row_rel(self) -> float:
        return self.rel * ROW_SLACK


@dataclass(frozen=True)
class TypeInfo:
    """The types in play for a comparison, read once from the two manifests."""

    kv_type: str  # the coarsest type the run's KV caches stored K or V in (REL_KV)
    quant_types: tuple[str, ...]  # non-f32 weight types of the run's models
    ref_dtype: str


EXACT = Tolerance(0.0, ("integer data: exact",))


def type_info(ref: Manifest, run: Manifest) -> TypeInfo:
    """The types the run and the reference computed with, as their manifests state them
    (dump.Build: the run's KV cache types per role, K and V; the reference's compute dtype)."""
    kv = max(run.build_info.kv_cache_types, key=_kv_rel)
    models = (run.model(role) for role in names.ROLES)
    weight_types = {t.lower() for m in models if m is not None for t in m.weight_types}
    return TypeInfo(kv_type=kv, quant_types=tuple(sorted(weight_types - {"f32"})), ref_dtype=ref.build_info.dtype)


def _kv_rel(kv_type: str) -> float:
    return REL_KV.get(kv_type, REL_KV_UNKNOWN)


def tolerance_for(name: str, is_integer: bool, types: TypeInfo) -> Tolerance:
    """The tolerance of one pair, by the reference's name of the tensor and the types in play."""
    if is_integer:
        return EXACT
    terms: list[tuple[str, float]] = [("f32", REL_F32)]
    if name not in PRE_ATTENTION:
        terms.append((f"{types.kv_type} KV cache", _kv_rel(types.kv_type)))
    terms += [(f"{t} weights", REL_WEIGHT.get(t, REL_WEIGHT_UNKNOWN)) for t in types.quant_types]
    terms.append((f"reference {types.ref_dtype}", REL_REF_DTYPE.get(types.ref_dtype, 0.0)))
    kept = [(label, v) for label, v in terms if v > 0.0]
    rel = min(MAX_REL, SAFETY * math.sqrt(sum(v * v for _, v in kept)))
    return Tolerance(rel=rel, sources=tuple(label for label, _ in kept))


def describe(types: TypeInfo) -> dict[str, Any]:
    """The types as plain data, for the report."""
    return {"kv_type": types.kv_type, "quant_types": list(types.quant_types), "ref_dtype": types.ref_dtype}
