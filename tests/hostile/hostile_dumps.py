"""Hostile dumps for tests/hostile: a small dump shaped like a real capture, the rewriting of a
dump member by member, the zip structures a crafted file needs (a zip bomb written by hand), and
the random mutations the fuzz test draws."""

from __future__ import annotations

import copy
import io
import json
import random
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from featdiff.dump.manifest import Manifest
from featdiff.dump.records import MANIFEST_MEMBER, Eval, MemoryOp, Round, record_key
from featdiff.dump.writer import DumpWriter, record_from_array

# --- a small dump shaped like a real capture ----------------------------------------------------

N_EMBD = 6
N_OUT = 8  # result_output's width
PROMPT = (5, 9, 2, 7, 3)
DRAFTS = (11, 12)
MASK = 99
MODELS = {
    "target": {
        "path": "target.gguf",
        "sha256": "0" * 64,
        "architecture": "qwen3",
        "n_layer": 3,
        "n_embd": N_EMBD,
        "n_vocab": 128,
        "weight_types": ["f32", "q8_0"],
        "rope_freq_base": 10000.0,
    },
    "draft": {
        "path": "draft.gguf",
        "sha256": "1" * 64,
        "architecture": "dflash",
        "n_layer": 1,
        "n_embd": N_EMBD,
        "n_vocab": 128,
        "weight_types": ["f32"],
        "target_layers": [1, 2],
        "block_size": 3,
        "mask_token_id": MASK,
        "log_snr": None,
        "has_own_embeddings": False,
        "has_log_snr_tensors": False,
        "rope_freq_base": 10000.0,
        "dspark": None,
    },
}
BUILD = {
    "filters": {"target": ["*"], "draft": ["*", "!* (view)"]},
    "commit": "b4242",
    "draft_max": 2,
    "p_min": 0.0,
    "kv_types": {"target": {"k": "f16", "v": "f16"}, "draft": {"k": "q8_0", "v": "f16"}},
    "library": "libllama.so",
    "command": ["llama-speculative-simple", "-m", "target.gguf"],
}
NB = (4, 4 * N_EMBD, 16 * N_EMBD, 16 * N_EMBD)  # byte strides as ggml writes them (4 entries)


def _rows(rng: np.random.Generator, n: int, width: int = N_EMBD) -> np.ndarray:
    return rng.standard_normal((n, width)).astype(np.float32)  # (n_tokens, width)


def _flow() -> list[tuple[Eval, list[tuple[str, np.ndarray]]]]:
    """A prefill of 4 tokens, its inject, and one round (draft, verify, inject), with their records."""
    rng = np.random.default_rng(0)
    pre, block = tuple(range(4)), (4, 5, 6)
    return [
        (
            Eval(0, "target", "prefill", 4, pre, PROMPT[:-1], (0,) * 4),
            [("l_out-0", _rows(rng, 4)), ("l_out-1", _rows(rng, 4)), ("inp_pos", np.arange(4, dtype=np.int32))],
        ),
        (
            Eval(1, "draft", "inject", 4, pre, (), (0,) * 4),
            [("inp_target_features", _rows(rng, 4, 2 * N_EMBD)), ("inp_g_embeddings", _rows(rng, 4))],
        ),
        (
            Eval(2, "draft", "draft", 3, block, (PROMPT[-1], MASK, MASK), (0,) * 3, round=1),
            [("inp_noise_embd", _rows(rng, 3)), ("result_output", _rows(rng, 3, N_OUT))],
        ),
        (
            Eval(3, "target", "verify", 3, block, (PROMPT[-1], *DRAFTS), (0,) * 3, round=1),
            [("l_out-0", _rows(rng, 3)), ("l_out-1", _rows(rng, 3)), ("result_output", _rows(rng, 3, N_OUT))],
        ),
        (
            Eval(4, "draft", "inject", 3, block, (), (0,) * 3, round=1),
            [("inp_target_features", _rows(rng, 3, 2 * N_EMBD)), ("inp_g_embeddings", _rows(rng, 3))],
        ),
    ]


def write_capture_like(path: Path) -> Path:
    """A llama.cpp-source dump with every manifest field a capture writes and 12 tiny records."""
    writer = DumpWriter(path)
    flow = _flow()
    for ev, records in flow:
        for name, array in records:
            record, stored = record_from_array(
                record_key(ev.eval, ev.role, name, 0),
                ev.role,
                ev.phase,
                ev.eval,
                name,
                0,
                array,
                op="ADD",
                srcs=("a", "b"),
            )
            writer.add(replace(record, nb=NB, ggml_type="i32" if array.dtype == np.int32 else "f32"), stored)
    manifest = Manifest(
        source="llama.cpp",
        models=MODELS,
        build=BUILD,
        evals=tuple(ev for ev, _ in flow),
        records=(),
        rounds=(Round(1, 4, PROMPT[-1], DRAFTS, 1, (DRAFTS[0], 42)),),
        prompt_tokens=PROMPT,
        memory_ops=(MemoryOp("draft", 3, 0, 5, -1), MemoryOp("target", 4, -1, -1, -1, "clear")),
        flow_notes=("round 1 was inferred from the positions",),
    )
    return writer.close(manifest)


# --- rewriting a dump -------------------------------------------------------------------------

Edit = Callable[[str, bytes], "bytes | None"]


def _keep(name: str, data: bytes) -> bytes:
    return data


def zip_bytes(src: bytes, edit: Edit = _keep, method: int = zipfile.ZIP_STORED) -> bytes:
    """The zip `src` re-zipped: each member's bytes through `edit` (None drops the member)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(src)) as zin, zipfile.ZipFile(out, "w", method) as zout:
        for name in zin.namelist():
            data = edit(name, zin.read(name))
            if data is not None:
                zout.writestr(name, data)
    return out.getvalue()


def rezip(src: Path, dst: Path, edit: Edit = _keep, method: int = zipfile.ZIP_STORED) -> Path:
    dst.write_bytes(zip_bytes(src.read_bytes(), edit, method))
    return dst


def manifest_edit(change: Callable[[dict], Any]) -> Edit:
    """An Edit of manifest.json: `change(manifest)` returns the new JSON value, or raw bytes."""
    return lambda name, data: _changed(change, data) if name == MANIFEST_MEMBER else data


def _changed(change: Callable[[dict], Any], data: bytes) -> bytes:
    new = change(json.loads(data))
    return new if isinstance(new, bytes) else json.dumps(new).encode()


def member_edit(key: str, data: bytes | None) -> Edit:
    """An Edit that replaces (None: drops) record `key`'s member."""
    return lambda name, old: data if name == key + ".npy" else old


def npy(array: np.ndarray, **kwargs: Any) -> bytes:
    f = io.BytesIO()
    np.lib.format.write_array(f, array, **kwargs)
    return f.getvalue()


DELETE = object()


def set_at(value: Any, path: tuple, new: Any) -> Any:
    """A copy of `value` with the item at `path` (keys and indices) set to `new`; DELETE removes it."""
    value = copy.deepcopy(value)
    parent = value
    for step in path[:-1]:
        parent = parent[step]
    if new is DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return value


FIRST = record_key(0, "target", "l_out-0", 0)  # records[0], float32 (4, N_EMBD)


def declared(m: dict, shape: list[int]) -> dict:
    """The manifest with records[0] declared as float32 `shape` (ne reversed)."""
    return set_at(set_at(m, ("records", 0, "shape"), shape), ("records", 0, "ne"), shape[::-1])


# --- zip structures (APPNOTE.TXT) --------------------------------------------------------------

EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory record (APPNOTE 4.3.16), no comment
CENTRAL = struct.Struct("<4s6H3I5H2I")  # central directory file header (APPNOTE 4.3.12), 46 bytes
LOCAL = struct.Struct("<4s5H3I2H")  # local file header (APPNOTE 4.3.7), 30 bytes


def central_entries(data: bytes) -> list[int]:
    """Offsets of a zip's central directory entries, walked from its end record."""
    eocd = EOCD.unpack_from(data, len(data) - EOCD.size)
    at, out = eocd[6], []
    for _ in range(eocd[4]):
        out.append(at)
        fields = CENTRAL.unpack_from(data, at)
        at += CENTRAL.size + fields[10] + fields[11] + fields[12]
    return out


# --- the zip bomb ------------------------------------------------------------------------------

BOMB_ELEMENTS = 1 << 30  # float32: a 4 GiB array


def _bomb_stream(header: bytes, zero_mib: int) -> tuple[bytes, int]:
    """A raw deflate stream of `header` then `zero_mib` MiB of zeros, and its CRC-32, made in about
    a second: after a full flush deflate's output for the same input repeats, so one MiB of zeros is
    compressed once and its output repeated."""
    zeros = bytes(1 << 20)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = c.compress(header) + c.flush(zlib.Z_FULL_FLUSH)
    piece = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    assert c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH) == piece
    crc = zlib.crc32(header)
    for _ in range(zero_mib):
        crc = zlib.crc32(zeros, crc)
    return head + piece * zero_mib + c.flush(zlib.Z_FINISH), crc


def _zip_member(name: bytes, method: int, stream: bytes, crc: int, size: int, offset: int) -> tuple[bytes, bytes]:
    """A member's local header and data, and its central directory entry; zip64 sizes when it is
    4 GiB or more (APPNOTE 4.3.7, 4.3.12, 4.5.3)."""
    big = size >= 0xFFFFFFFF
    sizes = (0xFFFFFFFF, 0xFFFFFFFF) if big else (len(stream), size)
    extra = struct.pack("<HHQQ", 0x0001, 16, size, len(stream)) if big else b""
    date = 0x21  # 1980-01-01
    local = LOCAL.pack(b"PK\x03\x04", 45, 0, method, 0, date, crc, *sizes, len(name), len(extra))
    central = CENTRAL.pack(
        b"PK\x01\x02", 45, 45, 0, method, 0, date, crc, *sizes, len(name), len(extra), 0, 0, 0, 0, offset
    )
    return local + name + extra + stream, central + name + extra


def write_bomb(good: Path, out: Path) -> Path:
    """`good` with records[0] declared as BOMB_ELEMENTS float32 zeros (4 GiB) and its member a ~4 MB
    deflate stream that inflates to exactly them: honest sizes and a valid CRC."""
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (BOMB_ELEMENTS,)})
    stream, crc = _bomb_stream(f.getvalue(), BOMB_ELEMENTS * 4 >> 20)
    members = [(FIRST + ".npy", zipfile.ZIP_DEFLATED, stream, crc, len(f.getvalue()) + BOMB_ELEMENTS * 4)]
    rest = zip_bytes(good.read_bytes(), manifest_edit(lambda m: declared(m, [BOMB_ELEMENTS])))
    with zipfile.ZipFile(io.BytesIO(rest)) as zf:
        members += [
            (i.filename, zipfile.ZIP_STORED, zf.read(i), i.CRC, i.file_size)
            for i in zf.infolist()
            if i.filename != FIRST + ".npy"
        ]
    body, directory = io.BytesIO(), io.BytesIO()
    for name, method, data, member_crc, size in members:
        local, central = _zip_member(name.encode(), method, data, member_crc, size, body.tell())
        body.write(local)
        directory.write(central)
    end = EOCD.pack(b"PK\x05\x06", 0, 0, len(members), len(members), directory.tell(), body.tell(), 0)
    out.write_bytes(body.getvalue() + directory.getvalue() + end)
    return out


# --- random mutations ---------------------------------------------------------------------------

JUNK: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    -(2**63),
    2**63,
    2**100,
    "",
    "x",
    "\ud800\x00\n",
    "é" * 50,
    [],
    [0],
    [-1, 2**40],
    ["a"],
    {},
    {"k": [1]},
    [[[]]],
    float("1e308"),
]


def _paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (keys and indices), itself first."""
    out = [path]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        out += _paths(v, (*path, k))
    return out


def _get(value: Any, path: tuple) -> Any:
    for step in path:
        value = value[step]
    return value


def _mutated_value(rng: random.Random, old: Any) -> Any:
    """A replacement for `old`: junk of any type, or a number near, far from or negating it."""
    if isinstance(old, int) and not isinstance(old, bool) and rng.random() < 0.5:
        return rng.choice([-old, old + 1, old - 1, old * 1024, old + 2**31, -(2**62), 2**62])
    if isinstance(old, list) and old and rng.random() < 0.3:
        return old + old if rng.random() < 0.5 else old[:-1]
    return rng.choice(JUNK)


def mutate_flow(rng: random.Random, manifest: dict) -> bytes:
    """Edits a reader mostly cannot refuse, for compare to meet: one to four ints (positions, token
    ids, evals, sizes, rounds) set to other small ints, strings (roles, phases, names) swapped for
    other strings of the manifest, or items of a list dropped or repeated."""
    m = copy.deepcopy(manifest)
    strings = sorted({v for p in _paths(m) if isinstance(v := _get(m, p), str)})
    for _ in range(rng.randint(1, 4)):
        paths = _paths(m)
        op = rng.random()
        if op < 0.5:
            m = set_at(m, rng.choice([p for p in paths if type(_get(m, p)) is int]), rng.randint(-1, 12))
        elif op < 0.7:
            m = set_at(m, rng.choice([p for p in paths if isinstance(_get(m, p), str)]), rng.choice(strings))
        else:
            path = rng.choice([p for p in paths if isinstance(_get(m, p), list) and _get(m, p)])
            items = _get(m, path)
            i = rng.randrange(len(items))
            m = set_at(
                m, path, items[:i] + items[i + 1 :] if rng.random() < 0.6 else items[:i] + items[i : i + 1] + items[i:]
            )
    return json.dumps(m).encode()


def mutate_manifest(rng: random.Random, manifest: dict) -> bytes:
    """One to three structured edits of the manifest: a key or item deleted, a value replaced,
    wrapped in a list or given a junk sibling key; then, sometimes, one character of its text changed."""
    m = copy.deepcopy(manifest)
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(_paths(m)[1:])
        op = rng.random()
        if op < 0.25:
            m = set_at(m, path, DELETE)
        elif op < 0.85:
            m = set_at(m, path, _mutated_value(rng, _get(m, path)))
        elif op < 0.95:
            m = set_at(m, path, [_get(m, path)])
        elif isinstance(_get(m, path[:-1]), dict):
            m = set_at(m, (*path[:-1], "\udcff" + str(path[-1])), rng.choice(JUNK))
    text = json.dumps(m)
    if rng.random() < 0.2:
        at = rng.randrange(len(text))
        text = text[:at] + rng.choice('{}[]",:0-e\\') + text[at + 1 :]
    return text.encode()


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """Bytes flipped, inserted or deleted, or the file cut short; a third of the time inside the
    central directory (the last fifth of this file)."""
    data = bytearray(data)
    lo = len(data) * 4 // 5 if rng.random() < 0.33 else 0
    at = rng.randrange(lo, len(data))
    op = rng.random()
    if op < 0.5:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(lo, len(data))] ^= rng.randrange(1, 256)
    elif op < 0.7:
        data[at:at] = rng.randbytes(rng.randint(1, 16))
    elif op < 0.85:
        del data[at : at + rng.randint(1, 64)]
    else:
        del data[at:]
    return bytes(data)


def fuzz_case(rng: random.Random, original: bytes, manifest: dict) -> tuple[str, bytes]:
    """One random mutation of the dump: its bytes (40%), its manifest's types and structure (35%),
    or its manifest's values, which compare then meets (25%); a tenth of the latter deflated."""
    kind = rng.random()
    if kind < 0.4:
        return "bytes", mutate_bytes(rng, original)
    edited = mutate_manifest(rng, manifest) if kind < 0.75 else mutate_flow(rng, manifest)
    method = zipfile.ZIP_DEFLATED if rng.random() < 0.1 else zipfile.ZIP_STORED
    kind_name = "manifest" if kind < 0.75 else "flow"
    return kind_name, zip_bytes(original, lambda name, data: edited if name == MANIFEST_MEMBER else data, method)
