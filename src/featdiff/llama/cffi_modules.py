"""Compile and import featdiff's cffi modules (the binding, the ggml dequantizer): each is built
once per llama.cpp build into its own cache directory and imported from there.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from featdiff.errors import InputError


def compile_into(ffi: Any, outdir: Path) -> Path:
    """Compile the cffi module `ffi` describes into `outdir`; return its file. It is compiled in
    a scratch directory and renamed into place, so a concurrent run never sees half a module."""
    tmp = outdir.with_name(outdir.name + f".tmp{os.getpid()}")
    built = Path(ffi.compile(tmpdir=str(tmp), verbose=False))
    outdir.mkdir(parents=True, exist_ok=True)
    final = outdir / built.name
    built.replace(final)
    return final


def import_compiled(modname: str, path: Path, why_not: str) -> ModuleType:
    """Import the compiled module at `path` once per process; an ImportError (a symbol the
    library lacks) is an InputError: `why_not` followed by the loader's reason."""
    if modname in sys.modules:
        return sys.modules[modname]
    loader = importlib.machinery.ExtensionFileLoader(modname, str(path))
    spec = importlib.util.spec_from_file_location(modname, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except ImportError as e:
        raise InputError(f"{why_not} ({e})") from None
    sys.modules[modname] = module
    return module
