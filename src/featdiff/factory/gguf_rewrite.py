"""Rewriting a GGUF: every key and tensor of a file copied to another (or to itself), with some
replaced, added or dropped. The fixtures that add a feature's keys to the clean drafter, the
DFlash2 fixture and the planted converter faults all write their GGUFs through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from featdiff.core import names
from featdiff.core.outputs import replaced

DROP = None  # a key or tensor value that removes it
Changes = Mapping[str, Any]  # name -> new value, or DROP


def rewrite_gguf(src: Path, dst: Path, keys: Changes | None = None, tensors: Changes | None = None) -> Path:
    """`src` written to `dst` (may be `src`) with every key and tensor copied, in order, except
    `keys` / `tensors` (replaced, added at the end, or dropped with DROP); return `dst`."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    keys, tensors = dict(keys or {}), dict(tensors or {})
    reader = GGUFReader(str(src))
    with replaced(Path(dst)) as tmp:
        wr = GGUFWriter(str(tmp), str(reader.fields[names.KEY_ARCH].contents()))
        for key, f in reader.fields.items():
            if key.startswith("GGUF.") or key == names.KEY_ARCH or (key in keys and keys[key] is DROP):
                continue
            sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
            value = keys.pop(key, f.contents())
            wr.add_key_value(key, value, f.types[0], sub)
        for key, value in keys.items():
            if value is not DROP:
                _add_new_key(wr, key, value)
        for t in reader.tensors:
            if t.name in tensors:
                new = tensors.pop(t.name)
                if new is not DROP:
                    wr.add_tensor(t.name, np.asarray(new, dtype=np.float32))
                continue
            wr.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        for name, new in tensors.items():
            if new is not DROP:
                wr.add_tensor(name, np.asarray(new, dtype=np.float32))
        wr.write_header_to_file()
        wr.write_kv_data_to_file()
        wr.write_tensors_to_file()
        wr.close()
    return Path(dst)


def _add_new_key(wr, key: str, value: Any) -> None:
    """A key `src` lacks, typed as the converter writes it: str, bool, f32, u32, arrays."""
    if isinstance(value, bool):  # before int: a bool is an int to Python, not to llama.cpp's loader
        wr.add_bool(key, value)
    elif isinstance(value, str):
        wr.add_string(key, value)
    elif isinstance(value, list):
        wr.add_array(key, value)
    elif isinstance(value, float):
        wr.add_float32(key, value)
    else:
        wr.add_uint32(key, int(value))
