"""Sampled traffic on llama-server through the official `openai` client (issue 45, item 5), on the
DFlash (`clean`), EAGLE3 (`eagle3`) and MTP (`mtp`) fixture pairs: on two slots, two chat
completions sent at once at temperature 0.8 with a seed each, then a completion with temperature,
top-p and min-p, then one that sends no sampling field (the server's defaults: llama.cpp's
temperature 0.8). One capture per kind holds the three scenarios (`-lv 5`: the server's log says
each request's sampler); each request's sampler is recorded as it was sent, every flow compares
clean against the reference that follows it (read as greedy, the same dump fails), and `check
--run` passes. MTP's second request on a slot meets upstream's pending hidden kept across requests:
named `stale_pending` at its flow, and nothing else. A planted driver fault on a sampled request
is still named, for DFlash, EAGLE3 and MTP. Real build, real fixture models, real HTTP."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from test_server_clients import SYSTEM, WAIT_S, _client, _featdiff

import featdiff_process
from featdiff.dump.reader import read_dump
from featdiff.dump.sampling import DEFAULT_SEED
from featdiff.dump.writer import DumpWriter
from featdiff.programs.server import free_port

pytestmark = pytest.mark.slow

N_PREDICT = 16
SEEDS = (42, 7)  # one per request of the two sent at once
QUESTIONS = ("What is the capital of France?", "Name a prime number above ten.")
TOP_P_MIN_P = {"temperature": 0.7, "top_p": 0.9, "min_p": 0.1}
# (b) and (c) run on a slot that served before: no prefix reused from its cache, where upstream's
# EAGLE3 driver keeps a row of the earlier request (wrong_source another_request_row, issue 46)
FRESH = {"cache_prompt": False}
N_REQUESTS = 4  # the two at once, the top-p/min-p one, the one on the server's defaults
# one thread each (two shared cores); -lv 5: llama-server logs each request's sampler
# the server's default seed, for the requests that send none ((b), (c)): at -lv 5 the pinned server
# answers 500 ("invalid UTF-8 byte") to a completion whose text holds one, which a random seed
# gives the tiny pairs now and then (5 of 80 default-sampled requests here); a fixed one gives the
# same text every run
SERVER_SEED = 1234
SERVER = ["-c", "2048", "--spec-draft-n-max", "3", "-t", "1", "-td", "1", "-lv", "5", "--seed", str(SERVER_SEED)]


@dataclass(frozen=True)
class Kind:
    """One drafter kind's pair as the server and featdiff take it."""

    pairs: str  # the session fixture that makes the pair (tests/conftest.py)
    variant: str
    spec_type: str
    # EAGLE3's draft steps of two slots sampled on the backend read one slot's candidates (the
    # pinned server's bug, docs/guide-server.md): its drafts are sampled on the CPU here
    options: tuple[str, ...] = ()
    fault: str = ""  # a driver fault of 0002-driver-faults.patch (docs/faults.md) and its finding
    finding: str = ""
    # slots of the scenarios' server; with one per request, request i is sent to slot i (`id_slot`),
    # so (b) and (c) run on slots no request used: upstream's MTP driver hands a slot's next request
    # the pending hidden of its last (test_mtp_a_sampled_request_on_a_slot_that_served_names_stale_pending)
    n_slots: int = 2

    def slot_of(self, request: int) -> int | None:
        """The slot request `request` (0, 1: (a); 2: (b); 3: (c)) is sent to; None: the server's choice."""
        return request if self.n_slots >= N_REQUESTS else None

    def server_models(self, d: Path) -> list[str]:
        return ["-m", str(d / "target.gguf")] + (
            [] if self.spec_type == "draft-mtp" else ["-md", str(d / "draft.gguf")]
        )

    def featdiff_models(self, d: Path) -> list[object]:
        """`--target` and `--model` of reference and check (an MTP head: the target's HF checkpoint)."""
        if self.spec_type == "draft-mtp":
            return ["--target", d / "target-hf", "--model", d / "target.gguf"]
        return ["--target", d / "target.gguf", "--model", d / "draft.gguf"]

    def check_models(self, d: Path) -> list[object]:
        if self.spec_type == "draft-mtp":
            return ["--target", d / "target.gguf", "--model", d / "target.gguf", "--ref-target", d / "target-hf"]
        return self.featdiff_models(d)


KINDS = {
    "dflash": Kind("fixture_models", "clean", "draft-dflash", fault="layers-plus1", finding="layer_offset"),
    "eagle3": Kind(
        "eagle3_pairs",
        "eagle3",
        "draft-eagle3",
        ("--no-spec-draft-backend-sampling",),
        fault="layers-plus1",
        finding="layer_offset",
    ),  # fmt: skip
    "mtp": Kind("mtp_pairs", "mtp", "draft-mtp", fault="mtp-no-shift", finding="row_shift", n_slots=4),
}


def _capture(tools, kind: Kind, d: Path, tmp: Path, traffic, n: int, fault: str = "", n_slots: int = 0) -> Path:
    """`featdiff capture --exec` of llama-server (`-np n_slots`, else the kind's) on the pair in `d`
    while `traffic(port)` runs."""
    out, err, port = tmp / "run.npz", tmp / "stderr", free_port()
    slots = ["-np", str(n_slots or kind.n_slots)]
    command = [tools.program("llama-server"), *kind.server_models(d), "--spec-type", kind.spec_type, *SERVER, *slots]
    env = {**os.environ, featdiff_process.FAULT_VAR: fault} if fault else None
    args = ["capture", "--exec", "-o", out, "--requests", n, "--", *command, *kind.options, "--port", port]
    proc = featdiff_process.start(args, err, env)
    featdiff_process.wait_listening(proc, err, WAIT_S)
    traffic(port)
    assert proc.wait(timeout=WAIT_S) == 0, err.read_text()[-3000:]
    return out


def _chat(port: int, question: str, **sampling) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    answer = _client(port).chat.completions.create(model="m", messages=messages, max_tokens=N_PREDICT, **sampling)
    return answer.choices[0].message.content or ""


def _two_at_once(port: int, kind: Kind) -> None:
    """(a): two chats sent together (a barrier), temperature 0.8 with a seed each, on two slots."""
    together = threading.Barrier(2)

    def ask(i: int) -> None:
        together.wait()
        _chat(port, QUESTIONS[i], temperature=0.8, seed=SEEDS[i], extra_body=_on_slot(kind, i))

    clients = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()


def _on_slot(kind: Kind, request: int) -> dict:
    """llama-server's `id_slot` field where the kind sends request `request` to a slot of its own."""
    slot = kind.slot_of(request)
    return {} if slot is None else {"id_slot": slot}


def _traffic(port: int, kind: Kind) -> None:
    """(a), then (b) top-p and min-p (min_p is llama-server's own field: `extra_body`), then (c)
    a completion that sends no sampling field."""
    _two_at_once(port, kind)
    b = dict(TOP_P_MIN_P)
    _client(port).completions.create(
        model="m", prompt="The quick brown fox", max_tokens=N_PREDICT, temperature=b["temperature"], top_p=b["top_p"],
        extra_body={"min_p": b["min_p"], **FRESH, **_on_slot(kind, 2)},
    )  # fmt: skip
    _client(port).completions.create(
        model="m", prompt="Once upon a time", max_tokens=N_PREDICT, extra_body={**FRESH, **_on_slot(kind, 3)}
    )


@dataclass(frozen=True)
class Verdicts:
    kind: Kind
    samplers: dict  # flow -> its recorded sampler
    seq_ids: dict  # flow -> its sequence (slot)
    compared: dict  # compare --json
    check_rc: int
    check_out: str
    greedy: dict  # compare --json of the same dump read as greedy (its samplers dropped)


@pytest.fixture(scope="module", params=list(KINDS))
def sampled(request, tools, tmp_path_factory) -> Verdicts:
    """One capture of the three scenarios per kind, compared and checked once."""
    kind = KINDS[request.param]
    d = request.getfixturevalue(kind.pairs)(kind.variant)
    tmp = tmp_path_factory.mktemp(f"sampled-{request.param}")
    run = _capture(tools, kind, d, tmp, lambda port: _traffic(port, kind), N_REQUESTS)
    with read_dump(run) as dump:
        m = dump.manifest
    flows = {k: m.flow_info(k) for k in m.flow_ids()}
    assert len(flows) == N_REQUESTS and all(not f.why_unreplayable() for f in flows.values()), flows
    ref = tmp / "ref.npz"
    made = _featdiff("reference", *kind.featdiff_models(d), "--follow", run, "-o", ref)
    assert made.returncode == 0, made.stderr[-3000:]
    compared = _featdiff("compare", ref, run, "--json", "-")
    assert compared.returncode in (0, 1), compared.stderr[-3000:]
    check = _featdiff("check", *kind.check_models(d), "--run", run)
    greedy = _featdiff("compare", ref, _as_greedy(run, tmp / "greedy.npz"), "--json", "-")
    return Verdicts(
        kind, {s.flow: s for s in m.samplers}, {k: f.seq_id for k, f in flows.items()}, json.loads(compared.stdout),
        check.returncode, check.stdout[-3000:] + check.stderr[-2000:], json.loads(greedy.stdout),
    )  # fmt: skip


def _as_greedy(run: Path, out: Path) -> Path:
    """The dump `run` without its samplers: read as a greedy run (every dump before issue 45)."""
    with read_dump(run) as dump:
        writer = DumpWriter(out)
        for r in dump.records():
            writer.add(r, np.array(dump.array(r)))
        return writer.close(replace(dump.manifest, records=(), samplers=()))


def _errors(v: Verdicts, flows: set[int]) -> list[str]:
    return [f["message"] for f in v.compared["findings"] if f["severity"] == "error" and f.get("flow") in flows]


def test_two_seeded_requests_at_once_on_two_slots_compare_clean(sampled):
    a = (0, 1)  # the two sent at once start first
    assert {sampled.seq_ids[k] for k in a} == {0, 1}, sampled.seq_ids
    # a seed is logged by the slot's next launch (programs/sampler.py): the server's (--seed) where none came,
    # and where no request followed on the slot (MTP's, a slot per request)
    seeds = {sampled.samplers[k].seed for k in a} - {DEFAULT_SEED, SERVER_SEED}
    assert seeds <= set(SEEDS) and (seeds or sampled.kind.slot_of(0) is not None), seeds
    assert [sampled.samplers[k].temperature for k in a] == pytest.approx([0.8, 0.8])
    assert all(sampled.samplers[k].source == "request" for k in a)
    assert not _errors(sampled, set(a))


def test_top_p_and_min_p_on_one_slot_compare_clean(sampled):
    assert sampled.kind.slot_of(2) in (None, sampled.seq_ids[2]), sampled.seq_ids
    s = sampled.samplers[2]
    assert s.source == "request" and (s.temperature, s.top_p, s.min_p) == pytest.approx(tuple(TOP_P_MIN_P.values())), s
    assert not _errors(sampled, {2})


def test_a_request_with_no_sampling_fields_takes_the_servers_defaults_and_compares_clean(sampled):
    assert sampled.kind.slot_of(3) in (None, sampled.seq_ids[3]), sampled.seq_ids
    s = sampled.samplers[3]
    assert (s.source, s.top_k) == ("request", 40) and (s.temperature, s.top_p, s.min_p) == pytest.approx(
        (0.8, 0.95, 0.05)
    )
    assert not _errors(sampled, {3})


def test_the_sampled_capture_compares_clean_and_check_run_passes(sampled):
    errors = [f["message"] for f in sampled.compared["findings"] if f["severity"] == "error"]
    assert sampled.compared["ok"] and not errors, errors
    assert sampled.compared["coverage"]["pairs_skipped"] == 0 and sampled.compared["coverage"]["rows_skipped"] == 0
    assert sampled.check_rc == 0, sampled.check_out
    # the traffic sampled tokens the reference does not put first: read as greedy, the same dump fails
    wrong = [f for f in sampled.greedy["findings"] if f["severity"] == "error"]
    assert wrong and wrong[0]["kind"] == "divergence" and "argmax" in wrong[0]["message"], wrong[:1]


@pytest.mark.parametrize("name", list(KINDS))
def test_a_driver_fault_is_named_on_a_sampled_request(name, tools, request, tmp_path):
    """(d): the kind's planted driver fault (FEATDIFF_FAULT) under a request at temperature 0.8:
    compare names it first, and `check --run` fails on it."""
    kind = KINDS[name]
    d = request.getfixturevalue(kind.pairs)(kind.variant)
    run = _capture(
        tools, kind, d, tmp_path, lambda port: _chat(port, QUESTIONS[0], temperature=0.8, seed=SEEDS[0]), 1, kind.fault
    )
    ref = tmp_path / "ref.npz"
    made = _featdiff("reference", *kind.featdiff_models(d), "--follow", run, "-o", ref)
    assert made.returncode == 0, made.stderr[-3000:]
    compared = _featdiff("compare", ref, run, "--json", "-")
    findings = json.loads(compared.stdout)["findings"]
    errors = [f for f in findings if f["severity"] == "error"]
    assert compared.returncode == 1 and errors and errors[0]["kind"] == kind.finding, [
        (f["kind"], f["tensor"], f["message"]) for f in errors
    ]
    assert not [
        f for f in errors if f["kind"] == "divergence" and "argmax" in f["message"]
    ]  # the sample is judged as one
    check = _featdiff("check", *kind.check_models(d), "--run", run, "--json", "-")
    reasons = json.loads(check.stdout)["reasons"] if check.stdout.strip() else check.stderr[-3000:]
    assert check.returncode == 1 and reasons[0].startswith(f"{kind.finding} at "), reasons


def _one_slot_twice(port: int) -> None:
    """Two requests one after the other on one slot: a chat at temperature 0.8 with a seed, then
    (c), a completion that sends no sampling field."""
    _chat(port, QUESTIONS[0], temperature=0.8, seed=SEEDS[0])
    _client(port).completions.create(model="m", prompt="Once upon a time", max_tokens=N_PREDICT, extra_body=FRESH)


def test_mtp_a_sampled_request_on_a_slot_that_served_names_stale_pending(tools, mtp_pairs, tmp_path):
    """Upstream's MTP driver keeps each sequence's pending hidden across requests (begin() leaves
    `pending_h` be, common/speculative.cpp): on `-np 1` the second sampled request's first head
    row is handed the first request's last hidden. Exactly that is named, at the second flow: no
    bare `divergence`, no argmax reading of the samples, nothing in the first flow; `check --run`
    fails on it and says why."""
    kind = KINDS["mtp"]
    d = mtp_pairs(kind.variant)
    run = _capture(tools, kind, d, tmp_path, _one_slot_twice, 2, n_slots=1)
    with read_dump(run) as dump:
        m = dump.manifest
    assert {s.flow for s in m.samplers if not s.is_greedy} == {0, 1}, m.samplers
    ref = tmp_path / "ref.npz"
    made = _featdiff("reference", *kind.featdiff_models(d), "--follow", run, "-o", ref)
    assert made.returncode == 0, made.stderr[-3000:]
    compared = _featdiff("compare", ref, run, "--json", "-")
    errors = [f for f in json.loads(compared.stdout)["findings"] if f["severity"] == "error"]
    named = [(f["kind"], f["tensor"], f.get("source"), f.get("flow")) for f in errors]
    assert compared.returncode == 1 and named == [("wrong_source", "mtp_h_input", "stale_pending", 1)], [
        f["message"] for f in errors
    ]
    assert "pending_h" in errors[0]["message"]
    check = _featdiff("check", *kind.check_models(d), "--run", run)
    out = check.stdout + check.stderr
    assert check.returncode == 1 and "wrong_source at mtp_h_input" in out and "pending_h" in out, out[-3000:]
    assert "- divergence at" not in out, out[-3000:]
