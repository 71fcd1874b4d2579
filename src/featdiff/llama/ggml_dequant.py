"""Dequantize GGUF tensor bytes with a llama.cpp build's own ggml, so the reference reads every
weight type that build reads (Q1_0, IQ*, MXFP4, ...), bit for bit as the run's ggml does.

Consumes a build (featdiff.llama.binding.find_build) and a tensor's raw bytes; produces float32
arrays through `ggml_get_type_traits(type)->to_float`. A small cffi module in API mode, compiled
against the build's ggml.h and linked to its libggml-base only, cached per build under
cache_root()/ggml-dequant. `load` is the loader the GGUF reader takes (featdiff.core.gguf_reader's
`GgmlLoader`), and `Ggml` its `Dequantizer`: the reader, a floor below, never imports this module.
"""

from __future__ import annotations

import hashlib
import logging
import math
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from featdiff.core.cache_dir import cache_root
from featdiff.core.errors import InputError
from featdiff.llama.binding import LlamaBuild, find_build
from featdiff.llama.cffi_modules import compile_into, import_compiled

log = logging.getLogger(__name__)

LIB = "ggml-base"  # ggml_get_type_traits and the row converters live there, no backend needed
LIBGGML_BASE = "libggml-base.dylib" if sys.platform == "darwin" else "libggml-base.so"

CDEF = """
enum ggml_type { GGML_TYPE_F32, GGML_TYPE_COUNT, ... };
typedef void (*ggml_to_float_t)(const void * x, float * y, int64_t k);
struct ggml_type_traits {
    const char * type_name; int64_t blck_size; size_t type_size; ggml_to_float_t to_float; ...;
};
const struct ggml_type_traits * ggml_get_type_traits(enum ggml_type type);
const char * fd_ggml_library(void);
"""

# Two builds' libggml-base share one soname, so in one process the first one loaded serves every
# module linked to either: ask the loader which file it bound rather than assume it.
SOURCE = """
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dladdr; Python.h, included first, usually defines it already */
#endif
#include <dlfcn.h>
#include "ggml.h"

static const char * fd_ggml_library(void) {
    Dl_info info;
    if (dladdr((void *) ggml_get_type_traits, &info) && info.dli_fname) return info.dli_fname;
    return "";
}
"""


@dataclass(frozen=True)
class Ggml:
    """One build's ggml, bound: which types it converts to float32, and the conversion."""

    module: ModuleType  # the compiled cffi module: its `ffi` and `lib`
    library: Path  # the libggml-base file this process bound (what `dequantized_by` records)

    def knows(self, ggml_type: int) -> bool:
        """Whether this ggml converts `ggml_type` to float32 (f32 itself included)."""
        lib = self.module.lib
        if not 0 <= ggml_type < lib.GGML_TYPE_COUNT:  # ggml_get_type_traits aborts past the table
            return False
        traits = lib.ggml_get_type_traits(ggml_type)
        has_converter = traits.to_float != self.module.ffi.NULL or ggml_type == lib.GGML_TYPE_F32
        return traits.blck_size > 0 and has_converter  # removed types keep a row with block size 0

    def type_name(self, ggml_type: int) -> str:
        """ggml's own name of the type (`q1_0`), or `type <id>` when ggml has none."""
        lib = self.module.lib
        if not 0 <= ggml_type < lib.GGML_TYPE_COUNT:
            return f"type {ggml_type}"
        name = lib.ggml_get_type_traits(ggml_type).type_name
        return self.module.ffi.string(name).decode() if name != self.module.ffi.NULL else f"type {ggml_type}"

    def n_bytes(self, ggml_type: int, shape: tuple[int, ...]) -> int:
        """The bytes a tensor of `shape` (numpy order) and this type holds; ValueError for a type
        this ggml does not know or rows that do not split into its blocks."""
        if not self.knows(ggml_type):
            raise ValueError(f"{self.library}: {self.type_name(ggml_type)} has no float32 conversion here")
        traits = self.module.lib.ggml_get_type_traits(ggml_type)
        n_cols = shape[-1] if shape else 1  # ggml blocks run along ne[0], numpy's last axis
        if n_cols % traits.blck_size:
            raise ValueError(
                f"rows of {n_cols} do not split into {self.type_name(ggml_type)} blocks of {traits.blck_size}"
            )
        return math.prod(shape) // traits.blck_size * traits.type_size

    def dequantize(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor whose bytes are `raw` as a new float32 array of `shape` (numpy order);
        ValueError when `raw` is not exactly `n_bytes(ggml_type, shape)` bytes."""
        data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)  # (n_bytes,)
        expected = self.n_bytes(ggml_type, shape)
        if data.size != expected:
            name = self.type_name(ggml_type)
            raise ValueError(f"{data.size} bytes for a {name} tensor of shape {shape}, expected {expected}")
        out = np.empty(shape, dtype=np.float32)
        if ggml_type == self.module.lib.GGML_TYPE_F32:  # ggml has no converter for its own float type
            out.reshape(-1)[:] = data.view(np.float32)
            return out
        ffi = self.module.ffi
        to_float = self.module.lib.ggml_get_type_traits(ggml_type).to_float
        to_float(ffi.from_buffer(data), ffi.from_buffer("float[]", out, require_writable=True), out.size)
        return out

    def teach_gguf_py(self) -> list[str]:
        """Make gguf-py's reader accept the tensor types this ggml knows and gguf-py's enum lacks
        (Q2_0 and any newer one): each gets a member of `GGMLQuantizationType` named as ggml names
        it, and its block size and bytes in `GGML_QUANT_SIZES`, so a GGUF holding it opens, sizes its
        tensors right and reads as that type; its values are then dequantized by this ggml (gguf-py
        has no dequantizer for it). Returns the names taught."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        taught = []
        for type_id in range(self.module.lib.GGML_TYPE_COUNT):
            if type_id in GGMLQuantizationType._value2member_map_ or not self.knows(type_id):
                continue
            traits = self.module.lib.ggml_get_type_traits(type_id)
            member = int.__new__(GGMLQuantizationType, type_id)
            member._name_ = self.type_name(type_id).upper()
            member._value_ = type_id
            GGMLQuantizationType._value2member_map_[type_id] = member
            GGML_QUANT_SIZES[member] = (int(traits.blck_size), int(traits.type_size))
            taught.append(member._name_.lower())
        return taught


def load(llama_dir: Path | None = None) -> Ggml:
    """The build's ggml (`find_build(llama_dir)`), compiled once per build; InputError when this
    process already bound another build's libggml-base (one soname: the first one loaded wins)."""
    build = find_build(llama_dir)
    expected = libggml_base(build)
    module = _module(build, expected)
    library = Path(module.ffi.string(module.lib.fd_ggml_library()).decode())
    # a build's directory may hold copies under each name (libggml-base.so, .so.0): compare where
    if library.resolve().parent != expected.resolve().parent:
        raise InputError(
            f"{expected}: this process already uses another build's ggml ({library}, the same soname), "
            f"so it cannot dequantize with {build.root}; run featdiff with that build in a process of its own"
        )
    return Ggml(module, library)


def libggml_base(build: LlamaBuild) -> Path:
    """The build's libggml-base; InputError naming where it was looked for."""
    found = [d / LIBGGML_BASE for d in build.lib_dirs if (d / LIBGGML_BASE).exists()]
    if not found:
        where = ", ".join(str(d) for d in build.lib_dirs)
        raise InputError(f"{build.root}: no {LIBGGML_BASE} in {where}; build llama.cpp with -DBUILD_SHARED_LIBS=ON")
    return found[0]


def module_key(build: LlamaBuild, library: Path) -> str:
    """A hash of what the compiled module depends on: ggml.h, the library file, the C text, Python."""
    h = hashlib.sha256()
    header = next(d / "ggml.h" for d in build.include_dirs if (d / "ggml.h").is_file())
    h.update(header.read_bytes())
    lib = library.resolve()
    h.update(f"{lib}:{lib.stat().st_size}:{lib.stat().st_mtime_ns}".encode())
    h.update(f"{sys.version_info[:2]}:{CDEF}:{SOURCE}".encode())
    return h.hexdigest()[:16]


def _module(build: LlamaBuild, library: Path) -> ModuleType:
    key = module_key(build, library)
    modname = f"_featdiff_ggml_{key}"
    if modname in sys.modules:
        return sys.modules[modname]
    outdir = cache_root() / "ggml-dequant" / key
    found = list(outdir.glob(f"{modname}*{sysconfig.get_config_var('EXT_SUFFIX')}"))
    path = found[0] if found else _compile(build, library, outdir, modname)
    why = f"{library}: the ggml dequantizer does not load; this ggml lacks ggml_get_type_traits"
    return import_compiled(modname, path, why)


def _compile(build: LlamaBuild, library: Path, outdir: Path, modname: str) -> Path:
    import cffi

    log.info("compiling the ggml dequantizer against %s (once per build)", build.root)
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    lib_dirs = [str(library.parent)]
    ffi.set_source(
        modname,
        SOURCE,
        include_dirs=[str(d) for d in build.include_dirs],
        library_dirs=lib_dirs,
        runtime_library_dirs=lib_dirs,
        libraries=[LIB],
        extra_compile_args=["-O2"],
    )
    return compile_into(ffi, outdir)
