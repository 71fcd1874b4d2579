"""Quantize a GGUF's 2-D weights (Q8_0 by default) with gguf-py's own quantizer, keeping every
metadata key: a correctly wired run whose only difference is the weight type.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

ARCH_KEY = "general.architecture"
QK8_0 = 32  # q8_0 block length: the row width must be a multiple


def quantize_gguf(src: Path, dst: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0) -> Path:
    """Write `dst`: `src` with each f32 matrix whose rows split into q8_0 blocks quantized."""
    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), str(reader.fields[ARCH_KEY].contents()))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == ARCH_KEY:
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.tensor_type == GGMLQuantizationType.F32 and data.ndim == 2 and data.shape[1] % QK8_0 == 0:
            writer.add_tensor(t.name, quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
