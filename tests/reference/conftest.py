"""Fixtures for the reference tests: the session's variants and reference dumps (tests/conftest.py)
under the names these tests use, and a GGUF rewriter for crafted broken drafters."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from featdiff.core import names

PROMPT = "1,2,3,4,5,6,7,8,9,10"
ROUNDS = 3


@pytest.fixture(scope="session")
def variant_dir(fixture_models):
    return fixture_models


@pytest.fixture(scope="session")
def ref_dump(referenced):
    """The shared reference dumps, by default of the GGUF drafter on a plain prompt."""
    return functools.partial(referenced, model="draft.gguf", tokens=PROMPT, rounds=ROUNDS)


def rewrite_gguf(
    src: Path,
    dst: Path,
    *,
    drop_keys: tuple[str, ...] = (),
    set_keys: dict[str, tuple[Any, GGUFValueType]] | None = None,
    drop_tensors: tuple[str, ...] = (),
    replace_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Copy a GGUF with keys/tensors dropped, set or replaced: crafted broken inputs."""
    reader = GGUFReader(str(src))
    arch = reader.fields[names.KEY_ARCH].contents()
    writer = GGUFWriter(str(dst), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == names.KEY_ARCH or key in drop_keys:
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), f.types[0], sub)
    for key, (value, vtype) in (set_keys or {}).items():
        sub = GGUFValueType.INT32 if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub)
    for t in reader.tensors:
        if t.name not in drop_tensors:
            writer.add_tensor(t.name, np.array((replace_tensors or {}).get(t.name, t.data)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="session")
def edit_gguf():
    """The GGUF rewriter, for tests that craft broken drafters."""
    return rewrite_gguf
