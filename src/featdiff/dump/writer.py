"""Dump format v1: the writer the producers (capture, reference) write a dump through, member by
member, the manifest last (`DumpWriter`), and the record of an array computed outside llama.cpp
(`record_from_array`).
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from featdiff.core.names import Role
from featdiff.core.outputs import is_no_room, no_room_error, partial_path
from featdiff.core.phases import Phase
from featdiff.dump.manifest import Manifest
from featdiff.dump.records import MANIFEST_MEMBER, NPY_SUFFIX, Record, stored_array


@dataclass
class DumpWriter:
    """Writes a dump member by member; the manifest goes in last, on `close`.

    The file is written under a temporary name (featdiff.core.outputs.partial_path) and renamed at the
    end, so an existing dump at `path` is never left half-overwritten. A write that fails removes
    the temporary file; one that runs out of room (disk, quota, `ulimit -f`) is an InputError
    naming `path` (featdiff.core.outputs.no_room_error).
    """

    path: Path
    _zip: zipfile.ZipFile | None = field(default=None, init=False)
    _records: list[Record] = field(default_factory=list, init=False)
    _keys: set[str] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self._tmp = partial_path(self.path)
        try:
            self._zip = zipfile.ZipFile(self._tmp, "w", zipfile.ZIP_STORED, allowZip64=True)
        except OSError as e:
            raise self._failed(e) from None

    def add(self, record: Record, array: np.ndarray) -> None:
        """Store one record's array; its `dtype`/`shape` fields must match what is stored."""
        if record.shape != array.shape or record.dtype != str(array.dtype):
            raise ValueError(
                f"{record.key}: record says {record.dtype}{record.shape}, array is {array.dtype}{array.shape}"
            )
        assert self._zip is not None
        if record.key in self._keys:  # a bug of the producer's: never a zip the reader refuses
            self._failed(OSError())
            raise ValueError(f"{self.path}: record {record.key} written twice; nothing was written (a featdiff bug)")
        self._keys.add(record.key)
        try:
            with self._zip.open(record.key + NPY_SUFFIX, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, array, allow_pickle=False)
        except OSError as e:
            raise self._failed(e) from None
        self._records.append(record)

    def close(self, manifest: Manifest) -> Path:
        """Write the manifest (its records are those added) and move the file into place."""
        assert self._zip is not None
        full = Manifest(**{**manifest.__dict__, "records": tuple(self._records)})
        try:
            self._zip.writestr(MANIFEST_MEMBER, json.dumps(full.to_json(), indent=1, sort_keys=True))
            self._zip.close()
        except OSError as e:
            raise self._failed(e) from None
        self._zip = None
        self._tmp.replace(self.path)
        return self.path

    def _failed(self, e: OSError) -> BaseException:
        """Remove the temporary file after a failed write; what to raise for `e`: an InputError
        naming the dump when it ran out of room, else `e` itself (a bug or a broken disk)."""
        zf, self._zip = self._zip, None
        if zf is not None:
            try:
                zf.close()  # releases the file even when its central directory cannot be written
            except (OSError, ValueError):  # that write failing too changes nothing: the file goes
                pass
        self._tmp.unlink(missing_ok=True)
        return no_room_error(self.path, e) if is_no_room(e) else e


def record_from_array(
    key: str,
    role: Role,
    phase: Phase,
    eval_index: int,
    name: str,
    occurrence: int,
    array: np.ndarray,
    op: str = "NONE",
    ggml_type: str = "f32",
    srcs: tuple[str, ...] = (),
) -> tuple[Record, np.ndarray]:
    """A record for an array computed outside llama.cpp (the reference), ne = reversed shape."""
    stored = stored_array(array)
    record = Record(
        key=key,
        role=role,
        phase=phase,
        eval=eval_index,
        name=name,
        occurrence=occurrence,
        op=op,
        ggml_type=ggml_type,
        ne=tuple(reversed(stored.shape)),
        srcs=srcs,
        dtype=str(stored.dtype),
        shape=tuple(stored.shape),
    )
    return record, stored
