"""Dump format v1: round trip, and every crafted bad file refused with a message naming it."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
from typer.testing import CliRunner

from featdiff.cli import app
from featdiff.core.errors import InputError
from featdiff.dump.manifest import Manifest
from featdiff.dump.reader import read_dump
from featdiff.dump.records import Eval, record_key
from featdiff.dump.writer import DumpWriter, record_from_array


def _write(path, n_records=2):
    w = DumpWriter(path)
    for i in range(n_records):
        rec, arr = record_from_array(
            record_key(0, "draft", f"t-{i}", 0),
            "draft",
            "inject",
            0,
            f"t-{i}",
            0,
            np.arange(6, dtype=np.float64).reshape(2, 3) + i,
        )
        w.add(rec, arr)
    ev = Eval(eval=0, role="draft", phase="inject", n_tokens=2, positions=(0, 1), token_ids=(), seq_ids=(0, 0))
    return w.close(Manifest(source="reference", models={}, build={}, evals=(ev,), records=()))


def _rewrite_manifest(src, dst, edit):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.namelist():
            data = zin.read(item)
            if item == "manifest.json":
                data = json.dumps(edit(json.loads(data))).encode()
            zout.writestr(item, data)
    return dst


def test_round_trip_keeps_records_arrays_and_numpy_loads_it(tmp_path):
    path = _write(tmp_path / "d.npz")
    with read_dump(path) as d:
        assert [r.name for r in d.manifest.records] == ["t-0", "t-1"]
        assert d.manifest.records[0].ne == (3, 2) and d.manifest.records[0].dtype == "float32"
        assert np.array_equal(d.array(d.manifest.records[1]), np.arange(6).reshape(2, 3) + 1)
    with np.load(path, allow_pickle=False) as z:  # a plain numpy reader sees the same members
        assert z["e00000.draft.t-1.0"].shape == (2, 3)


def test_writer_never_leaves_a_half_written_dump_in_place(tmp_path):
    path = _write(tmp_path / "d.npz")
    before = path.read_bytes()
    w = DumpWriter(path)  # a second write in progress goes to a .partial file
    assert path.read_bytes() == before and not any(
        p.name == "d.npz" and p.stat().st_size == 0 for p in tmp_path.iterdir()
    )
    del w


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda m: {**m, "version": 2}, "dump version 2, this featdiff reads version 1"),
        (lambda m: {**m, "format": "other"}, 'format "other"'),
        (lambda m: {**m, "records": m["records"] + m["records"][:1]}, "appears twice"),
        (lambda m: {**m, "records": [{**m["records"][0], "key": "nope"}]}, "has no member 'nope.npy'"),
        (lambda m: {k: v for k, v in m.items() if k != "records"}, "manifest records: expected a list, got nothing"),
    ],
)
def test_crafted_manifests_are_refused_naming_the_file(tmp_path, edit, expected):
    bad = _rewrite_manifest(_write(tmp_path / "d.npz"), tmp_path / "bad.npz", edit)
    with pytest.raises(InputError, match=expected) as e:
        read_dump(bad)
    assert str(bad) in str(e.value)


def test_truncated_and_foreign_files_exit_2_with_one_line(tmp_path):
    good = _write(tmp_path / "d.npz")
    truncated = tmp_path / "trunc.npz"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    plain = tmp_path / "plain.npz"
    np.savez(plain, a=np.zeros(3))
    for bad in (truncated, plain):
        result = CliRunner().invoke(app, ["inspect", str(bad)])
        assert result.exit_code == 2
        assert str(bad) in result.output and "Traceback" not in result.output


def test_flows_and_graphs_round_trip_and_a_flow_view_holds_one_flow(tmp_path):
    """Issue 22's optional fields: `evals[].ubatch`, `evals[].flow`, `rounds[].flow`, `flows`;
    a dump of one flow writes none of them (older readers see the dump they knew)."""
    from featdiff.dump.manifest import flow_view
    from featdiff.dump.records import FlowInfo, MemoryOp, Round

    evs = (
        Eval(0, "target", "prefill", 2, (0, 1), (5, 6), (0, 0), ubatch=0),
        Eval(1, "target", "prefill", 1, (2,), (7,), (0,), ubatch=1),
        Eval(2, "target", "prefill", 3, (0, 1, 2), (9, 6, 7), (1, 1, 1), flow=1),
    )
    rounds = (Round(1, 3, 8, (1, 2), 1, (1, 4)), Round(1, 3, 10, (3,), 0, (5,), flow=1))
    flows = (FlowInfo(0, 0, (5, 6, 7, 8)), FlowInfo(1, 1, (9, 6, 7, 10), n_cached=0))
    ops = (MemoryOp("target", 1, 0, 3, -1), MemoryOp("target", 2, 1, 3, -1))
    m = Manifest("llama.cpp", {}, {}, evs, (), rounds, (5, 6, 7, 8), ops, (), flows)
    w = DumpWriter(tmp_path / "run.npz")
    path = w.close(m)
    with read_dump(path) as d:
        back = d.manifest
    assert back.evals == evs and back.rounds == rounds and back.flows == flows
    assert back.flow_ids() == (0, 1)
    one = flow_view(back, 1)
    assert [e.eval for e in one.evals] == [2] and one.prompt_tokens == (9, 6, 7, 10)
    assert one.rounds == (rounds[1],) and one.memory_ops == (ops[1],)
    plain = Eval(0, "draft", "inject", 1, (0,), (), (0,)).to_json()
    assert (
        "flow" not in plain and "ubatch" not in plain and "flows" not in Manifest("reference", {}, {}, (), ()).to_json()
    )


def test_a_run_of_several_flows_against_a_reference_of_one_exits_2_naming_both(tmp_path):
    from featdiff.diff.comparison import check_flows

    run = Manifest("llama.cpp", {}, {}, (Eval(0, "target", "prefill", 1, (0,), (5,), (0,)),
                                        Eval(1, "target", "prefill", 1, (0,), (6,), (1,), flow=1)), ())  # fmt: skip
    ref = Manifest("reference", {}, {}, (Eval(0, "target", "prefill", 1, (0,), (5,), (0,)),), ())
    with pytest.raises(InputError, match=r"ref.npz: holds flows \[0\], \S*run.npz flows \[0, 1\].*--follow \S*run.npz"):
        check_flows(tmp_path / "ref.npz", tmp_path / "run.npz", ref, run)


def test_a_records_backend_is_optional_and_kept_when_given(tmp_path):
    path = _write(tmp_path / "d.npz")
    with read_dump(path) as d:  # a dump before issue 31 (and every reference): no backend
        assert all(r.backend is None and "backend" not in r.to_json() for r in d.manifest.records)
    on_device = _rewrite_manifest(
        path, tmp_path / "dev.npz", lambda m: {**m, "records": [{**r, "backend": "Vulkan0"} for r in m["records"]]}
    )
    with read_dump(on_device) as d:
        assert [r.to_json()["backend"] for r in d.manifest.records] == ["Vulkan0", "Vulkan0"]
    bad = _rewrite_manifest(path, tmp_path / "bad.npz", lambda m: {**m, "records": [{**m["records"][0], "backend": 3}]})
    with pytest.raises(InputError, match="backend"):
        read_dump(bad)
