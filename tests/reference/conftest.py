"""Session fixtures for the reference tests: fixture variants written once, reference dumps
computed once, and a GGUF rewriter for crafted broken drafters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from featdiff import names
from featdiff.fixtures import write_fixture
from featdiff.reference.run import reference

PROMPT = "1,2,3,4,5,6,7,8,9,10"
ROUNDS = 3


class VariantDirs:
    """Fixture variants under one session directory, each written on first use."""

    def __init__(self, root: Path):
        self.root = root

    def __call__(self, variant: str) -> Path:
        out = self.root / variant
        if not (out / "draft.gguf").exists():
            write_fixture(out, variant)
        return out


class ReferenceDumps:
    """Reference dumps keyed by their arguments, computed once."""

    def __init__(self, dirs: VariantDirs, root: Path):
        self.dirs, self.root = dirs, root
        self.made: dict[tuple, Path] = {}

    def __call__(self, variant: str, target: str = "target.gguf", model: str = "draft.gguf",
                 kv_dtype: str = "f16", tokens: str = PROMPT, rounds: int = ROUNDS) -> Path:
        key = (variant, target, model, kv_dtype, tokens, rounds)
        if key not in self.made:
            d = self.dirs(variant)
            out = self.root / f"ref-{len(self.made)}.npz"
            self.made[key] = reference(d / target, d / model, out, prompt=None, tokens=tokens, rounds=rounds,
                                       dtype="float32", device="cpu", kv_dtype=kv_dtype, llama_dir=None)
        return self.made[key]


@pytest.fixture(scope="session")
def variant_dir(tmp_path_factory: pytest.TempPathFactory) -> VariantDirs:
    return VariantDirs(tmp_path_factory.mktemp("variants"))


@pytest.fixture(scope="session")
def ref_dump(variant_dir: VariantDirs, tmp_path_factory: pytest.TempPathFactory) -> ReferenceDumps:
    return ReferenceDumps(variant_dir, tmp_path_factory.mktemp("refdumps"))


def rewrite_gguf(src: Path, dst: Path, *, drop_keys: tuple[str, ...] = (),
                 set_keys: dict[str, tuple[Any, GGUFValueType]] | None = None,
                 drop_tensors: tuple[str, ...] = (),
                 replace_tensors: dict[str, np.ndarray] | None = None) -> Path:
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
