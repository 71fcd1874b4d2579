"""The GGUF reader, the one every stage reads a GGUF through: metadata values decoded on demand,
the tensor index (ggml `ne` and type), tensors as float32 numpy arrays in numpy order (reversed
`ne`), and what a dump's manifest records of a model (`model_info`, a `ModelInfo`).

Who dequantizes a file's tensors is decided once, when it is opened for its weights
(`read_gguf_weights`): a named llama.cpp build's own ggml for every tensor (bit for bit what the
run read), else gguf-py's `gguf.quants.dequantize`, else, for a type gguf-py cannot read (Q1_0),
the default build's ggml. f32 tensors are copied as stored. A tensor type newer than gguf-py
(Q2_0) is learnt from the default build's ggml when the file is opened.

A build's ggml sits above this floor (featdiff.llama.ggml_dequant, a cffi build), so it is never
imported here: a caller that may need it passes its loader (`GgmlLoader`: `ggml_dequant.load`),
and the reader uses it through `Dequantizer`. Without one, gguf-py reads alone.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from featdiff.core import names
from featdiff.core.errors import InputError

GGUF_PY = "gguf-py"  # ModelInfo.dequantized_by when the `gguf` package dequantized the weights

log = logging.getLogger(__name__)
_MISSING = object()
HASH_CHUNK = 1 << 22
# gguf-py's reader refuses a tensor type id its enum lacks with this in the message
UNKNOWN_TYPE_MESSAGE = "is not a valid GGMLQuantizationType"
# read as stored, never dequantized: f32 is copied, the integer types (`d2t`) are read raw
STORED_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.I8,
        GGMLQuantizationType.I16,
        GGMLQuantizationType.I32,
        GGMLQuantizationType.I64,
    }
)


class Dequantizer(Protocol):
    """A llama.cpp build's ggml as the reader uses it (featdiff.llama.ggml_dequant.Ggml)."""

    @property
    def library(self) -> Path:
        """The libggml-base file it reads with: what `dequantized_by` records."""
        ...

    def knows(self, ggml_type: int) -> bool: ...

    def type_name(self, ggml_type: int) -> str: ...

    def n_bytes(self, ggml_type: int, shape: tuple[int, ...]) -> int: ...

    def dequantize(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray: ...

    def teach_gguf_py(self) -> list[str]:
        """Make gguf-py's reader accept the types this ggml knows and gguf-py lacks; their names."""
        ...


# The ggml of the build at `llama_dir` (None: the default build); InputError when there is none.
GgmlLoader = Callable[[Path | None], Dequantizer]


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
    ggml: Dequantizer | None = field(default=None, repr=False, compare=False)  # dequantizes; None: gguf-py

    @property
    def dequantized_by(self) -> str:
        """The manifest's `models[role].dequantized_by`: gguf-py, or the libggml-base file."""
        return str(self.ggml.library) if self.ggml is not None else GGUF_PY


def open_gguf(path: Path, ggml: GgmlLoader | None = None) -> GGUFReader:
    """A `gguf.GGUFReader` for `path`, or an InputError naming the file. A tensor type newer
    than gguf-py (Q2_0, ...) is learnt from the default build's ggml (`ggml(None)`), once."""
    for first in (True, False):
        try:
            return GGUFReader(str(path))
        except (ValueError, OSError, KeyError, IndexError) as e:
            if first and ggml is not None and UNKNOWN_TYPE_MESSAGE in str(e) and _learn_types(path, e, ggml):
                continue  # the types it lacked are taught: read again
            raise InputError(f"{path}: not a readable GGUF ({e}); re-export the model") from None
    raise AssertionError("unreachable: the second read returns or raises")


def _learn_types(path: Path, error: Exception, ggml: GgmlLoader) -> bool:
    """Teach gguf-py the tensor types of the default build's ggml; whether any was new."""
    try:
        taught = ggml(None).teach_gguf_py()
    except InputError as e:
        raise InputError(
            f"{path}: holds a tensor type gguf-py does not know ({error}) and no llama.cpp build is at hand to "
            f"read it ({e}); set $FEATDIFF_LLAMA_DIR to a build that reads it"
        ) from None
    log.info("%s: tensor types %s read through the default build's ggml", path, ", ".join(taught) or "none")
    return bool(taught)


def read_gguf(path: Path, ggml: GgmlLoader | None = None) -> GgufModel:
    """Open a GGUF (types newer than gguf-py learnt through `ggml`); InputError naming the file
    when it is not a readable GGUF."""
    path = Path(path)
    reader = open_gguf(path, ggml)
    tensors = {
        t.name: GgufTensor(t.name, tuple(int(n) for n in t.shape), t.tensor_type.name.lower()) for t in reader.tensors
    }
    data = {t.name: t for t in reader.tensors}
    arch_field = reader.fields.get(names.KEY_ARCH)
    if arch_field is None:
        raise InputError(f"{path}: metadata key {names.KEY_ARCH!r} is missing; re-export the GGUF with it")
    return GgufModel(path=path, arch=str(arch_field.contents()), tensors=tensors, reader=reader, data=data)


def read_gguf_weights(path: Path, llama_dir: Path | None, ggml: GgmlLoader) -> GgufModel:
    """`read_gguf`, with the dequantizer its tensors need: the build `llama_dir`'s ggml
    (`ggml(llama_dir)`) for every tensor when one is named, else gguf-py, else, when gguf-py cannot
    read one of its types, the default build's ggml (`ggml(None)`); InputError naming the tensor
    when none can."""
    model = read_gguf(path, ggml)
    if llama_dir is not None:
        return replace(model, ggml=ggml(llama_dir))
    unread_types = {t for t in {t.tensor_type for t in model.data.values()} if not _gguf_py_reads(t)}
    unread = next((t for t in model.data.values() if t.tensor_type in unread_types), None)
    if unread is None:
        return model
    type_name = unread.tensor_type.name.lower()
    try:
        default = ggml(None)
    except InputError as e:
        raise InputError(
            f"{path}: tensor {unread.name!r} is {type_name}, which gguf-py cannot dequantize, and no llama.cpp "
            f"build is at hand for it ({e}); pass --llama-dir DIR, a build that reads {type_name} (the run's)"
        ) from None
    log.info("%s: %s tensors dequantized by %s (gguf-py cannot read them)", path, type_name, default.library)
    return replace(model, ggml=default)


def release_pages(model: GgufModel) -> None:
    """Drop the file pages this process has read through the reader's map: they count in its
    resident set until the kernel reclaims them, so a streamed 8B target would otherwise end up
    resident whole. The map stays valid; a later read faults the pages back in from the page cache."""
    mapped = getattr(model.reader.data, "_mmap", None)  # np.memmap's mmap object
    if isinstance(mapped, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        mapped.madvise(mmap.MADV_DONTNEED)


def _gguf_py_reads(qtype: GGMLQuantizationType) -> bool:
    """Whether gguf-py dequantizes `qtype`: it raises NotImplementedError for a type it lacks, so
    one block of zeros tells."""
    if qtype in STORED_TYPES:
        return True
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    try:
        dequantize(np.zeros(block_bytes, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def meta(model: GgufModel, key: str, default: Any = _MISSING) -> Any:
    """A metadata value (`{arch}` in `key` is filled in): str, number, bool, or list for arrays;
    InputError when required and absent."""
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


def n_embd_of(g: GgufModel) -> int | None:
    """The file's embedding length (`<arch>.embedding_length`), None where it states none."""
    return int_meta(g, names.KEY_EMBEDDING_LENGTH) if has_meta(g, names.KEY_EMBEDDING_LENGTH) else None


def n_vocab_of(g: GgufModel) -> int | None:
    """The vocabulary size llama.cpp uses: the token list, else the embedding table's rows."""
    n = array_len(g, names.KEY_TOKEN_LIST)
    if n is None and names.T_TOKEN_EMBD in g.tensors:
        n = g.tensors[names.T_TOKEN_EMBD].ne[1]
    return n


def array_from_tensor(model: GgufModel, name: str) -> np.ndarray:
    """A tensor as a new float32 array in numpy order (reversed ggml `ne`), dequantized by the
    model's dequantizer (`read_gguf_weights`); InputError when absent or of a type it cannot read."""
    tensor = model.data.get(name)
    if tensor is None:
        raise InputError(f"{model.path}: tensor {name!r} is missing; re-export the GGUF with it")
    shape = tuple(reversed([int(n) for n in tensor.shape]))  # numpy order: reversed ne
    if tensor.tensor_type == GGMLQuantizationType.F32:
        return np.array(tensor.data, dtype=np.float32).reshape(shape)
    if model.ggml is not None:
        return _ggml_array(model, model.ggml, tensor, shape)
    try:
        return np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
    except NotImplementedError:
        raise InputError(
            f"{model.path}: tensor {name!r} is {tensor.tensor_type.name.lower()}, which gguf-py cannot "
            "dequantize; pass --llama-dir DIR, a llama.cpp build that reads it"
        ) from None


def _ggml_array(model: GgufModel, ggml: Dequantizer, tensor: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor dequantized by the build's ggml, after checking ggml reads its type and agrees
    with gguf-py's reader on its size (a type whose layout changed between them would not)."""
    qtype = int(tensor.tensor_type)
    if not ggml.knows(qtype):
        raise InputError(
            f"{model.path}: tensor {tensor.name!r} is {tensor.tensor_type.name.lower()}, which the ggml of "
            f"{ggml.library} does not convert to float32; pass --llama-dir DIR, the build the run used"
        )
    raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)  # (n_bytes,) as the file stores them
    try:
        expected = ggml.n_bytes(qtype, shape)
    except ValueError as e:  # rows that do not split into this ggml's blocks
        raise InputError(
            f"{model.path}: tensor {tensor.name!r}: {e}; pass the build the GGUF was written for"
        ) from None
    if raw.size != expected:
        raise InputError(
            f"{model.path}: tensor {tensor.name!r} ({ggml.type_name(qtype)}, shape {shape}) holds {raw.size} "
            f"bytes, {ggml.library} expects {expected}; pass the build the GGUF was written for"
        )
    return ggml.dequantize(raw, qtype, shape)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()
