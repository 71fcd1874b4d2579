"""llama-server as users run it (issue 30): its defaults (automatic slots, one unified KV cache,
the RAM prompt cache), two slots serving separate concurrent requests, and the official `openai`
client's traffic: two concurrent chat completions sharing a system prompt (one streaming), a
completion longer than the micro-batch, then the first conversation again, which the server
restores from its RAM prompt cache. Each capture compares clean flow by flow with nothing
skipped and `featdiff check --run` passes it; a prompt cache that restores the drafter's state
from another saved prompt (the planted `cache-restore-swap`) is named at that flow. Real build,
real fixture models, real HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openai import DefaultHttpxClient, OpenAI
from typer.testing import CliRunner

import featdiff_process
from featdiff.cli import app
from featdiff.dump.reader import read_dump
from featdiff.programs.server import free_port

pytestmark = pytest.mark.slow

WAIT_S = 120
N_PREDICT = 8
SYSTEM = "You answer in one short line. Keep to the facts, no preamble. " * 3  # shared by both chats
QUESTIONS = ("What is the capital of France?", "Name a prime number above ten.")
LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 45  # > 512 tokens
N_REQUESTS = 4  # two concurrent chats, the long completion, the first chat again
# one thread each: two shared cores
THREADS = ["-t", "1", "-td", "1", "--spec-type", "draft-dflash"]


def _client(port: int) -> OpenAI:
    return OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="featdiff",
        max_retries=0,
        http_client=DefaultHttpxClient(trust_env=False, timeout=WAIT_S),  # loopback: no proxy
    )


def _chat(client: OpenAI, question: str, stream: bool) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    if stream:
        parts = client.chat.completions.create(
            model="m", messages=messages, max_tokens=N_PREDICT, temperature=0, stream=True
        )
        return "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    answer = client.chat.completions.create(model="m", messages=messages, max_tokens=N_PREDICT, temperature=0)
    return answer.choices[0].message.content or ""


def _traffic(port: int) -> None:
    """The issue's traffic, as an application sends it."""
    client = _client(port)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_chat, client, QUESTIONS[0], True)
        second = pool.submit(_chat, client, QUESTIONS[1], False)
        first.result(), second.result()
    client.completions.create(model="m", prompt=LONG_PROMPT, max_tokens=N_PREDICT, temperature=0)
    _chat(client, QUESTIONS[0], True)  # the RAM prompt cache (or the slot) holds it


def _capture(
    tmp: Path, models: Path, server: Path, options: list[str], fault: str = "", traffic=None, n: int = N_REQUESTS
) -> Path:
    out, err, port = tmp / "run.npz", tmp / "stderr", free_port()
    command = [str(server), "-m", str(models / "target.gguf"), "-md", str(models / "draft.gguf"), *THREADS]
    env = {**os.environ, "FEATDIFF_FAULT": fault} if fault else None
    args = ["capture", "--exec", "-o", out, "--requests", n, "--", *command, *options, "--port", port]
    proc = featdiff_process.start(args, err, env)
    featdiff_process.wait_listening(proc, err, WAIT_S)
    (traffic or _traffic)(port)
    assert proc.wait(timeout=WAIT_S) == 0, err.read_text()[-3000:]
    assert "Duplicate name" not in err.read_text()
    return out


def _featdiff(*args: object) -> subprocess.CompletedProcess:
    """featdiff's command line run in this process (typer's CliRunner): each `reference` and
    `check` would otherwise start torch again in a process of its own. An exception the command
    line does not turn into an exit code fails the test with its traceback, never as exit 1."""
    argv = [str(a) for a in args]
    result = CliRunner().invoke(app, argv, env={"GITHUB_STEP_SUMMARY": None})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(argv, result.exit_code, result.stdout, result.stderr)


def _verdicts(tmp: Path, models: Path, run: Path) -> tuple[dict, subprocess.CompletedProcess]:
    """compare of the run against `reference --follow` of it, and `check --run` of it."""
    ref = tmp / "ref.npz"
    made = _featdiff(
        "reference", "--target", models / "target.gguf", "--model", models / "draft.gguf", "--follow", run, "-o", ref
    )
    assert made.returncode == 0, made.stderr[-3000:]
    compared = _featdiff("compare", ref, run, "--json", "-")
    assert compared.returncode in (0, 1), compared.stderr[-3000:]
    models_args = ["--target", models / "target.gguf", "--model", models / "draft.gguf"]
    check = _featdiff("check", *models_args, "--run", run, "--json", tmp / "check.json")
    return json.loads(compared.stdout), check


SCENARIOS = {
    "two-slots": ["-np", "2"],  # separate concurrent requests share batches
    "one-slot-ram-cache": ["-np", "1"],  # the repeated chat restored from the RAM prompt cache
    "defaults": [],  # automatic slots, unified KV cache, RAM prompt cache, the model's context
    "defaults-no-ram-cache": ["--cache-ram", "0"],
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_openai_clients_traffic_compares_clean_flow_by_flow(scenario, tools, fixture_models, tmp_path):
    models = fixture_models("clean")
    run = _capture(tmp_path, models, tools.program("llama-server"), SCENARIOS[scenario])
    with read_dump(run) as dump:
        m = dump.manifest
    flows = [m.flow_info(k) for k in m.flow_ids()]
    assert len(flows) == N_REQUESTS, [(f.flow, f.seq_id, f.n_cached) for f in flows]
    assert all(not f.why_unreplayable() for f in flows), [f.why_unreplayable() for f in flows]
    result, check = _verdicts(tmp_path, models, run)
    errors = [f["message"] for f in result["findings"] if f["severity"] == "error"]
    assert result["ok"] and not errors, errors
    assert result["coverage"]["pairs_skipped"] == 0 and result["coverage"]["rows_skipped"] == 0
    assert not [f for f in result["findings"] if f["kind"] == "flow_note"]  # every flow followed and compared
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-2000:]


def test_a_ram_cache_restoring_the_drafters_state_from_another_prompt_is_named_at_its_flow(
    tools, fixture_models, tmp_path
):
    models = fixture_models("clean")
    run = _capture(tmp_path, models, tools.program("llama-server"), ["-np", "1"], fault="cache-restore-swap")
    with read_dump(run) as dump:
        m = dump.manifest
    swapped = [m.flow_info(k) for k in m.flow_ids() if m.flow_info(k).draft_cached not in (None,)]
    swapped = [f for f in swapped if tuple(f.draft_cached or ()) != f.prompt_tokens[: f.n_cached]]
    assert [f.flow for f in swapped] == [N_REQUESTS - 1]  # the repeated chat, restored from the cache
    result, check = _verdicts(tmp_path, models, run)
    named = [f for f in result["findings"] if f["kind"] == "wrong_source" and f["source"] == "another_saved_prompt"]
    assert named and named[0]["severity"] == "error" and named[0]["flow"] == N_REQUESTS - 1, result["findings"]
    assert not result["ok"] and check.returncode == 1
    checked = json.loads((tmp_path / "check.json").read_text())["comparison"]["findings"]  # check names it too
    assert [(f["kind"], f["source"], f["flow"]) for f in checked if f.get("source") == "another_saved_prompt"] == [
        ("wrong_source", "another_saved_prompt", N_REQUESTS - 1)
    ], [(f["kind"], f["tensor"]) for f in checked if f["severity"] == "error"]


def _four_clients(port: int) -> None:
    """Four concurrent clients of different lengths; one drops its stream after two chunks (the
    server cancels its slot)."""
    client = _client(port)

    def dropped() -> None:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Count to twenty."}]
        stream = client.chat.completions.create(model="m", messages=messages, max_tokens=40, temperature=0, stream=True)
        for i, _ in enumerate(stream):
            if i == 2:
                stream.close()  # the client disconnects mid-stream
                return

    with ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(_chat, client, QUESTIONS[0], True), pool.submit(dropped)]
        jobs += [pool.submit(client.completions.create, model="m", prompt=p, max_tokens=n, temperature=0)
                 for p, n in (("A longer request, with more to say. " * 4, 12), ("Short one.", 3))]  # fmt: skip
        for job in jobs:
            job.result()


def test_four_concurrent_clients_one_dropping_its_stream_compare_clean(tools, fixture_models, tmp_path):
    models = fixture_models("clean")
    # the draft read back through the sampler's candidates (llama.cpp's backend draft sampling, its
    # default) differed from that row's result_output in one row of a four-slot draft batch in 2 of
    # 10 runs here (up to 0.2 on a top-10 candidate; the drafts the same): not understood yet, so
    # this test reads the drafter's full logits; the two-slot and default scenarios keep it on
    options = ["-np", "4", "--no-spec-draft-backend-sampling"]
    run = _capture(tmp_path, models, tools.program("llama-server"), options, traffic=_four_clients, n=4)
    with read_dump(run) as dump:
        m = dump.manifest
    # four requests, served at once on several slots (the server may give two the slot whose cache
    # holds their shared system prompt, one after the other)
    assert len(m.flow_ids()) == 4 and len({m.flow_info(k).seq_id for k in m.flow_ids()}) >= 3
    result, check = _verdicts(tmp_path, models, run)
    errors = [f["message"] for f in result["findings"] if f["severity"] == "error"]
    assert result["ok"] and not errors, errors
    assert result["coverage"]["pairs_skipped"] == 0 and result["coverage"]["rows_skipped"] == 0
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-2000:]


def _past_the_context(port: int) -> None:
    """A completion longer than the slot's context (256: llama.cpp pads -c 128 up; the server shifts it),
    then a short one."""
    client = _client(port)
    client.completions.create(model="m", prompt="Tell a long story. " * 6, max_tokens=300, temperature=0)
    client.completions.create(model="m", prompt="Another, shorter request.", max_tokens=N_PREDICT, temperature=0)


def test_a_context_shift_is_named_as_not_modelled_and_the_other_flows_compare_clean(tools, fixture_models, tmp_path):
    models = fixture_models("clean")
    options = ["-np", "1", "-c", "128", "--context-shift", "--cache-ram", "0"]
    run = _capture(tmp_path, models, tools.program("llama-server"), options, traffic=_past_the_context, n=2)
    with read_dump(run) as dump:
        m = dump.manifest
    why = [m.flow_info(k).why_unreplayable() for k in m.flow_ids()]
    assert "while the flow ran" in why[0] and "seq_add" in why[0] and not any(why[1:]), why
    result, check = _verdicts(tmp_path, models, run)
    notes = [f for f in result["findings"] if f["kind"] == "flow_note"]
    errors = [f["message"] for f in result["findings"] if f["severity"] == "error"]
    assert result["ok"] and [f["severity"] for f in notes] == ["info"] and "flow 0" in notes[0]["message"], errors
    assert result["coverage"]["pairs"] > 0 and check.returncode == 0, check.stdout[-2000:]


def _slot_file_round_trip(port: int) -> None:
    """A chat, its slot saved to a file (`/slots`), another chat on the slot, the file restored,
    and the first chat again: the slot file holds the target's state alone."""
    client = _client(port)
    _chat(client, QUESTIONS[0], False)
    _slots(port, "save")
    _chat(client, QUESTIONS[1], False)
    _slots(port, "restore")
    _chat(client, QUESTIONS[0], False)


def _slots(port: int, action: str) -> None:
    body = json.dumps({"filename": "slot0.bin"}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/slots/0?action={action}", body, {"Content-Type": "application/json"}
    )
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=WAIT_S) as r:
        assert r.status == 200, r.read()


# llama-server's /slots save and restore write and read the target's state alone
# (tools/server/server-context.cpp, llama_state_seq_save_file(ctx_tgt, ...)): after the restore the
# drafter still holds the second chat's features where the target holds the first's
def test_a_slot_restored_from_its_file_is_followed_and_its_drafter_named(tools, fixture_models, tmp_path):
    models = fixture_models("clean")
    options = ["-np", "1", "--cache-ram", "0", "--slot-save-path", str(tmp_path)]
    run = _capture(tmp_path, models, tools.program("llama-server"), options, traffic=_slot_file_round_trip, n=3)
    with read_dump(run) as dump:
        last = dump.manifest.flow_info(2)
    assert last.n_cached > 0 and not last.why_unreplayable()  # the file's history, followed by its path
    result, _ = _verdicts(tmp_path, models, run)
    named = [f for f in result["findings"] if f["severity"] == "error"]
    assert [(f["kind"], f["flow"]) for f in named][:1] == [("wrong_source", 2)], named
    assert named[0]["source"] == "another_saved_prompt" and "restored without the drafter's" in named[0]["message"]


def test_two_requests_at_once_on_a_hybrid_target_compare_clean_flow_by_flow(tools, tmp_path_factory, tmp_path):
    """A Qwen3.5 target under speculation keeps rollback snapshots of its recurrent state:
    llama.cpp splits a batch of two slots with split_equal, keeping each slot's last rows in one
    graph, and each decode is split the same way (the preload notes llama_n_rs_seq). Both
    requests compare clean, each as a flow of its own."""
    from featdiff.factory.hf_targets import write_family_fixture

    models = write_family_fixture(tmp_path_factory.mktemp("fam-qwen35"), "qwen35")  # the pinned converter's
    prompts = ["hello world and more words", "hello there my old friend"]
    run = _capture(
        tmp_path, models, tools.program("llama-server"), ["-np", "2"],
        traffic=lambda port: featdiff_process.complete_together(port, prompts, 24, WAIT_S), n=2,
    )  # fmt: skip
    c = featdiff_process.two_flows_compared(models / "target-hf", models / "draft.gguf", run, tmp_path)
    assert c.ok, [f.message for f in c.findings if f.severity == "error"]


# --- EAGLE3 and MTP on the same server machinery (issue 46) ------------------------------------

# upstream's step drafters' behaviour across a llama-server slot's requests, as compare names it
# (wrong_source's source): a state the flow's history does not prescribe, never a bare divergence
UPSTREAM_STATE = ("another_request_row", "another_saved_prompt", "stale_pending")
STEP_LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # > 512 tokens of the step pairs' vocabulary


def _step_pair(kind: str, eagle3_pairs, mtp_pairs) -> tuple[Path, list[str], Path, Path]:
    """(pair dir, the server's drafter flags, the reference's --target, its --model) of a step kind."""
    if kind == "eagle3":
        d = eagle3_pairs("eagle3")
        return d, ["-md", str(d / "draft.gguf"), "--spec-type", "draft-eagle3"], d / "target.gguf", d / "draft.gguf"
    d = mtp_pairs("mtp")
    return d, ["--spec-type", "draft-mtp"], d / "target-hf", d / "target.gguf"


def _step_capture(tmp: Path, d: Path, spec: list[str], server: Path, options: list[str], traffic, n: int) -> Path:
    out, err, port = tmp / "run.npz", tmp / "stderr", free_port()
    command = [str(server), "-m", str(d / "target.gguf"), *spec, "-t", "1", "-td", "1", *options, "--port", port]
    proc = featdiff_process.start(["capture", "--exec", "-o", out, "--requests", n, "--", *command], err)
    featdiff_process.wait_listening(proc, err, WAIT_S)
    traffic(port)
    assert proc.wait(timeout=WAIT_S * 2) == 0, err.read_text()[-3000:]
    return out


def _step_findings(tmp: Path, target: Path, model: Path, run: Path) -> dict:
    made = _featdiff("reference", "--target", target, "--model", model, "--follow", run, "-o", tmp / "ref.npz")
    assert made.returncode == 0, made.stderr[-3000:]
    compared = _featdiff("compare", tmp / "ref.npz", run, "--json", "-")
    assert compared.returncode in (0, 1), compared.stderr[-3000:]
    return json.loads(compared.stdout)


def _only_upstream_state(result: dict) -> list[dict]:
    """The error findings, each asserted to name upstream's drafter state at its flow."""
    errors = [f for f in result["findings"] if f["severity"] == "error"]
    for f in errors:
        assert f["kind"] == "wrong_source" and f["source"] in UPSTREAM_STATE and "flow" in f, f["message"]
    assert not [
        f
        for f in result["findings"]
        if f["kind"] in ("row_shift", "missing_tensor") or "the block offset" in f["message"]
    ]
    return errors


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_a_step_drafter_after_a_ram_cache_restore_is_clean_or_names_upstreams_state(
    kind, tools, eagle3_pairs, mtp_pairs, tmp_path, monkeypatch
):
    """-np 1: two chats sharing a system prompt, a completion past the micro-batch, the first chat
    again (restored from the RAM prompt cache): each flow compares clean or its error names the
    state upstream's driver kept across requests, never a DFlash block's advice or a bare divergence."""
    monkeypatch.setattr(sys.modules[__name__], "LONG_PROMPT", STEP_LONG_PROMPT)
    d, spec, target, model = _step_pair(kind, eagle3_pairs, mtp_pairs)
    run = _step_capture(tmp_path, d, spec, tools.program("llama-server"), ["-np", "1"], _traffic, N_REQUESTS)
    result, check = _step_verdicts(tmp_path, target, model, run)
    errors = _only_upstream_state(result)
    _checked(tmp_path, check, _errors(errors))  # check --run exits by these and names the same
    with read_dump(run) as dump:
        flows = dump.manifest.flow_ids()
    # the slot's first request begins from nothing: only a later one can meet a state kept before it
    assert len(flows) == N_REQUESTS and 0 not in {f["flow"] for f in errors}, errors


def test_an_eagle3_slot_restored_from_its_file_names_the_drafters_rows_of_the_other_prompt(
    tools, eagle3_pairs, mtp_pairs, tmp_path
):
    d, spec, target, model = _step_pair("eagle3", eagle3_pairs, mtp_pairs)
    options = ["-np", "1", "--cache-ram", "0", "--slot-save-path", str(tmp_path)]
    run = _step_capture(tmp_path, d, spec, tools.program("llama-server"), options, _slot_file_round_trip, 3)
    result, check = _step_verdicts(tmp_path, target, model, run)
    errors = _only_upstream_state(result)
    _checked(tmp_path, check, _errors(errors))
    restored = [f for f in errors if f["flow"] == 2]
    assert [f["source"] for f in restored] == ["another_saved_prompt"] and "/slots" in restored[0]["message"], errors


# --- --cache-reuse and several slots for the step drafters (issue 46) ---------------------------

REUSED = "The quick brown fox jumps over the lazy dog near the river bank. " * 3  # a chunk past --cache-reuse 16
HEAD = "Notes for the day. "  # the two prompts' shared prefix (the slot's own cache)
REUSE_PROMPTS = (HEAD + "Something else entirely, said at some length first. " * 2 + REUSED, HEAD + REUSED)


def _reused_chunk(port: int) -> None:
    """A completion, then one that keeps its prefix and reuses a later chunk of it (the server
    shifts that chunk's rows down with seq_add, on the target and the drafter alike)."""
    client = _client(port)
    for prompt in REUSE_PROMPTS:
        client.completions.create(model="m", prompt=prompt, max_tokens=N_PREDICT, temperature=0)


def _step_verdicts(tmp: Path, target: Path, model: Path, run: Path) -> tuple[dict, subprocess.CompletedProcess]:
    """compare of a step drafter's run against `reference --follow` of it, and `check --run` of it."""
    result = _step_findings(tmp, target, model, run)
    # an MTP head is the target GGUF's own block: check runs it from the GGUF, its reference from the HF target
    models = (
        ["--target", model, "--model", model, "--ref-target", target]
        if target.is_dir()
        else ["--target", target, "--model", model]
    )
    check = _featdiff("check", *models, "--run", run, "--json", tmp / "check.json")
    return result, check


def _summary(result: dict) -> list[tuple]:
    """(kind, severity, flow, source, message) of each finding, for a failing assertion."""
    return [(f["kind"], f["severity"], f.get("flow"), f.get("source"), f["message"][:160]) for f in result["findings"]]


def _errors(findings: list[dict]) -> list[tuple]:
    """(kind, source, flow) of each error finding, in order."""
    return [(f["kind"], f.get("source"), f.get("flow")) for f in findings if f["severity"] == "error"]


def _checked(tmp: Path, check: subprocess.CompletedProcess, expected: list[tuple]) -> None:
    """`check --run` exits by the errors compare found (none: 0) and names the same ones."""
    assert check.returncode == (1 if expected else 0), check.stdout[-3000:] + check.stderr[-2000:]
    checked = json.loads((tmp / "check.json").read_text())["comparison"]["findings"]
    assert sorted(_errors(checked), key=str) == sorted(expected, key=str), _errors(checked)


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_cache_reuse_on_a_step_drafter_judges_each_flow_or_names_what_it_met(
    kind, tools, eagle3_pairs, mtp_pairs, tmp_path
):
    """--cache-reuse 16, -np 1: a completion, then one keeping its prefix and reusing a later chunk
    of it. EAGLE3: the server shifts that chunk's rows (seq_add on the target and the drafter), so
    the second flow alone is set aside (information naming the shift), the first compares clean and
    check --run passes. MTP: Qwen3.5's recurrent state holds the last position only, so with no
    checkpoint at the reused rows the server reprocesses the whole prompt (its "forcing full prompt
    re-processing"); both flows are followed from position 0, and the second, on a slot that served
    before, meets upstream's pending hidden kept across requests (stale_pending), named by compare
    and check."""
    d, spec, target, model = _step_pair(kind, eagle3_pairs, mtp_pairs)
    options = ["-np", "1", "--cache-ram", "0", "--cache-reuse", "16"]
    run = _step_capture(tmp_path, d, spec, tools.program("llama-server"), options, _reused_chunk, 2)
    with read_dump(run) as dump:
        flows = [dump.manifest.flow_info(k) for k in dump.manifest.flow_ids()]
    why = [f.why_unreplayable() for f in flows]
    result, check = _step_verdicts(tmp_path, target, model, run)
    notes = [(f["severity"], f["flow"]) for f in result["findings"] if f["kind"] == "flow_note"]
    assert result["coverage"]["pairs_skipped"] == 0 and result["coverage"]["rows_skipped"] == 0
    if kind == "eagle3":
        assert len(why) == 2 and not why[0] and "seq_add" in why[1] and "--cache-reuse" in why[1], why
        assert notes == [("info", 1)] and result["ok"] and not _errors(result["findings"]), _summary(result)
        _checked(tmp_path, check, [])
    else:
        assert why == ["", ""] and [f.n_cached for f in flows] == [0, 0] and not notes, (why, notes)
        assert _errors(result["findings"]) == [("wrong_source", "stale_pending", 1)], _summary(result)
        _checked(tmp_path, check, [("wrong_source", "stale_pending", 1)])


def _later_on_their_slot(m) -> dict[int, int]:
    """flow -> its n_cached, for each flow that is not the first its sequence (slot) served."""
    seen: set[int] = set()
    later: dict[int, int] = {}
    for k in m.flow_ids():
        f = m.flow_info(k)
        if f.seq_id in seen:
            later[k] = f.n_cached
        seen.add(f.seq_id)
    return later


@pytest.mark.parametrize("slots", [2, 4])
@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_several_slots_on_a_step_drafter_compare_clean_or_name_upstreams_state(
    kind, slots, tools, eagle3_pairs, mtp_pairs, tmp_path, monkeypatch
):
    """-np 2: two chats at once, the long completion, the first chat again; -np 4: four clients at
    once, one dropping its stream. Each slot's first request compares clean (rows batched with
    other slots judged with the batched-rows tolerance); a later request on a slot is MTP's
    stale_pending (upstream's pending hidden outlives the request), and EAGLE3's only where it kept
    a prefix (another_request_row); check --run names the same. EAGLE3 drafts on the CPU here
    (--no-spec-draft-backend-sampling: the backend-sampling bug is named elsewhere)."""
    monkeypatch.setattr(sys.modules[__name__], "LONG_PROMPT", STEP_LONG_PROMPT)
    d, spec, target, model = _step_pair(kind, eagle3_pairs, mtp_pairs)
    options = ["-np", str(slots)] + (["--no-spec-draft-backend-sampling"] if kind == "eagle3" else [])
    traffic, n = (_traffic, N_REQUESTS) if slots == 2 else (_four_clients, 4)
    run = _step_capture(tmp_path, d, spec, tools.program("llama-server"), options, traffic, n)
    with read_dump(run) as dump:
        m = dump.manifest
        later, seqs = _later_on_their_slot(m), {m.flow_info(k).seq_id for k in m.flow_ids()}
        n_flows = len(m.flow_ids())
    assert n_flows == n and len(seqs) >= min(slots, 3), (n_flows, seqs)
    result, check = _step_verdicts(tmp_path, target, model, run)
    errors = _errors(result["findings"])
    _only_upstream_state(result)
    assert result["coverage"]["pairs_skipped"] == 0 and result["coverage"]["rows_skipped"] == 0
    assert not [f for f in result["findings"] if f["kind"] == "flow_note"], _summary(result)
    if kind == "mtp":
        stale = [("wrong_source", "stale_pending", k) for k in sorted(later)]
        assert sorted(errors) == stale, (later, _summary(result))
    else:
        assert {k for *_, k in errors} <= {k for k, n_cached in later.items() if n_cached}, (later, _summary(result))
        assert {s for _, s, _ in errors} <= {"another_request_row"}, _summary(result)
    _checked(tmp_path, check, errors)


def test_an_mtp_slot_restored_from_its_file_is_followed_or_names_upstreams_state(
    tools, eagle3_pairs, mtp_pairs, tmp_path
):
    """The /slots round trip on an MTP head (-np 1, one request at a time): the slot's first
    request compares clean; each later one, the restored request included, begins with the
    pending hidden upstream's MTP driver kept from the request before (`pending_h`, never reset
    on a slot), named `stale_pending` at its flow, in compare and check --run alike; nothing else."""
    d, spec, target, model = _step_pair("mtp", eagle3_pairs, mtp_pairs)
    options = ["-np", "1", "--cache-ram", "0", "--slot-save-path", str(tmp_path)]
    run = _step_capture(tmp_path, d, spec, tools.program("llama-server"), options, _slot_file_round_trip, 3)
    result, check = _step_verdicts(tmp_path, target, model, run)
    errors = _only_upstream_state(result)
    _checked(tmp_path, check, _errors(errors))
    expected = [("wrong_source", "stale_pending", 1), ("wrong_source", "stale_pending", 2)]
    assert sorted(_errors(errors), key=str) == expected, _summary(result)
