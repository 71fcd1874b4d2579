"""What the evidence says of the export: per role, whether the reference was built from the run's
own GGUF (same sha256), from a HF checkpoint or from another GGUF, and which GGUF keys and tensors
differ between what the two sides read. Consumes the two manifests (and the GGUFs they name, when
both sides read a GGUF that is on this machine); produces `Export`, read by diff/attribution.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from featdiff.core import names
from featdiff.core.errors import InputError
from featdiff.core.gguf_reader import GgufModel, read_gguf
from featdiff.core.names import ROLES, Role
from featdiff.dump.manifest import Manifest
from featdiff.dump.manifest_fields import ModelInfo

Origin = Literal["same_file", "checkpoint", "other_gguf", "unknown"]
GGUF_SUFFIX = ".gguf"
# Keys that name or describe the file, not what llama.cpp computes with: never a fault's evidence
DESCRIPTIVE_KEY_PREFIXES = ("general.", "GGUF.")
# Bytes of tensor data compared per role at most (two drafters, or a small target); past it only the
# keys and the tensors' names, types and shapes are compared, and the comparison says so
MAX_COMPARED_BYTES = 1 << 30
# ModelInfo fields both producers write in the GGUF's convention (a checkpoint's converted as the
# pinned converter does): where they differ, the GGUF's key differs from the checkpoint's
CONVERTED_FIELDS = (
    "target_layers",
    "block_size",
    "mask_token_id",
    "log_snr",
    "has_own_embeddings",
    "rope_freq_base",
    "n_layer",
    "n_embd",
    "n_vocab",
)


@dataclass(frozen=True)
class RoleExport:
    """One role's export evidence: where the reference's weights came from (`origin`), what differs
    from the run's GGUF (keys and tensor names, or manifest fields of a checkpoint), and whether
    every tensor was compared (`complete`: the same file, both GGUFs read in full, or every GGUF
    tensor found by value among the checkpoint's)."""

    origin: Origin
    differs: tuple[str, ...] = ()
    complete: bool = False
    # every GGUF key compared too (the same file, another GGUF read in full); a checkpoint's keys are
    # compared only as far as the manifests' converted fields go
    keys_complete: bool = False


@dataclass(frozen=True)
class Export:
    """Every role's export evidence; `gguf` is the run's GGUF of a role, for the sentences."""

    roles: dict[Role, RoleExport]
    gguf: dict[Role, str]

    @property
    def differs(self) -> tuple[str, ...]:
        return tuple(f"{d} ({role})" if len(self.roles) > 1 else d for role, e in self.roles.items() for d in e.differs)

    def of_role(self, role: Role | None) -> Export:
        """The evidence of one role (a finding's record is computed from that role's model), or all
        of it when the role is not known or not described."""
        if role is None or role not in self.roles:
            return self
        return Export(roles={role: self.roles[role]}, gguf={role: self.gguf[role]})


NO_EXPORT = Export(roles={}, gguf={})


def export_of(ref: Manifest, run: Manifest) -> Export:
    """The export evidence of the roles the run's manifest describes."""
    roles: dict[Role, RoleExport] = {}
    gguf: dict[Role, str] = {}
    for role in ROLES:
        m, r = run.model(role), ref.model(role)
        if m is None:
            continue
        gguf[role] = m.path
        roles[role] = role_export(r, m)
    return Export(roles=roles, gguf=gguf)


def role_export(ref: ModelInfo | None, run: ModelInfo) -> RoleExport:
    """One role's evidence: the same file, a checkpoint (its converted fields compared), another
    GGUF (its keys and tensors compared, when both files are here), or unknown."""
    if ref is None or not ref.path:
        return RoleExport("unknown")
    if run.sha256 and ref.sha256 == run.sha256:
        return RoleExport("same_file", complete=True, keys_complete=True)
    if not ref.path.endswith(GGUF_SUFFIX):
        return _checkpoint_export(ref, run)
    if not (Path(ref.path).is_file() and Path(run.path).is_file()):
        return RoleExport("other_gguf", differs=_field_differences(ref, run))
    try:
        differs, complete = gguf_differences(Path(ref.path), Path(run.path))
    except InputError:  # one of them is not a readable GGUF: the manifests' fields are what is known
        return RoleExport("other_gguf", differs=_field_differences(ref, run))
    return RoleExport("other_gguf", differs=differs, complete=complete, keys_complete=complete)


def _checkpoint_export(ref: ModelInfo, run: ModelInfo) -> RoleExport:
    """A checkpoint's converted fields against the GGUF's, and, when both are on this machine, the
    GGUF's tensors against the checkpoint's by value (checkpoint_differences)."""
    fields = _field_differences(ref, run)
    if not (Path(ref.path).is_dir() and Path(run.path).is_file()):
        return RoleExport("checkpoint", differs=fields)
    try:
        differs, complete = checkpoint_differences(Path(ref.path), Path(run.path))
    except (InputError, ValueError, OSError):  # an unreadable file: the manifests' fields are what is known
        return RoleExport("checkpoint", differs=fields)
    return RoleExport("checkpoint", differs=fields + differs, complete=complete)


def _field_differences(ref: ModelInfo, run: ModelInfo) -> tuple[str, ...]:
    """The converted fields whose values differ, `target_layers [2, 4] in the GGUF, [1, 3] in the reference's`."""
    out = []
    for name in CONVERTED_FIELDS:
        a, b = getattr(run, name), getattr(ref, name)
        if a != b:
            out.append(f"{name} {_shown(a)} in the run's, {_shown(b)} in the reference's")
    return tuple(out)


def _shown(v: object) -> str:
    return str(list(v)) if isinstance(v, tuple) else str(v)


def gguf_differences(ref: Path, run: Path) -> tuple[tuple[str, ...], bool]:
    """The keys and tensors that differ between two GGUFs (descriptive keys left out), and whether
    every tensor's data was compared (MAX_COMPARED_BYTES)."""
    a, b = read_gguf(run), read_gguf(ref)
    keys = _keys(a), _keys(b)
    differs = [k for k in sorted(keys[0].keys() | keys[1].keys()) if keys[0].get(k) != keys[1].get(k)]
    shared = sorted(a.tensors.keys() & b.tensors.keys())
    differs += sorted(a.tensors.keys() ^ b.tensors.keys())
    differs += [
        n for n in shared if a.tensors[n].ne != b.tensors[n].ne or a.tensors[n].ggml_type != b.tensors[n].ggml_type
    ]
    size = sum(int(a.data[n].n_bytes) for n in shared)
    complete = size <= MAX_COMPARED_BYTES
    if complete:
        differs += [n for n in shared if n not in differs and not _same_data(a, b, n)]
    return tuple(differs), complete


def _keys(g: GgufModel) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, f in g.reader.fields.items():
        if not key.startswith(DESCRIPTIVE_KEY_PREFIXES):
            value = f.contents()
            out[key] = tuple(value) if isinstance(value, list) else value
    return out


def _same_data(a: GgufModel, b: GgufModel, name: str) -> bool:
    return bool(np.array_equal(np.asarray(a.data[name].data), np.asarray(b.data[name].data)))


# --- a checkpoint's tensors against a GGUF's, by value -------------------------------------------

SAFETENSORS_HEADER = 8  # bytes: the little-endian u64 length of the JSON header
SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64, "I32": np.int32}
GGUF_FLOAT_TYPES = ("f32", "f16", "bf16", "i32", "i64")  # read as they are; other types are quantized
# A GGUF tensor holds a checkpoint tensor when their relative error is at most this: the converter
# writes f32 / f16 / bf16 copies of the checkpoint's values (bf16 rounding: 2**-8 = 3.9e-3)
SAME_VALUES_REL = 1e-2
# A converter bug changes a tensor or two; a converter that rewrites an architecture's values (norm
# weights stored + 1, heads permuted for RoPE) changes many, and then values tell nothing: past this
# many differing tensors the by-value comparison is inconclusive (incomplete, none named)
MAX_VALUE_DIFFERS = 2


def checkpoint_differences(hf_dir: Path, gguf: Path) -> tuple[tuple[str, ...], bool]:
    """The GGUF's tensors whose values no checkpoint tensor of the same shape holds (the converter
    maps names, not values: a tensor it copied is found by value), and whether every GGUF tensor
    was compared: a quantized one, one with no checkpoint tensor of its shape (a tensor the converter
    computes, such as rope_freqs) or past MAX_COMPARED_BYTES leaves the comparison incomplete. An
    integer vector also matches the checkpoint's plus its index: EAGLE3's d2t, offsets in the
    checkpoint, absolute ids in the GGUF (the pinned converter's rule)."""
    g = read_gguf(gguf)
    if sum(int(t.n_bytes) for t in g.data.values()) > MAX_COMPARED_BYTES:
        return (), False
    by_shape: dict[tuple[int, ...], list[np.ndarray]] = {}
    for array in _safetensors_arrays(hf_dir):
        by_shape.setdefault(array.shape, []).append(array)
    differs: list[str] = []
    complete = True
    for name, t in sorted(g.data.items()):
        if g.tensors[name].ggml_type not in GGUF_FLOAT_TYPES:
            complete = False
            continue
        value = _gguf_values(t, g.tensors[name].ggml_type)
        candidates = by_shape.get(value.shape, []) + by_shape.get(tuple(v for v in value.shape if v != 1), [])
        if not candidates:
            complete = False
        elif not any(_same_values(value, c) for c in candidates):
            differs.append(name)
    if len(differs) > MAX_VALUE_DIFFERS:
        return (), False
    return tuple(differs), complete


def _safetensors_arrays(hf_dir: Path) -> list[np.ndarray]:
    """Every tensor of the directory's safetensors files, as float64 (bf16 widened), int as int64."""
    out = []
    for path in sorted(hf_dir.glob(names.HF_WEIGHTS_GLOB)):
        raw = path.read_bytes()
        n = int.from_bytes(raw[:SAFETENSORS_HEADER], "little")
        header = json.loads(raw[SAFETENSORS_HEADER : SAFETENSORS_HEADER + n])
        base = SAFETENSORS_HEADER + n
        for key, entry in header.items():
            dtype = SAFETENSORS_DTYPES.get(entry.get("dtype", "")) if key != "__metadata__" else None
            if dtype is None:
                continue
            begin, end = entry["data_offsets"]
            a = np.frombuffer(raw[base + begin : base + end], dtype=dtype).reshape(entry["shape"])
            out.append(_widened(a, entry["dtype"] == "BF16"))
    return out


def _widened(a: np.ndarray, is_bf16: bool) -> np.ndarray:
    if is_bf16:  # bf16 is the upper half of an f32
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.int64 if a.dtype.kind == "i" else np.float64)


def _gguf_values(t: Any, ggml_type: str) -> np.ndarray:
    return (
        _widened(np.asarray(t.data).view(np.uint16), True)
        if ggml_type == "bf16"
        else _widened(np.asarray(t.data), False)
    )


def _same_values(gguf: np.ndarray, hf: np.ndarray) -> bool:
    a, b = gguf.reshape(hf.shape) if gguf.size == hf.size else gguf, hf
    if a.shape != b.shape:
        return False
    if a.dtype.kind == "i" or b.dtype.kind == "i":
        return bool(np.array_equal(a, b) or (a.ndim == 1 and np.array_equal(a, b + np.arange(a.size))))
    den = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) <= SAME_VALUES_REL * max(den, 1e-30)
