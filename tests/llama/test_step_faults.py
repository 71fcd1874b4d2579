"""The draft-step faults of 0009-step-faults.patch and 0011-step-faults-2.patch (issue 42, items 2
and 5), captured around `llama-speculative-simple` of the patched build with `FEATDIFF_FAULT` set
and compared with the reference that follows the run, as a user would: each is named with its
kind, tensor and `where` (docs/faults.md). EAGLE3's and MTP's steps are one-token decodes: steps one
position late (or early) are `position_offset` at the first step off; a step past the first fed
the seed's state again is `wrong_source` `seed_state` at the state it was fed; steps fed a state
row never written are `zeros` there; an MTP pending row never refreshed is `stale`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from featdiff.diff import compare_dumps
from featdiff.dump.reader import read_dump
from featdiff.dump.records import Eval
from featdiff.programs import exec as exec_capture
from featdiff.torchref.kind import reference

RUN_TIMEOUT_S = 120
PROGRAM = "llama-speculative-simple"
# three drafts a round (the seed and two steps), none stopped early by the draft's confidence
DRAFT_ARGS = ["--spec-draft-n-max", "3", "--spec-draft-p-min", "0", "-c", "256", "-t", "1"]

pytestmark = pytest.mark.slow  # the pinned converter makes the pairs (cached per machine)


def _eagle3(tools, d: Path) -> tuple[list[str], Path, Path]:
    cmd = [str(tools.program(PROGRAM)), "-m", str(d / "target.gguf"), "-md", str(d / "draft.gguf")]
    cmd += ["--spec-type", "draft-eagle3", *DRAFT_ARGS, "-td", "1", "-p", "The quick brown fox", "-n", "16"]
    return [*cmd, "--temp", "0"], d / "target.gguf", d / "draft.gguf"


def _mtp(tools, d: Path) -> tuple[list[str], Path, Path]:
    cmd = [str(tools.program(PROGRAM)), "-m", str(d / "target.gguf"), "--spec-type", "draft-mtp", *DRAFT_ARGS]
    return [*cmd, "-p", "hello world", "-n", "16", "--temp", "0"], d / "target-hf", d / "target.gguf"


def _errors(tools, pair: tuple[list[str], Path, Path], fault: str, tmp_path: Path, monkeypatch):
    cmd, target, model = pair
    monkeypatch.setenv("FEATDIFF_FAULT", fault)  # read by common/speculative.cpp (0002, 0009)
    run = exec_capture.capture_exec(cmd, tmp_path / "run.npz", timeout_s=RUN_TIMEOUT_S)
    monkeypatch.delenv("FEATDIFF_FAULT")
    ref = reference(
        target, model, tmp_path / "ref.npz", prompt=None, tokens=None, rounds=0, dtype="float32", device="cpu",
        kv_dtype="f16", llama_dir=None, follow=run,
    )  # fmt: skip
    c = compare_dumps(ref, run)
    return [f for f in c.findings if f.severity == "error"]


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_draft_steps_one_position_late_are_a_position_offset_of_the_draft(
    tools, eagle3_pairs, mtp_pairs, kind, tmp_path, monkeypatch
):
    pair = _eagle3(tools, eagle3_pairs("eagle3")) if kind == "eagle3" else _mtp(tools, mtp_pairs("mtp"))
    errors = _errors(tools, pair, f"{kind}-step-pos", tmp_path, monkeypatch)
    assert errors, "the late steps were not named"
    first = errors[0]
    assert (first.kind, first.tensor) == ("position_offset", "inp_pos"), [f.message for f in errors]
    assert (first.fields["offset"], first.fields["role"], first.fields["phase"]) == (1, "draft", "draft")
    assert first.message.startswith("draft step 1"), first.message
    assert first.fields["where"] == "driver", first.fields["where_reason"]


@pytest.mark.parametrize(
    "kind, tensor",
    [("eagle3", "g_norm-0"), ("mtp", "mtp_h_input")],  # the head's input itself, read before its norm (issue 42)
)
def test_steps_fed_the_seeds_state_are_a_wrong_source_seed_state(
    tools, eagle3_pairs, mtp_pairs, kind, tensor, tmp_path, monkeypatch
):
    pair = _eagle3(tools, eagle3_pairs("eagle3")) if kind == "eagle3" else _mtp(tools, mtp_pairs("mtp"))
    errors = _errors(tools, pair, f"{kind}-step-seed-state", tmp_path, monkeypatch)
    assert errors, "the steps fed the seed's state were not named"
    first = errors[0]
    assert (first.kind, first.tensor, first.fields.get("source")) == ("wrong_source", tensor, "seed_state"), [
        f.message for f in errors
    ]
    assert first.fields["where"] == "driver", first.fields["where_reason"]


@pytest.mark.parametrize("kind, tensor", [("eagle3", "g_norm-0"), ("mtp", "mtp_h_input")])
def test_steps_fed_a_state_row_never_written_are_zeros_from_the_driver(
    tools, eagle3_pairs, mtp_pairs, kind, tensor, tmp_path, monkeypatch
):
    pair = _eagle3(tools, eagle3_pairs("eagle3")) if kind == "eagle3" else _mtp(tools, mtp_pairs("mtp"))
    errors = _errors(tools, pair, f"{kind}-step-zero-state", tmp_path, monkeypatch)  # 0011
    assert errors, "the steps fed zeros were not named"
    first = errors[0]
    assert (first.kind, first.tensor) == ("zeros", tensor), [f.message for f in errors]
    assert first.message.startswith(f"{tensor} of draft steps 1, 2 "), first.message  # not the seed's row
    assert len(first.fields["rows"]) == 2
    assert first.fields["where"] == "driver", first.fields["where_reason"]


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_draft_steps_one_position_early_are_a_position_offset_of_minus_1(
    tools, eagle3_pairs, mtp_pairs, kind, tmp_path, monkeypatch
):
    pair = _eagle3(tools, eagle3_pairs("eagle3")) if kind == "eagle3" else _mtp(tools, mtp_pairs("mtp"))
    errors = _errors(tools, pair, f"{kind}-step-pos-early", tmp_path, monkeypatch)  # 0011: on the seed's position
    assert errors, "the early steps were not named"
    first = errors[0]
    assert (first.kind, first.tensor) == ("position_offset", "inp_pos"), [f.message for f in errors]
    assert (first.fields["offset"], first.fields["role"], first.fields["phase"]) == (-1, "draft", "draft")
    assert first.message.startswith("draft step 1") and "one position early" in first.message, first.message
    assert first.fields["where"] == "driver", first.fields["where_reason"]


def test_eagle3_tokens_paired_two_rows_ahead_are_a_row_shift_of_plus_1(tools, eagle3_pairs, tmp_path, monkeypatch):
    """0011's `eagle3-shift-2`: the catch-up pairs token k + 2 with the encoder row of k, one past
    the t+1 convention (eagle3-no-shift, 0002, is the shift the other way)."""
    errors = _errors(tools, _eagle3(tools, eagle3_pairs("eagle3")), "eagle3-shift-2", tmp_path, monkeypatch)
    assert errors, "the pairing was not named"
    first = errors[0]
    assert (first.kind, first.tensor, first.fields["shift"]) == ("row_shift", "inp_embd", 1), [
        f.message for f in errors
    ]
    assert first.fields["where"] == "driver", first.fields["where_reason"]


def test_an_mtp_pending_row_never_refreshed_is_stale(tools, mtp_pairs, tmp_path, monkeypatch):
    """0011's `mtp-pending-stale`: the row a catch-up's first token and each seed read stays the
    one the prompt left; the second round's seed reads the row the first round's catch-up read."""
    errors = _errors(tools, _mtp(tools, mtp_pairs("mtp")), "mtp-pending-stale", tmp_path, monkeypatch)
    assert errors, "the stale pending row was not named"
    first = errors[0]
    assert (first.kind, first.tensor) == ("stale", "mtp_h_input"), [f.message for f in errors]
    assert len(first.fields["rows"]) == 1 and first.fields["source_eval"] is not None  # the seed's one row
    assert "an earlier round" in first.message, first.message
    assert first.fields["where"] == "driver", first.fields["where_reason"]
    # issue 42: source_eval is the run's eval (its numbering has the warm-ups the reference lacks),
    # the first round's catch-up, whose row of the stale position is, bit for bit, the stale row
    source, (position,) = first.fields["source_eval"], first.fields["rows"]
    rows = _rows_by_eval(tmp_path / "run.npz", first.tensor)
    assert rows[source][0].phase == "inject" and rows[source][0].round == 1, rows[source][0]
    repeated = [
        e.eval
        for e, held in rows.values()
        if e.eval > source
        and position in e.positions
        and any(np.array_equal(held[e.positions.index(position)], r) for r in rows[source][1])
    ]
    assert repeated, (source, position)


def _rows_by_eval(run: Path, name: str) -> dict[int, tuple[Eval, np.ndarray]]:
    """The run's record `name` (its first occurrence) of each eval: the eval and its rows, (n_tokens, D)."""
    with read_dump(run) as dump:
        evals = {e.eval: e for e in dump.manifest.evals}
        return {
            r.eval: (evals[r.eval], dump.array(r).reshape(len(evals[r.eval].positions), -1))  # (n_tokens, D)
            for r in dump.manifest.records
            if r.name == name and r.occurrence == 0
        }
