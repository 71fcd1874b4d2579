"""A one-token draft step handed another sequence's state (issue 42 item 2), planted by
0014-step-other-seq.patch: llama-server with two slots, two requests at once, so that each draft
step decodes both sequences' rows; under `FEATDIFF_FAULT=<kind>-step-other-seq` the second
sequence of each step batch is fed the first one's state (EAGLE3's g_embd, the MTP head's
h_nextn), every step's graph computing right from what it is given. compare names it
`wrong_source` / `another_sequence` at the state the step is fed, in the second sequence's flow,
naming the flow whose row it holds, `where: driver`; `check --run` names it too. Without the
fault the same traffic compares clean (test_eagle3_exec.py, test_mtp_exec.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import featdiff_process

pytestmark = pytest.mark.slow  # real server, the pinned converter's pairs (cached per machine)

RUN_TIMEOUT_S = 180
PROMPTS = ["hello world and more words", "The quick brown fox"]
N_PREDICT = 24
COMMON = ["--spec-draft-n-max", "3", "--spec-draft-p-min", "0", "-c", "256", "-t", "1", "-np", "2"]
# kind -> (pair, the drafter's options, the reference's target and model, the records a step is fed)
KINDS = {
    # the draft's sampling on the CPU: with backend sampling the pinned server samples both slots'
    # steps from one slot's candidates (test_eagle3_exec.py), another finding than this one
    "eagle3": ("eagle3", ["-md", "draft.gguf", "--spec-type", "draft-eagle3", "--no-spec-draft-backend-sampling"]),
    "mtp": ("mtp-glm4moe", ["--spec-type", "draft-mtp"]),
}


def _compared(tools, eagle3_pairs, mtp_pairs, kind: str, tmp_path: Path):
    variant, options = KINDS[kind]
    d = eagle3_pairs(variant) if kind == "eagle3" else mtp_pairs(variant)
    options = [str(d / o) if o.endswith(".gguf") else o for o in options]
    command = [str(tools.program("llama-server")), "-m", str(d / "target.gguf"), *options, *COMMON]
    env = {**os.environ, featdiff_process.FAULT_VAR: f"{kind}-step-other-seq"}
    proc, out, err, port = featdiff_process.capture_server(command, tmp_path, len(PROMPTS), RUN_TIMEOUT_S, env)
    featdiff_process.complete_together(port, PROMPTS, N_PREDICT, RUN_TIMEOUT_S)
    assert proc.wait(timeout=RUN_TIMEOUT_S) == 0, err.read_text()[-3000:]
    target, model = (d / "target.gguf", d / "draft.gguf") if kind == "eagle3" else (d / "target-hf", d / "target.gguf")
    return featdiff_process.two_flows_compared(target, model, out, tmp_path), d, out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_step_fed_another_sequences_state_is_named_with_that_sequence(tools, eagle3_pairs, mtp_pairs, kind, tmp_path):
    from featdiff.dump import read_dump
    from featdiff.kinds.registry import is_step_state

    c, d, run = _compared(tools, eagle3_pairs, mtp_pairs, kind, tmp_path)
    errors = [f for f in c.findings if f.severity == "error"]
    assert errors, "the fault was not seen"
    first = errors[0]
    assert (first.kind, first.fields["source"], first.fields["where"]) == (
        "wrong_source",
        "another_sequence",
        "driver",
    ), [(e.kind, e.tensor, e.message) for e in errors]
    assert is_step_state(first.tensor), first.tensor
    with read_dump(run) as dump:
        (other,) = [f for f in dump.manifest.flows if f.flow != first.fields["flow"]]
    assert first.fields["candidate"] == f"flow {other.flow} (sequence {other.seq_id})", first.message
    assert not [e for e in errors if e.fields["flow"] == other.flow], [e.message for e in errors]  # its own: clean
    models = ["--target", d / "target.gguf"]
    models += (
        ["--model", d / "draft.gguf"]
        if kind == "eagle3"
        else ["--model", d / "target.gguf", "--ref-target", d / "target-hf"]
    )
    checked = featdiff_process.check_names_fault([*models, "--run", run], None, tmp_path / "check", "wrong_source")
    assert checked[0].get("source") == "another_sequence", checked
