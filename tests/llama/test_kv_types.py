"""The KV cache type a run used decides the tolerance it is judged by: `capture --exec` records
the program's `-ctk` / `-ctv` (and the drafter's `-ctkd` / `-ctvd`) in `build.kv_types`, the
in-process capture llama.cpp's f16, and compare judges a q8_0 cache by the q8_0 bound."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from featdiff.diff import compare_dumps, exit_code
from featdiff.diff.tolerance import TypeInfo, tolerance_for
from featdiff.dump.manifest import CacheTypes
from featdiff.dump.reader import read_dump
from featdiff.dump.records import MANIFEST_MEMBER
from featdiff.factory.fixtures import write_fixture
from featdiff.factory.pairs import Shape, Sizes
from featdiff.llama.options import options_of_command
from featdiff.programs import exec as exec_capture

from real_flow import reference_of
from test_exec import RUN_TIMEOUT_S, _command

# q8_0 stores K/V in blocks of 32: the heads must be a multiple of it (the tiny fixture's are 16)
HEAD_32 = Shape(n_layer=6, n_embd=128, n_head=4, n_head_kv=2, n_embd_head=32, n_ff=256)
SIZES = Sizes(target=HEAD_32, draft=Shape(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_embd_head=32, n_ff=256))
Q8_0_CACHES = [
    "-ctk",
    "q8_0",
    "-ctv",
    "q8_0",
    "-ctkd",
    "q8_0",
    "-ctvd",
    "q8_0",
    "-fa",
    "on",
]  # a quantized V needs flash attention


@pytest.fixture(scope="module")
def head32(tmp_path_factory) -> Path:
    return write_fixture(tmp_path_factory.mktemp("fx-head32"), "clean", sizes=SIZES)


@pytest.fixture(scope="module")
def runs(head32, tools, tmp_path_factory):
    """kv label -> (reference, run) of llama-speculative-simple with those caches."""
    made = {}
    for label, extra in (("f16", []), ("q8_0", Q8_0_CACHES)):
        work = tmp_path_factory.mktemp(f"kv-{label}")
        run = exec_capture.capture_exec(
            _command(tools, "llama-speculative-simple", head32) + extra, work / "run.npz", timeout_s=RUN_TIMEOUT_S
        )
        with read_dump(run) as d:
            tokens = ",".join(map(str, d.manifest.prompt_tokens))
            rounds = sum(1 for r in d.manifest.rounds if r.drafts)
        ref = reference_of(head32 / "target-hf", head32 / "draft-hf", work / "ref.npz", tokens=tokens, rounds=rounds)
        made[label] = (ref, run)
    return made


def test_cache_types_come_from_the_flags_then_the_environment_then_f16():
    kv = options_of_command(
        ["llama-server", "-ctk", "q8_0", "-ctk", "Q4_0", "-ctvd", "q5_1"],
        {"LLAMA_ARG_CACHE_TYPE_V": "bf16", "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V": "q8_0"},
    ).kv
    assert kv == {"target": CacheTypes(k="q4_0", v="bf16"), "draft": CacheTypes(k="f16", v="q5_1")}


def _with_kv_types(src: Path, dst: Path, kv_types: dict) -> Path:
    """`src` with its manifest's build.kv_types replaced."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == MANIFEST_MEMBER:
                m = json.loads(data)
                m["build"]["kv_types"] = kv_types
                data = json.dumps(m).encode()
            zout.writestr(item, data)
    return dst


def test_exec_records_the_programs_cache_types(runs):
    with read_dump(runs["q8_0"][1]) as d:
        assert d.manifest.build["kv_types"] == {
            "draft": {"k": "q8_0", "v": "q8_0"},
            "target": {"k": "q8_0", "v": "q8_0"},
        }
    with read_dump(runs["f16"][1]) as d:
        assert d.manifest.build["kv_types"] == {"draft": {"k": "f16", "v": "f16"}, "target": {"k": "f16", "v": "f16"}}
        version = d.manifest.build["commit"]  # what the program's --version says
    assert version != "unknown" and compare_dumps(*runs["f16"]).versions["llama_cpp"] == version


def _post_attention_tolerance(c) -> float:
    """The tolerance (on NMSE) the target's last layer output was judged by."""
    return next(p.tolerance for p in c.pairs if p.role == "target" and p.name == "l_out-5")


def test_q8_0_cache_is_judged_by_the_q8_0_bound(runs):
    c = compare_dumps(*runs["q8_0"])
    assert exit_code(c) == 0 and c.ok, [(f.kind, f.tensor, f.message) for f in c.findings if f.severity == "error"]
    assert c.types["kv_type"] == "q8_0"
    assert _post_attention_tolerance(c) == tolerance_for("l_out-5", False, TypeInfo("q8_0", (), "float32")).nmse


def test_the_same_q8_0_run_judged_by_the_f16_bound_diverges(runs, tmp_path):
    f16 = {"draft": {"k": "f16", "v": "f16"}, "target": {"k": "f16", "v": "f16"}}
    c = compare_dumps(runs["q8_0"][0], _with_kv_types(runs["q8_0"][1], tmp_path / "as-f16.npz", f16))
    assert c.types["kv_type"] == "f16" and exit_code(c) == 1


def test_f16_cache_is_judged_by_the_f16_bound(runs):
    c = compare_dumps(*runs["f16"])
    assert exit_code(c) == 0 and c.types["kv_type"] == "f16"
    assert _post_attention_tolerance(c) == tolerance_for("l_out-5", False, TypeInfo("f16", (), "float32")).nmse


def test_in_process_q8_0_cache_is_recorded_and_judged_by_its_bound(head32, tmp_path):
    """In-process capture takes llama.cpp's -ctk/-ctv/-ctkd/-ctvd/-fa as the programs spell them,
    records them, and compare judges the run by the q8_0 bound: clean."""
    from featdiff.driver.capture import capture
    from featdiff.llama.options import parse_run_options

    options = parse_run_options(Q8_0_CACHES + ["-t", "1"])
    run = capture(head32 / "target.gguf", head32 / "draft.gguf", tmp_path / "run.npz", tokens="1,2,3,4,5,6,7,8",
                  rounds=3, filters=["*"], options=options)  # fmt: skip
    with read_dump(run) as d:
        q8 = {"k": "q8_0", "v": "q8_0"}
        assert d.manifest.build["kv_types"] == {"draft": q8, "target": q8}
        assert d.manifest.build["run_options"]["flash_attn"] == "on" and d.manifest.build["run_options"]["threads"] == 1
    ref = reference_of(head32 / "target-hf", head32 / "draft-hf", tmp_path / "ref.npz", follow=run)
    c = compare_dumps(ref, run)
    assert c.ok and c.types["kv_type"] == "q8_0", [f.message for f in c.findings if f.severity == "error"]
    assert _post_attention_tolerance(c) == tolerance_for("l_out-5", False, TypeInfo("q8_0", (), "float32")).nmse


def test_a_q8_0_run_against_a_reference_guided_by_it_names_near_ties_as_information(head32, tools, tmp_path):
    """`featdiff check`'s reference (`--run`): it decides each round itself and, where its choice
    parts from the run's (an untrained drafter's near-ties under a q8_0 cache: this prompt and
    length part on this build), takes the run's tokens; compare judges the parting from the
    reference's own margin: information, exit 0, and every round still compared."""
    cmd = _command(tools, "llama-speculative-simple", head32)
    cmd[cmd.index("-n") + 1] = "24"
    run = exec_capture.capture_exec(cmd + Q8_0_CACHES, tmp_path / "run.npz", timeout_s=RUN_TIMEOUT_S)
    with read_dump(run) as d:
        tokens = ",".join(map(str, d.manifest.prompt_tokens))
        rounds = sum(1 for r in d.manifest.rounds if r.drafts)
        run_drafts = [r.drafts for r in d.manifest.rounds if r.drafts]
    own = reference_of(head32 / "target-hf", head32 / "draft-hf", tmp_path / "own.npz", tokens=tokens, rounds=rounds)
    with read_dump(own) as d:
        own_drafts = [r.drafts for r in d.manifest.rounds]
    # the reference left to itself drafts otherwise (not only where the run's length budget cut a block)
    assert any(a != b for a, b in zip(own_drafts, run_drafts) if len(a) == len(b))
    ref = reference_of(head32 / "target-hf", head32 / "draft-hf", tmp_path / "ref.npz", tokens=tokens, rounds=rounds,
                       run=run)  # fmt: skip
    c = compare_dumps(ref, run)
    assert exit_code(c) == 0, [(f.kind, f.tensor, f.message) for f in c.findings if f.severity == "error"]
    ties = [f for f in c.findings if f.kind == "near_tie"]
    assert ties and all(f.severity == "info" and f.fields["margin"] <= f.fields["bound"] for f in ties)
    assert c.coverage.pairs_skipped == 0
