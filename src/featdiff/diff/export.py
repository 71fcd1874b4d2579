"""What the evidence says of the export: per role, whether the reference was built from the run's
own GGUF (same sha256), from a HF checkpoint or from another GGUF, and which GGUF keys and tensors
differ between what the two sides read. Consumes the two manifests (and the GGUFs they name, when
both sides read a GGUF that is on this machine); produces `Export`, read by diff/attribution.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from featdiff.dump import Manifest
from featdiff.errors import InputError
from featdiff.gguf_reader import GgufModel, read_gguf
from featdiff.manifest_fields import ModelInfo
from featdiff.names import ROLES, Role

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
    every key and tensor was compared (`complete`: both GGUFs read in full, or the same file)."""

    origin: Origin
    differs: tuple[str, ...] = ()
    complete: bool = False


@dataclass(frozen=True)
class Export:
    """Every role's export evidence; `gguf` is the run's GGUF of a role, for the sentences."""

    roles: dict[Role, RoleExport]
    gguf: dict[Role, str]

    @property
    def differs(self) -> tuple[str, ...]:
        return tuple(f"{d} ({role})" if len(self.roles) > 1 else d for role, e in self.roles.items() for d in e.differs)


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
        return RoleExport("same_file", complete=True)
    if not ref.path.endswith(GGUF_SUFFIX):
        return RoleExport("checkpoint", differs=_field_differences(ref, run))
    if not (Path(ref.path).is_file() and Path(run.path).is_file()):
        return RoleExport("other_gguf", differs=_field_differences(ref, run))
    try:
        differs, complete = gguf_differences(Path(ref.path), Path(run.path))
    except InputError:  # one of them is not a readable GGUF: the manifests' fields are what is known
        return RoleExport("other_gguf", differs=_field_differences(ref, run))
    return RoleExport("other_gguf", differs=differs, complete=complete)


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
