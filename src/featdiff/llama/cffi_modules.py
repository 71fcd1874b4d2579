"""Compile and import featdiff's cffi modules (the binding, the ggml dequantizer): each is built
once per llama.cpp build into its own cache directory and imported from there.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from featdiff.core.errors import InputError
from featdiff.core.outputs import no_room_error, raise_if_no_room, room_shortfall

# the room a module's compile needs: above the largest file it writes (the binding's object file,
# 224 KiB on the pinned build, its module 187 KiB), for a larger llama.h or another compiler
COMPILE_ROOM = 4 << 20


def compile_into(ffi: Any, outdir: Path) -> Path:
    """Compile the cffi module `ffi` describes into `outdir`; return its file. It is compiled in
    a scratch directory (removed after) and renamed into place, so a concurrent run never sees
    half a module. Without the room to compile (checked first: the compiler's own failures do not
    say why) it is the user's NoRoomError naming `outdir`."""
    short = room_shortfall(outdir.parent, COMPILE_ROOM)
    if short is not None:
        raise no_room_error(outdir, short)
    tmp = outdir.with_name(outdir.name + f".tmp{os.getpid()}")
    try:
        built = Path(ffi.compile(tmpdir=str(tmp), verbose=False))
        outdir.mkdir(parents=True, exist_ok=True)
        final = outdir / built.name
        built.replace(final)
    except OSError as e:
        raise_if_no_room(e, outdir)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the sources and objects: the module is in `outdir`
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
