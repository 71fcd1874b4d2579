"""Dump format v1: the reader the consumers (compare, report) read a dump through. `read_dump` checks
the zip's directory, every manifest field and each member's size against its record once, at the
boundary; `Dump.array` checks a member's `.npy` header before it reads exactly the declared bytes
(docs/dump.md, "Reading limits").
"""

from __future__ import annotations

import json
import tokenize
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from featdiff.core.errors import InputError
from featdiff.dump.manifest import Manifest
from featdiff.dump.manifest_fields import ManifestError, shown
from featdiff.dump.records import FORMAT, MANIFEST_MEMBER, NPY_SUFFIX, RERUN, VERSION, Record

# Reading limits (docs/dump.md "Reading limits"): what a hostile file may cost the reader.
MAX_MANIFEST_BYTES = 64 << 20  # ~170,000 records at ~400 bytes each; a 2,700-record capture writes 1 MB
MAX_INFLATION = 100  # a deflated member may inflate to 100x its compressed size (real arrays: < 10x) ...
INFLATION_FLOOR = 1 << 20  # ... or to 1 MiB, whichever is more (a small all-zero array deflates ~1000x)
NPY_MIN_HEADER = 10  # magic (6), version (2), header length (2 in .npy 1.0, 4 in 2.0): numpy.lib.format
NPY_MAX_HEADER_TEXT = 10_000  # numpy's own cap on a header's text (read_array_header_* max_header_size)
NPY_MAX_HEADER = 12 + NPY_MAX_HEADER_TEXT  # the longest preamble (.npy 2.0) and that text
READ_CHUNK = 1 << 20  # bytes an array read inflates at a time

# What reading a damaged member raises: a bad local header or CRC, bad deflate data, a short
# member, an I/O error, a malformed .npy header (numpy raises ValueError), a zip feature zipfile
# does not implement (a version or flag a damaged entry claims).
_DAMAGE = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError)
ZIP_UNSUPPORTED_FLAGS = 0x1 | 0x20 | 0x40  # encrypted, compressed patched data, strong encryption (APPNOTE 4.4.4)


def _one_line(e: BaseException) -> str:
    """An exception's message, first line only (numpy's header errors run to three)."""
    lines = str(e).splitlines()
    return lines[0] if lines else type(e).__name__


class Dump:
    """A validated dump opened for lazy reading: the manifest now, arrays on demand."""

    def __init__(self, path: Path, manifest: Manifest, zf: zipfile.ZipFile):
        self.path = path
        self.manifest = manifest
        self._zip = zf
        self.by_key = {r.key: r for r in manifest.records}

    def array(self, record: Record | str) -> np.ndarray:
        """The record's array: its `.npy` header checked against the record, then exactly the
        declared bytes read, never more; InputError naming the file and record when the member
        disagrees with its record or is damaged."""
        record = self.by_key[record] if isinstance(record, str) else record
        try:
            info = self._zip.getinfo(record.key + NPY_SUFFIX)
            with self._zip.open(info) as f:
                return read_member_array(f, record, info.file_size)
        except _DAMAGE as e:
            raise InputError(f"{self.path}: record {record.key!r}: {_one_line(e)}; {RERUN}") from None

    def records(self) -> Iterator[Record]:
        return iter(self.manifest.records)

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> Dump:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_npy_header(f: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """A `.npy` stream's (shape, fortran_order, dtype), read up to the data; ValueError when the
    magic, version or header is malformed or the header is longer than numpy's cap."""
    major, minor = np.lib.format.read_magic(f)
    if (major, minor) not in ((1, 0), (2, 0)):
        raise ValueError(f".npy version {major}.{minor}, expected 1.0 or 2.0")
    read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    try:
        return read_header(f, max_header_size=NPY_MAX_HEADER_TEXT)
    except tokenize.TokenError as e:  # numpy's fallback parser of Python 2 headers tokenizes the text
        raise ValueError(f"the .npy header is not a Python literal ({e.args[0]})") from None


def read_member_array(f: IO[bytes], record: Record, size: int) -> np.ndarray:
    """The array of a `.npy` stream of `size` bytes holding `record`: the header must say the
    record's dtype and shape in C order and leave exactly the declared bytes, which are read in
    READ_CHUNK pieces into one array of that size; ValueError when anything disagrees."""
    shape, fortran_order, dtype = read_npy_header(f)
    if dtype != np.dtype(record.dtype) or shape != record.shape or fortran_order:
        order = "Fortran" if fortran_order else "C"
        raise ValueError(
            f"the .npy header says {dtype.str} {shape} in {order} order, the record "
            f"{record.dtype} {record.shape} in C order"
        )
    if f.tell() + record.nbytes != size:
        raise ValueError(
            f"the member holds {size} bytes, a {f.tell()}-byte header and {record.nbytes} data bytes expected"
        )
    out = np.empty(record.shape, dtype=dtype)
    data = out.reshape(-1).view(np.uint8)  # (nbytes,): the array's own memory
    done = 0
    while done < record.nbytes:
        chunk = f.read(min(READ_CHUNK, record.nbytes - done))
        if not chunk:
            raise ValueError(f"the member ends after {done} of {record.nbytes} data bytes")
        data[done : done + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
        done += len(chunk)
    if f.read(1):  # also where zipfile checks the CRC, at the member's end
        raise ValueError(f"the member holds more than its {record.nbytes} data bytes")
    return out


def read_dump(path: str | Path) -> Dump:
    """Open and validate a dump; raise `InputError` naming the file for anything unusable.

    Reads the zip's central directory and the manifest member, and no array data: every member
    is checked for its bounds and compression (`_check_member`), every manifest field for its
    type (`Manifest.from_json`), every record's member for the size its declared array needs."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such dump; run `featdiff capture` or `featdiff reference` to make one")
    try:
        zf = zipfile.ZipFile(path)
    except _DAMAGE as e:
        raise InputError(
            f"{path}: not a readable .npz ({_one_line(e)}); re-run the capture or reference that wrote it"
        ) from None
    try:
        manifest = _manifest_of(path, zf)
    except InputError:
        zf.close()
        raise
    return Dump(path, manifest, zf)


def _manifest_of(path: Path, zf: zipfile.ZipFile) -> Manifest:
    """The checked manifest of an open dump, its members checked against it."""
    infos = zf.infolist()
    names = [i.filename for i in infos]
    dup = _first_duplicate(names)
    if dup is not None:
        raise InputError(f"{path}: member {dup!r} appears twice in the zip; {RERUN}")
    size = path.stat().st_size
    for info in infos:
        _check_member(path, info, size)
    members = dict(zip(names, infos))
    raw = _manifest_json(path, zf, members.get(MANIFEST_MEMBER))
    return _validated_manifest(path, raw, members)


def _check_member(path: Path, info: zipfile.ZipInfo, size: int) -> None:
    """Refuse a member the reader cannot read safely, from its directory entry alone: encrypted,
    compressed other than by deflate, reaching past the file's end, or inflating past
    MAX_INFLATION times its compressed size (and INFLATION_FLOOR): a zip bomb."""
    where = f"{path}: member {info.filename!r}"
    if info.flag_bits & ZIP_UNSUPPORTED_FLAGS:
        raise InputError(
            f"{where} is encrypted or patched (flags {info.flag_bits:#x}); a dump's members are plain. {RERUN}"
        )
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise InputError(
            f"{where} uses zip method {info.compress_type}; a dump's members are stored or deflated. {RERUN}"
        )
    if (
        not 0 <= info.header_offset <= info.header_offset + 30 + info.compress_size <= size
    ):  # 30: a local header's fixed part
        raise InputError(f"{where} reaches past the end of the {size}-byte file (truncated?); {RERUN}")
    if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
        raise InputError(f"{where} is stored in {info.compress_size} bytes but says it holds {info.file_size}; {RERUN}")
    if info.file_size > max(MAX_INFLATION * info.compress_size, INFLATION_FLOOR):
        raise InputError(
            f"{where} inflates {info.compress_size} bytes to {info.file_size}, more than "
            f"{MAX_INFLATION}x: refused as a zip bomb; {RERUN}"
        )


def _manifest_json(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo | None) -> Any:
    """The manifest member parsed, its size checked against MAX_MANIFEST_BYTES before it is read;
    a key twice in one object and NaN / Infinity are refused as not JSON's."""
    if info is None:
        raise InputError(f"{path}: no {MANIFEST_MEMBER} member, so not a featdiff dump; {RERUN}")
    if info.file_size > MAX_MANIFEST_BYTES:
        raise InputError(
            f"{path}: {MANIFEST_MEMBER} is {info.file_size} bytes, more than the "
            f"{MAX_MANIFEST_BYTES} a manifest may take; {RERUN}"
        )
    try:
        with zf.open(info) as f:
            text = f.read(MAX_MANIFEST_BYTES + 1).decode("utf-8")
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (*_DAMAGE, RecursionError) as e:
        raise InputError(f"{path}: {MANIFEST_MEMBER} is unreadable ({_one_line(e)}); {RERUN}") from None


def _first_duplicate(items: list[str]) -> str | None:
    """The first item that appeared before, None when all are distinct."""
    seen: set[str] = set()
    for item in items:
        if item in seen:
            return item
        seen.add(item)
    return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    dup = _first_duplicate([k for k, _ in pairs])
    if dup is not None:
        raise ValueError(f"key {dup!r} appears twice in one object")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _validated_manifest(path: Path, raw: Any, members: dict[str, zipfile.ZipInfo]) -> Manifest:
    """The typed manifest; each record's member present and as large as its declared array
    needs (a header of NPY_MIN_HEADER .. NPY_MAX_HEADER bytes plus the data)."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = shown(raw.get("format")) if isinstance(raw, dict) else shown(raw)
        raise InputError(f"{path}: format {got}, expected {json.dumps(FORMAT)}; this is not a featdiff dump")
    if type(raw.get("version")) is not int or raw["version"] != VERSION:
        raise InputError(
            f"{path}: dump version {shown(raw.get('version'))}, this featdiff reads version "
            f"{VERSION}; upgrade featdiff or re-run the producer"
        )
    try:
        manifest = Manifest.from_json(raw)
    except ManifestError as e:
        raise InputError(f"{path}: {e}; {RERUN}") from None
    dup = _first_duplicate([r.key for r in manifest.records])
    if dup is not None:
        raise InputError(f"{path}: record key {dup!r} appears twice; keys must be unique, re-run the producer")
    for r in manifest.records:
        _check_record_member(path, r, members.get(r.key + NPY_SUFFIX))
    return manifest


def _check_record_member(path: Path, record: Record, info: zipfile.ZipInfo | None) -> None:
    if info is None:
        raise InputError(
            f"{path}: record {record.key!r} has no member {record.key + NPY_SUFFIX!r} (truncated file?); {RERUN}"
        )
    if not NPY_MIN_HEADER <= info.file_size - record.nbytes <= NPY_MAX_HEADER:
        raise InputError(
            f"{path}: record {record.key!r} declares {record.dtype} {record.shape} ({record.nbytes} "
            f"bytes) but its member holds {info.file_size}; {RERUN}"
        )
