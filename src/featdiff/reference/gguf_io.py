"""Read a GGUF for the reference and for `lint`: metadata values decoded on demand, tensor
shapes (ggml `ne`) and tensors as float32 numpy arrays in numpy order (reversed `ne`).

Quantized tensors are dequantized with the `gguf` package's own `gguf.quants.dequantize`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from featdiff import names
from featdiff.errors import InputError
from featdiff.gguf_meta import open_gguf

_MISSING = object()


@dataclass(frozen=True)
class GgufTensor:
    """One tensor's header: ggml `ne` and type name."""

    name: str
    ne: tuple[int, ...]
    ggml_type: str


@dataclass(frozen=True)
class GgufModel:
    """An opened GGUF: the reader memory-maps the file, so arrays are read on demand."""

    path: Path
    arch: str
    tensors: dict[str, GgufTensor]
    reader: GGUFReader = field(repr=False, compare=False)
    data: dict[str, Any] = field(repr=False, compare=False)  # name -> gguf ReaderTensor


def read_gguf(path: Path) -> GgufModel:
    """Open a GGUF; InputError naming the file when it is not a readable GGUF."""
    path = Path(path)
    reader = open_gguf(path)
    tensors = {
        t.name: GgufTensor(t.name, tuple(int(n) for n in t.shape), t.tensor_type.name.lower()) for t in reader.tensors
    }
    data = {t.name: t for t in reader.tensors}
    arch_field = reader.fields.get(names.KEY_ARCH)
    if arch_field is None:
        raise InputError(f"{path}: metadata key {names.KEY_ARCH!r} is missing; re-export the GGUF with it")
    return GgufModel(path=path, arch=str(arch_field.contents()), tensors=tensors, reader=reader, data=data)


def meta(model: GgufModel, key: str, default: Any = _MISSING) -> Any:
    """A metadata value (`{arch}` in `key` is filled in); InputError when required and absent."""
    key = key.format(arch=model.arch)
    f = model.reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise InputError(f"{model.path}: metadata key {key!r} is missing; re-export the GGUF with it")
        return default
    return f.contents()


def int_meta(model: GgufModel, key: str, default: Any = _MISSING) -> int:
    """An integer metadata value (`{arch}` filled in); InputError naming the file and key when it is
    stored as another type (llama.cpp reads these keys as integers)."""
    value = meta(model, key, default)
    if not _is_int(value):
        raise InputError(
            f"{model.path}: metadata key {key.format(arch=model.arch)!r} = {value!r}, expected an "
            "integer; re-export the GGUF with the trained value"
        )
    return int(value)


def int_list_meta(model: GgufModel, key: str) -> list[int]:
    """An array of integers (`{arch}` filled in); InputError when absent or holding anything else."""
    value = meta(model, key)
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise InputError(
            f"{model.path}: metadata key {key.format(arch=model.arch)!r} = {value!r}, expected an "
            "array of integers; re-export the GGUF with the trained ids"
        )
    return [int(v) for v in value]


def trained_context(model: GgufModel) -> int | None:
    """The positions the model was trained on (`{arch}.context_length`); None when absent."""
    if not has_meta(model, names.KEY_CONTEXT_LENGTH):
        return None
    n = int_meta(model, names.KEY_CONTEXT_LENGTH)
    if n < 1:
        raise InputError(
            f"{model.path}: {names.KEY_CONTEXT_LENGTH.format(arch=model.arch)} = {n}, expected >= 1; "
            "re-export the GGUF with the trained context length"
        )
    return n


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def has_meta(model: GgufModel, key: str) -> bool:
    """Whether the metadata key (with `{arch}` filled in) is present."""
    return key.format(arch=model.arch) in model.reader.fields


def array_len(model: GgufModel, key: str) -> int | None:
    """The length of an array-valued key without decoding it (token lists are long), or None."""
    f = model.reader.fields.get(key)
    if f is None or not f.types or f.types[0] != GGUFValueType.ARRAY:
        return None
    return len(f.data)


def array_from_tensor(model: GgufModel, name: str) -> np.ndarray:
    """A tensor as float32 in numpy order (reversed ggml `ne`); InputError when absent."""
    tensor = model.data.get(name)
    if tensor is None:
        raise InputError(f"{model.path}: tensor {name!r} is missing; re-export the GGUF with it")
    shape = tuple(reversed([int(n) for n in tensor.shape]))
    return np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(
        shape
    )  # a writable copy, reversed ne
