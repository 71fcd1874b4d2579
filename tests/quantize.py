"""Quantize a GGUF's 2-D weights (Q8_0 by default) with gguf-py's own quantizer (or another one
given), keeping every metadata key: a correctly wired run whose only difference is the weight type.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

ARCH_KEY = "general.architecture"


def quantize_gguf(
    src: Path,
    dst: Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    quantizer: Callable[[np.ndarray, GGMLQuantizationType], np.ndarray] = quantize,
) -> Path:
    """Write `dst`: `src` with each f32 matrix whose rows split into `qtype` blocks quantized by
    `quantizer` (the rows' bytes, numpy order), the others kept."""
    block = GGML_QUANT_SIZES[qtype][0]  # the row width must be a multiple of it
    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), str(reader.fields[ARCH_KEY].contents()))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == ARCH_KEY:
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.tensor_type == GGMLQuantizationType.F32 and data.ndim == 2 and data.shape[1] % block == 0:
            writer.add_tensor(t.name, quantizer(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
