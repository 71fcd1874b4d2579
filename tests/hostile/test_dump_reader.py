"""Hostile dumps (issue 12): every crafted or damaged file is refused with an `InputError` naming it
(through the CLI: exit 2 and one line), a zip bomb is refused from the zip's directory alone, in
bounded time and memory, and thousands of random mutations of a capture-shaped dump raise nothing
but `InputError` and never read more than the arrays they declare."""

from __future__ import annotations

import json
import pickle
import random
import struct
import subprocess
import sys
import tracemalloc
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hostile_dumps import (
    BOMB_ELEMENTS,
    DELETE,
    FIRST,
    LOCAL,
    N_EMBD,
    central_entries,
    declared,
    fuzz_case,
    manifest_edit,
    member_edit,
    npy,
    rezip,
    set_at,
    write_bomb,
    write_capture_like,
)
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core.errors import InputError
from featdiff.diff import compare_dumps
from featdiff.dump.reader import INFLATION_FLOOR, MAX_MANIFEST_BYTES, read_dump
from featdiff.dump.records import MANIFEST_MEMBER


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return write_capture_like(tmp_path_factory.mktemp("good") / "good.npz")


def _read_everything(path: Path) -> None:
    """What compare needs of a dump: the manifest, the typed `build`, every record's array."""
    with read_dump(path) as d:
        assert d.manifest.build_info is not None
        for r in d.records():
            a = d.array(r)
            assert a.shape == r.shape and str(a.dtype) == r.dtype


# --- crafted manifests: each malformed field named by its path ----------------------------------


FIELD_CASES = [
    (("records", 0, "shape", 1), "x", 'records[0].shape[1]: expected a non-negative int, got "x"'),
    (("records", 0, "shape", 0), -4, "records[0].shape[0]: expected a non-negative int, got -4"),
    (("records", 0, "shape"), [N_EMBD, 4], f"records[0].shape: expected ne reversed, [4, {N_EMBD}], got [{N_EMBD}, 4]"),
    (("records", 0, "ne"), [N_EMBD, 4, 1], f"records[0].shape: expected ne reversed, [1, 4, {N_EMBD}]"),
    (("records", 0, "eval"), True, "records[0].eval: expected a non-negative int, got true"),
    (("records", 0, "eval"), 0.0, "records[0].eval: expected a non-negative int, got 0.0"),
    (("records", 0, "occurrence"), -1, "records[0].occurrence: expected a non-negative int, got -1"),
    (("records", 0, "occurrence"), 2**70, "records[0].occurrence: expected a non-negative int, got 1180591620717"),
    (("records", 0, "dtype"), "float16", 'records[0].dtype: expected one of float32, int32, int64, got "float16"'),
    (("records", 0, "dtype"), "object", 'records[0].dtype: expected one of float32, int32, int64, got "object"'),
    (("records", 0, "role"), "drafter", 'records[0].role: expected one of target, draft, got "drafter"'),
    (
        ("records", 0, "phase"),
        None,
        "records[0].phase: expected one of prefill, inject, draft, verify, warmup, got null",
    ),
    (("records", 0, "key"), DELETE, "records[0].key: expected a string, got nothing (the field is missing)"),
    (("records", 0, "key"), 7, "records[0].key: expected a string, got 7"),
    (("records", 0, "srcs"), "a,b", 'records[0].srcs: expected a list, got "a,b"'),
    (("records", 0, "srcs", 0), ["a"], 'records[0].srcs[0]: expected a string, got ["a"]'),
    (("records", 0, "nb", 1), -16, "records[0].nb[1]: expected a non-negative int, got -16"),
    (("records", 0, "op"), {"op": "ADD"}, 'records[0].op: expected a string, got {"op": "ADD"}'),
    (("records", 1), [], "records[1]: expected an object, got []"),
    (("records",), {}, "records: expected a list, got {}"),
    (("records",), DELETE, "records: expected a list, got nothing"),
    (("evals", 1, "n_tokens"), -3, "evals[1].n_tokens: expected a non-negative int, got -3"),
    (("evals", 1, "positions"), {"0": 0}, 'evals[1].positions: expected a list, got {"0": 0}'),
    (("evals", 0, "token_ids", 2), 2**64, "evals[0].token_ids[2]: expected an int, got 18446744073709551616"),
    (("evals", 0, "seq_ids", 0), "0", 'evals[0].seq_ids[0]: expected an int, got "0"'),
    (
        ("evals", 2, "phase"),
        "decode",
        'evals[2].phase: expected one of prefill, inject, draft, verify, warmup, got "decode"',
    ),
    (("evals", 2, "round"), None, "evals[2].round: expected a non-negative int, got null"),
    (("evals", 2, "rc"), 1.5, "evals[2].rc: expected an int, got 1.5"),
    (("evals",), "0,1", 'evals: expected a list, got "0,1"'),
    (("evals", 1, "positions"), [0, 1, 2], "evals[1].positions: expected 4 items (n_tokens), got [0, 1, 2]"),
    (("evals", 0, "token_ids"), [5], "evals[0].token_ids: expected 4 items (n_tokens) or none, got [5]"),
    (("evals", 3, "seq_ids"), [0, 0, 0, 0], "evals[3].seq_ids: expected 3 items (n_tokens) or none, got [0, 0, 0, 0]"),
    (("rounds", 0, "drafts"), "11,12", 'rounds[0].drafts: expected a list, got "11,12"'),
    (("rounds", 0, "round"), -1, "rounds[0].round: expected a non-negative int, got -1"),
    (("rounds", 0, "target_tokens", 0), False, "rounds[0].target_tokens[0]: expected an int, got false"),
    (("memory_ops", 0, "op"), "wipe", 'memory_ops[0].op: expected one of seq_rm, clear, got "wipe"'),
    (("memory_ops", 0, "after_eval"), -2, "memory_ops[0].after_eval: expected an int >= -1, got -2"),
    (("prompt_tokens", 1), "9", 'prompt_tokens[1]: expected an int, got "9"'),
    (("flow_notes",), "a note", 'flow_notes: expected a list, got "a note"'),
    (("flow_notes", 0), None, "flow_notes[0]: expected a string, got null"),
    (("models",), [], "models: expected an object, got []"),
    (("models", "draft"), "draft.gguf", 'models.draft: expected an object, got "draft.gguf"'),
    (("models", "draft", "target_layers", 1), "2", 'models.draft.target_layers[1]: expected an int, got "2"'),
    (("models", "target", "n_embd"), "6", 'models.target.n_embd: expected an int, got "6"'),
    (("models", "draft", "mask_token_id"), 99.5, "models.draft.mask_token_id: expected an int, got 99.5"),
    (("models", "target", "rope_freq_base"), "1e4", 'models.target.rope_freq_base: expected a number, got "1e4"'),
    (("models", "target", "weight_types"), "f32", 'models.target.weight_types: expected a list, got "f32"'),
    (("models", "draft", "has_own_embeddings"), 0, "models.draft.has_own_embeddings: expected true or false, got 0"),
    (("models", "draft", "dspark"), [], "models.draft.dspark: expected an object, got []"),
    (("models", "target", "dequantized_by"), 5, "models.target.dequantized_by: expected a string, got 5"),
    (("build",), [], "build: expected an object, got []"),
    (("build", "filters"), 7, "build.filters: expected null, a list of globs or per role a list of them, got 7"),
    (("build", "filters", "draft"), "*", 'build.filters.draft: expected a list, got "*"'),
    (("build", "kv_types", "target", "k"), 8, "build.kv_types.target.k: expected a string, got 8"),
    (("build", "kv_types"), ["f16"], 'build.kv_types: expected an object, got ["f16"]'),
    (("build", "draft_max"), -1, "build.draft_max: expected a non-negative int, got -1"),
    (("build", "p_min"), "0.5", 'build.p_min: expected a number, got "0.5"'),
    (("build", "commit"), 5, "build.commit: expected a string, got 5"),
    (("source",), "mine", 'source: expected one of llama.cpp, reference, got "mine"'),
    (("version",), True, "dump version true, this featdiff reads version 1"),
    (("format",), "featdiff-dump-v0", 'format "featdiff-dump-v0", expected "featdiff-dump"'),
]


@pytest.mark.parametrize("path, value, expected", FIELD_CASES, ids=[".".join(map(str, c[0])) for c in FIELD_CASES])
def test_a_malformed_manifest_field_is_refused_naming_its_path(good, tmp_path, path, value, expected):
    bad = rezip(good, tmp_path / "bad.npz", manifest_edit(lambda m: set_at(m, path, value)))
    with pytest.raises(InputError) as e:
        read_dump(bad)
    assert str(e.value).startswith(f"{bad}: ") and expected in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_an_odd_value_is_quoted_on_one_line_in_ascii_and_cut_short(good, tmp_path):
    junk = "é\n\ud800" + "x" * 500
    bad = rezip(good, tmp_path / "bad.npz", manifest_edit(lambda m: set_at(m, ("records", 0, "name"), [junk])))
    with pytest.raises(InputError, match=r'records\[0\]\.name: expected a string, got \["\\u00e9\\n\\ud800x+\.\.\.;'):
        read_dump(bad)


# --- crafted zips and members ------------------------------------------------------------------

FIRST_ARRAY = np.zeros((4, N_EMBD), dtype=np.float32)  # records[0]'s declared dtype and shape
MEMBER_SIZE = len(npy(FIRST_ARRAY))  # its member: a 128-byte header and the data


def _with_central(path: Path, out: Path, fmt: str, field_at: int, change: Callable[[int], int]) -> Path:
    """`path` with one field (struct `fmt` at `field_at`) of every central directory entry changed."""
    data = bytearray(path.read_bytes())
    for at in central_entries(bytes(data)):
        value = struct.unpack_from(fmt, data, at + field_at)[0]
        struct.pack_into(fmt, data, at + field_at, change(value))
    out.write_bytes(bytes(data))
    return out


def _member_data_offset(path: Path, key: str) -> int:
    """Where record `key`'s member data starts in the file."""
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        info = zf.getinfo(key + ".npy")
        f.seek(info.header_offset)
        fields = LOCAL.unpack(f.read(LOCAL.size))
        return info.header_offset + LOCAL.size + fields[9] + fields[10]


def _write(tmp: Path, data: bytes) -> Path:
    out = tmp / "bad.npz"
    out.write_bytes(data)
    return out


def _flipped(path: Path, tmp: Path, at: int) -> Path:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x5A
    return _write(tmp, bytes(data))


def _member(good: Path, tmp: Path, data: bytes | None, method: int = zipfile.ZIP_STORED) -> Path:
    return rezip(good, tmp / "bad.npz", member_edit(FIRST, data), method)


def _manifest(good: Path, tmp: Path, change: Callable[[dict], Any]) -> Path:
    return rezip(good, tmp / "bad.npz", manifest_edit(change))


def _zeros_dump(good: Path, tmp: Path, n: int, method: int) -> Path:
    """`good` with records[0] declared as `n` float32 zeros and its member holding them."""
    zeros = npy(np.zeros(n, dtype=np.float32))
    edit_manifest = manifest_edit(lambda m: declared(m, [n]))
    return rezip(
        good, tmp / "zeros.npz", lambda name, d: zeros if name == FIRST + ".npy" else edit_manifest(name, d), method
    )


def _member_bomb(good: Path, tmp: Path) -> Path:
    """records[0] as 1 Mi float32 zeros (4 MiB) deflated ~1000x: refused, however honest its sizes."""
    return _zeros_dump(good, tmp, 1 << 20, zipfile.ZIP_DEFLATED)


def _manifest_over_the_cap(good: Path, tmp: Path) -> Path:
    """A stored manifest.json one byte over MAX_MANIFEST_BYTES: spaces, then the manifest."""

    def pad(name: str, data: bytes) -> bytes:
        return data.rjust(MAX_MANIFEST_BYTES + 1) if name == MANIFEST_MEMBER else data

    return rezip(good, tmp / "bad.npz", pad)


def _manifest_bomb(good: Path, tmp: Path) -> Path:
    """manifest.json: 64 MiB of spaces, then the manifest, deflated to ~65 KB."""

    def pad(name: str, data: bytes) -> bytes:
        return data.rjust(64 << 20) if name == MANIFEST_MEMBER else data

    return rezip(good, tmp / "bad.npz", pad, zipfile.ZIP_DEFLATED)


def _non_utf8_name(good: Path, tmp: Path) -> Path:
    """A member whose name is flagged UTF-8 (bit 11) but is not: ÿÿ (C3 BF C3 BF) made FF FE FF FE."""
    named = rezip(good, tmp / "named.npz")
    with zipfile.ZipFile(named, "a") as zf:
        zf.writestr("\u00ff\u00ff.txt", b"x")
    data = named.read_bytes()
    return _write(tmp, data.replace("\u00ff\u00ff".encode(), b"\xff\xfe\xff\xfe"))


def _duplicate_member(good: Path, tmp: Path) -> Path:
    """A second member under records[0]'s name: which one a reader took would be up to it."""
    out = rezip(good, tmp / "bad.npz")
    with warnings.catch_warnings(), zipfile.ZipFile(out, "a") as zf:
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name it is asked to write
        zf.writestr(FIRST + ".npy", npy(FIRST_ARRAY))
    return out


def _damaged_deflate(good: Path, tmp: Path) -> Path:
    deflated = rezip(good, tmp / "deflated.npz", method=zipfile.ZIP_DEFLATED)
    return _flipped(deflated, tmp, _member_data_offset(deflated, FIRST) + 3)


def _object_member_of_the_declared_size() -> bytes:
    """An object-dtype .npy (a pickle after its header) cut or padded to records[0]'s member size."""
    return npy(np.full((4, N_EMBD), None, dtype=object), allow_pickle=True)[:MEMBER_SIZE].ljust(MEMBER_SIZE, b"\0")


def _duplicate_json_key(m: dict) -> bytes:
    return ('{"source": "reference", ' + json.dumps(m)[1:]).encode()


def _deep_json(m: dict) -> bytes:
    return b'{"format": "featdiff-dump", "version": 1, "records": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def _nan_p_min(m: dict) -> bytes:
    return json.dumps(set_at(m, ("build", "p_min"), float("nan"))).encode()


# (id, make(good, tmp) -> the bad file, a fragment of the message)
FILE_CASES: list[tuple[str, Callable[[Path, Path], Path], str]] = [
    (
        "stored shape != manifest shape",
        lambda g, t: _member(g, t, npy(FIRST_ARRAY.T.copy())),
        f"the .npy header says <f4 ({N_EMBD}, 4) in C order, the record float32 (4, {N_EMBD}) in C order",
    ),
    (
        "stored dtype != manifest dtype",
        lambda g, t: _member(g, t, npy(FIRST_ARRAY.astype(np.int32))),
        f"header says <i4 (4, {N_EMBD})",
    ),
    ("big-endian member", lambda g, t: _member(g, t, npy(FIRST_ARRAY.astype(">f4"))), f"says >f4 (4, {N_EMBD})"),
    (
        "fortran order",
        lambda g, t: _member(g, t, npy(np.asfortranarray(FIRST_ARRAY))),
        f"header says <f4 (4, {N_EMBD}) in Fortran order",
    ),
    (
        "object array member",
        lambda g, t: _member(g, t, npy(np.array([None] * 64, dtype=object), allow_pickle=True)),
        f"record {FIRST!r}: the .npy header says |O (64,) in C order",
    ),
    (
        "object array of the declared size",
        lambda g, t: _member(g, t, _object_member_of_the_declared_size()),
        f"header says |O (4, {N_EMBD})",
    ),
    (
        "pickled member",
        lambda g, t: _member(g, t, pickle.dumps(FIRST_ARRAY)),
        f"record {FIRST!r}: the magic string is not correct",
    ),
    (
        "not a .npy",
        lambda g, t: _member(g, t, b"NOTNUMPY".ljust(MEMBER_SIZE, b"\0")),
        "the magic string is not correct",
    ),
    (
        ".npy version 3.0",
        lambda g, t: _member(g, t, b"\x93NUMPY\x03\x00" + npy(FIRST_ARRAY)[8:]),
        ".npy version 3.0, expected 1.0 or 2.0",
    ),
    (
        "header length past numpy's cap",
        lambda g, t: _member(g, t, (npy(FIRST_ARRAY)[:8] + b"\xff\xff").ljust(MEMBER_SIZE)),
        "EOF: reading array header, expected 65535 bytes",
    ),
    ("member missing", lambda g, t: _member(g, t, None), f"record {FIRST!r} has no member '{FIRST}.npy'"),
    (
        "member short of its data",
        lambda g, t: _member(g, t, npy(FIRST_ARRAY)[:-8]),
        f"the member holds {MEMBER_SIZE - 8} bytes, a 128-byte header and {4 * 4 * N_EMBD} data bytes expected",
    ),
    (
        "member longer than its data",
        lambda g, t: _member(g, t, npy(FIRST_ARRAY) + b"\0" * 8),
        f"the member holds {MEMBER_SIZE + 8} bytes",
    ),
    (
        "huge declared shape, small member",
        lambda g, t: _manifest(g, t, lambda m: declared(m, [1 << 40, N_EMBD])),
        f"declares float32 ({1 << 40}, {N_EMBD}) ({(1 << 40) * N_EMBD * 4} bytes) but its member holds {MEMBER_SIZE}",
    ),
    (
        "record key twice",
        lambda g, t: _manifest(g, t, lambda m: set_at(m, ("records",), m["records"] + m["records"][:1])),
        f"record key {FIRST!r} appears twice",
    ),
    ("member name twice", _duplicate_member, f"member '{FIRST}.npy' appears twice in the zip"),
    ("JSON key twice", lambda g, t: _manifest(g, t, _duplicate_json_key), "key 'source' appears twice in one object"),
    ("JSON NaN", lambda g, t: _manifest(g, t, _nan_p_min), "NaN is not a JSON number"),
    (
        "JSON nested 100,000 deep",
        lambda g, t: _manifest(g, t, _deep_json),
        "manifest.json is unreadable (maximum recursion",
    ),
    (
        "manifest not UTF-8",
        lambda g, t: _manifest(g, t, lambda m: b'{"a": "\xff"}'),
        "manifest.json is unreadable ('utf-8' codec can't decode",
    ),
    ("manifest not an object", lambda g, t: _manifest(g, t, lambda m: [m]), 'format [{"build": {"command"'),
    (
        "manifest missing",
        lambda g, t: rezip(g, t / "bad.npz", lambda n, d: None if n == MANIFEST_MEMBER else d),
        "no manifest.json member, so not a featdiff dump",
    ),
    ("manifest over the cap", _manifest_over_the_cap, f"more than the {MAX_MANIFEST_BYTES} a manifest may take"),
    ("manifest bomb", _manifest_bomb, "member 'manifest.json' inflates"),
    ("member bomb", _member_bomb, f"member '{FIRST}.npy' inflates"),
    ("non-UTF-8 member name", _non_utf8_name, "not a readable .npz ('utf-8' codec can't decode byte 0xff"),
    ("encrypted members", lambda g, t: _with_central(g, t / "bad.npz", "<H", 8, lambda f: f | 0x1), "is encrypted"),
    ("bzip2 members", lambda g, t: _member(g, t, npy(FIRST_ARRAY), zipfile.ZIP_BZIP2), "uses zip method 12"),
    (
        "sizes past the end",
        lambda g, t: _with_central(g, t / "bad.npz", "<Q", 20, lambda s: 0xFFFFFFFE_FFFFFFFE),
        "reaches past the end of the",
    ),
    (
        "stored size != size",
        lambda g, t: _with_central(g, t / "bad.npz", "<I", 24, lambda s: s + 1),
        "but says it holds",
    ),
    ("truncated file", lambda g, t: _write(t, g.read_bytes()[: g.stat().st_size // 2]), "not a readable .npz"),
    ("truncated central directory", lambda g, t: _write(t, g.read_bytes()[:-30]), "not a readable .npz"),
    ("empty file", lambda g, t: _write(t, b""), "not a readable .npz"),
    ("damaged deflate stream", _damaged_deflate, f"record {FIRST!r}: "),
    (
        "CRC-damaged member",
        lambda g, t: _flipped(g, t, _member_data_offset(g, FIRST) + MEMBER_SIZE - 1),
        f"record {FIRST!r}: Bad CRC-32",
    ),
]
# compare memory-maps a stored member and does not read it whole, so it cannot see a bad CRC there
NOT_SEEN_BY_COMPARE = ("CRC-damaged member",)


@pytest.mark.parametrize("make, expected", [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_a_crafted_file_is_refused_naming_it(good, tmp_path, make, expected):
    bad = make(good, tmp_path)
    with pytest.raises(InputError) as e:
        _read_everything(bad)
    assert str(e.value).startswith(f"{bad}: ") and expected in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


CLI_CASES = [c for c in FILE_CASES if c[0] not in NOT_SEEN_BY_COMPARE] + [
    ("bad field", lambda g, t: _manifest(g, t, lambda m: set_at(m, ("records", 0, "shape", 1), "x")), "")
]


@pytest.mark.parametrize("make", [c[1] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_compare_and_report_exit_2_with_one_line_naming_the_file(good, tmp_path, make):
    bad = make(good, tmp_path)
    for args in (
        ["compare", str(bad), str(good)],
        ["compare", str(good), str(bad), "--json", "-"],
        ["report", str(good), str(bad), "-o", str(tmp_path / "r.html")],
    ):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert result.output.startswith(f"featdiff: error: {bad}: ") and result.output.count("\n") == 1, result.output


@pytest.mark.parametrize("make", [_member_bomb, _non_utf8_name, FILE_CASES[13][1], FILE_CASES[18][1]])
def test_inspect_exits_2_on_what_the_directory_or_manifest_shows(good, tmp_path, make):
    bad = make(good, tmp_path)
    result = CliRunner().invoke(app, ["inspect", str(bad)])
    assert result.exit_code == 2 and result.output.startswith(f"featdiff: error: {bad}: ")


def test_member_names_no_record_uses_are_never_read(good, tmp_path):
    odd = rezip(good, tmp_path / "odd.npz")
    with zipfile.ZipFile(odd, "a") as zf:
        for name in ("\x01\x7f", "../../etc/passwd", "a/" * 100 + "b", "\u00e9\u6f22\U0001f600.npy", "x" * 1000):
            zf.writestr(name, b"junk")
    _read_everything(odd)


def test_dumps_deflated_by_another_writer_still_read(good, tmp_path):
    _read_everything(rezip(good, tmp_path / "deflated.npz", method=zipfile.ZIP_DEFLATED))
    _read_everything(_zeros_dump(good, tmp_path, INFLATION_FLOOR // 8, zipfile.ZIP_DEFLATED))  # ~1000x, 1 MiB


def test_the_older_forms_of_optional_fields_still_read(good, tmp_path):
    """docs/dump.md "Optional fields": each one absent, and `build` in its older forms."""

    def old(m: dict) -> dict:
        for key in ("rounds", "prompt_tokens", "memory_ops", "flow_notes", "models"):
            del m[key]
        for r in m["records"]:
            del r["nb"]
        for e in m["evals"]:
            del e["rc"], e["round"], e["token_ids"], e["seq_ids"]
        m["build"] = {"filters": ["l_out-*", "inp_*"], "kv_dtype": "Q8_0", "p_min": None, "draft_max": None}
        return m

    with read_dump(rezip(good, tmp_path / "old.npz", manifest_edit(old))) as d:
        b = d.manifest.build_info
        assert b.kv_cache_types == ("q8_0",) and b.p_min == 0.0 and b.draft_max is None
        assert b.filters.keeps("draft", "l_out-3") and not b.filters.keeps("target", "result_output")
        assert d.manifest.evals[2].round == 0 and d.manifest.records[0].nb == ()


def test_an_array_read_is_exactly_the_declared_bytes_and_writable(good):
    with read_dump(good) as d:
        for r in d.records():
            a = d.array(r)
            assert a.nbytes == r.nbytes and a.flags.writeable and a.flags.c_contiguous


# --- the zip bomb: refused from the directory, in bounded time and memory -----------------------

BOMB_SECONDS = 1.0  # the bound on the refusal
BOMB_RSS_BOUND = 200 << 20  # bytes of peak RSS; Python, numpy and compare's imports take ~40 MB (`baseline`)
# `featdiff compare BOMB GOOD` in a fresh interpreter, timed from the call; peak RSS is Linux's VmHWM,
# the high-water mark of this process's own memory (ru_maxrss would count the forking parent's too)
REFUSAL = """
import json, re, sys, time
from pathlib import Path
from featdiff.cli import main
import featdiff.diff  # what `featdiff compare` imports first: part of the baseline

def peak_rss():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

baseline = peak_rss()
sys.argv = ["featdiff", "compare", sys.argv[1], sys.argv[2]]
start = time.perf_counter()
try:
    main()
except SystemExit as e:
    code = e.code
seconds = time.perf_counter() - start
print(json.dumps({"code": code, "seconds": seconds, "baseline": baseline, "peak": peak_rss()}))
"""


@pytest.fixture(scope="session")
def bomb(tmp_path_factory) -> tuple[Path, Path]:
    """(bomb.npz, good.npz): a ~4 MB dump whose records[0] inflates to 4 GiB, and a good dump."""
    d = tmp_path_factory.mktemp("bomb")
    good = write_capture_like(d / "good.npz")
    return write_bomb(good, d / "bomb.npz"), good


def test_the_bomb_is_a_valid_zip_that_inflates_to_4_gib(bomb):
    path, _ = bomb
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(FIRST + ".npy")
        assert info.file_size > 4 << 30 and info.compress_type == zipfile.ZIP_DEFLATED
        assert path.stat().st_size < 5 << 20
        with zf.open(info) as f:  # the stream is what it claims: a .npy header, then zeros
            assert np.lib.format.read_magic(f) == (1, 0)
            assert np.lib.format.read_array_header_1_0(f) == ((BOMB_ELEMENTS,), False, np.dtype("<f4"))
            assert f.read(1 << 20) == bytes(1 << 20)


def test_compare_refuses_the_bomb_at_once_in_bounded_memory(bomb):
    path, good = bomb
    done = subprocess.run(
        [sys.executable, "-c", REFUSAL, str(path), str(good)], capture_output=True, text=True, timeout=120
    )
    measured = json.loads(done.stdout)
    assert measured["code"] == 2 and f"{path}: member '{FIRST}.npy' inflates" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1
    assert measured["seconds"] < BOMB_SECONDS, measured
    assert measured["peak"] < BOMB_RSS_BOUND, measured


# --- the fuzz test: random mutations raise nothing but InputError -------------------------------

FUZZ_CASES = 2000
FUZZ_SEED = 20240612
COMPARE_EVERY = 10
PEAK_BOUND = 1 << 20  # bytes a read may allocate: this dump's reads peak near 100 KB (arrays, manifest, zip directory)


def _read_traced(path: Path) -> tuple[str, int]:
    """Read the mutated dump whole ("read") or see it refused ("refused"), and the peak bytes
    allocated meanwhile (tracemalloc sees numpy's buffers). Anything but InputError escapes."""
    tracemalloc.start()
    try:
        _read_everything(path)
        outcome = "read"
    except InputError as e:
        assert str(e).startswith(f"{path}: ") and "\n" not in str(e), str(e)
        outcome = "refused"
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return outcome, peak


def _compare(path: Path, good: Path, as_ref: bool) -> None:
    """compare the mutated dump with the original, as ref or as run; only InputError may stop it."""
    try:
        compare_dumps(path, good) if as_ref else compare_dumps(good, path)
    except InputError as e:
        assert "\n" not in str(e), str(e)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # compare's metrics on the NaN and inf that flipped bytes make
def test_random_mutations_raise_nothing_but_input_error(good, tmp_path):
    """FUZZ_CASES seeded mutations, every COMPARE_EVERY-th compared too; each read allocates under
    PEAK_BOUND, so no read follows a size the dump merely claims."""
    rng = random.Random(FUZZ_SEED)
    original = good.read_bytes()
    with zipfile.ZipFile(good) as zf:
        manifest = json.loads(zf.read(MANIFEST_MEMBER))
    path = tmp_path / "mutated.npz"
    outcomes = {"read": 0, "refused": 0}
    for i in range(FUZZ_CASES):
        kind, data = fuzz_case(rng, original, manifest)
        path.write_bytes(data)
        try:
            outcome, peak = _read_traced(path)
            if i % COMPARE_EVERY == 0:
                _compare(path, good, as_ref=i % (2 * COMPARE_EVERY) == 0)
        except (AssertionError, InputError):
            raise
        except Exception as e:  # noqa: BLE001 - name the case that escaped, then fail on it
            raise AssertionError(f"case {i} ({kind}, seed {FUZZ_SEED}): {type(e).__name__}: {e}") from e
        assert peak < PEAK_BOUND, (i, kind, peak)
        outcomes[outcome] += 1
    assert outcomes["read"] > FUZZ_CASES // 20 and outcomes["refused"] > FUZZ_CASES // 2, outcomes
