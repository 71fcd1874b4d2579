"""Read record arrays from a dump without copying: a v1 dump stores its `.npy` members
uncompressed, so each array can be memory-mapped straight out of the zip. Compare touches
only the rows it aligns, which keeps memory bounded by one pair, not by the dump.
"""

from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from featdiff.dump.reader import Dump, read_npy_header
from featdiff.dump.records import Record

LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header (APPNOTE 4.3.7), 30 bytes
LOCAL_HEADER_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class MemberIndex:
    """Where each stored member's bytes start and end in the file; compressed members are absent."""

    path: Path
    offsets: dict[str, int]
    ends: dict[str, int]


def index_members(dump: Dump) -> MemberIndex:
    """Locate the data of every uncompressed member of `dump`'s file."""
    offsets: dict[str, int] = {}
    ends: dict[str, int] = {}
    with zipfile.ZipFile(dump.path) as zf, open(dump.path, "rb") as f:
        for info in zf.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                continue
            f.seek(info.header_offset)
            fields = LOCAL_HEADER.unpack(f.read(LOCAL_HEADER.size))
            if fields[0] != LOCAL_HEADER_MAGIC:
                continue
            name_len, extra_len = fields[9], fields[10]
            offsets[info.filename] = info.header_offset + LOCAL_HEADER.size + name_len + extra_len
            ends[info.filename] = offsets[info.filename] + info.compress_size
    return MemberIndex(Path(dump.path), offsets, ends)


def read_array(dump: Dump, index: MemberIndex, record: Record) -> np.ndarray:
    """The record's array: a read-only memory map when stored, else a copy read by `dump`.

    Only a member whose `.npy` header says what the record declares, followed by exactly the
    declared bytes, is mapped; any other goes to `dump.array`, which refuses it with an InputError.
    A mapped member's CRC is not checked: that would read it whole."""
    start = index.offsets.get(record.key + ".npy")
    if start is None:
        return dump.array(record)
    with open(index.path, "rb") as f:
        f.seek(start)
        try:
            shape, fortran, dtype = read_npy_header(f)
        except ValueError:
            return dump.array(record)
        data_start = f.tell()
        fits = data_start + record.nbytes == index.ends[record.key + ".npy"] <= f.seek(0, 2)
    if (shape, fortran, dtype) != (record.shape, False, np.dtype(record.dtype)) or not fits or record.nbytes == 0:
        return dump.array(record)
    return np.memmap(index.path, dtype=dtype, mode="r", offset=data_start, shape=shape)
