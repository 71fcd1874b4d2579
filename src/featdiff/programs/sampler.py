"""How each flow of a program featdiff ran chose its tokens (the manifest's `samplers`): a
program's sampling flags, or, for llama-server, its account of each request it launched (its
trace log's "sampler chain" and "sampler params" lines, and the seed its next launch writes).

Consumes the program's command line, the flows (flow, sequence) and the program's log; produces
one `Sampler` per flow (docs/dump.md "samplers").
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path

from featdiff.dump.sampling import Sampler, sampler_from_command, sampler_from_request

log = logging.getLogger(__name__)

# tools/server/server-context.cpp launch_slot_with_task, for each request it launches on a slot,
# logs at trace verbosity the chain it built (common_sampler_print: "logits -> ?penalties -> ...
# -> top-k -> ... -> dist", a '?' marking a stage the parameters leave inactive) and the request's
# parameters (common_params_sampling::print: tab-indented "name = value" lines, %.3f). Each line
# opens with SLT_TRC's "slot <func>: id <slot> | task <task> | " (server-common.h).
SLOT_LINE = re.compile(r"launch_slot_: id +(\d+) \| task -?\d+ \| (.*)$")
CHAIN = "sampler chain: "
PARAMS = "sampler params: "
PARAM = re.compile(r"(\w+) = (-?[0-9.]+)")
# The same function logs, at debug verbosity, "launching slot : <the slot's JSON>" before it takes
# the request: the JSON's `params` (server-task.cpp task_params::to_json) are the slot's previous
# request's, the only place its seed is written
LAUNCHED = "launching slot : "
# common_sampler_print's stage names -> the chain's names in common_params_sampling.samplers
CHAIN_STAGES = {
    "penalties": "penalties", "dry": "dry", "top-n-sigma": "top_n_sigma", "top-k": "top_k", "typical": "typ_p",
    "top-p": "top_p", "min-p": "min_p", "xtc": "xtc", "temp-ext": "temperature", "temp": "temperature",
}  # fmt: skip
PRINTED_NAMES = {"temp": "temperature"}  # common_params_sampling::print's names that are not the request's
# Programs that build their target's sampler from common's flags (common_sampler_init); another
# program (llama-simple: its own greedy chain) is taken to choose greedily, and gets no record
FLAG_SAMPLING_PROGRAMS = ("llama-speculative-simple", "llama-speculative", "llama-cli", "llama-completion")
# common/log.h LOG_LEVEL_DEBUG: the verbosity at which llama-server writes its requests' samplers
DEBUG_VERBOSITY = 5


def launched_requests(text: str) -> dict[int, list[dict]]:
    """Slot id -> the sampler parameters of each request launched on it, in log order, named as
    a request names them (`temperature`, `top_p`, ..., `samplers`, and `seed` where the slot's
    next launch wrote it)."""
    out: dict[int, list[dict]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        found = SLOT_LINE.search(line)
        if found is None:
            continue
        slot, said = int(found.group(1)), found.group(2)
        if said.startswith(CHAIN):
            out.setdefault(slot, []).append({"samplers": _chain(said[len(CHAIN) :])})
        elif said.startswith(PARAMS) and out.get(slot):
            out[slot][-1].update(_printed_params(lines[i + 1 : i + 5]))
        elif said.startswith(LAUNCHED) and out.get(slot):
            seed = _previous_seed(said[len(LAUNCHED) :])
            if seed is not None:
                out[slot][-1]["seed"] = seed
    return out


def _chain(printed: str) -> list[str]:
    """The active stages of common_sampler_print's chain, by their names in `samplers`."""
    stages = [s.strip() for s in printed.split("->")]
    return [CHAIN_STAGES[s] for s in stages if s in CHAIN_STAGES]


def _printed_params(block: list[str]) -> dict[str, float]:
    """name -> value of common_params_sampling::print's tab-indented lines (those of `block`)."""
    out: dict[str, float] = {}
    for line in block:
        if not line.startswith("\t"):
            break
        for name, value in PARAM.findall(line):
            out[PRINTED_NAMES.get(name, name)] = float(value)
    return out


def _previous_seed(body: str) -> int | None:
    """The seed of the slot's previous request, from the JSON a launch logs; None if it has none."""
    try:
        slot = json.loads(body)
    except ValueError:
        log.warning("llama-server's log: a '%s' line is not JSON; its seed reads as the default", LAUNCHED)
        return None
    params = slot.get("params") if isinstance(slot, dict) else None
    seed = params.get("seed") if isinstance(params, dict) else None
    return seed if isinstance(seed, int) else None


def flow_samplers(command: list[str], seq_of_flow: Mapping[int, int], server_log: str | None) -> tuple[Sampler, ...]:
    """One sampler per flow. A program's come from its flags; a server's from the request it
    launched on the flow's slot (llama-server's slot id is its sequence id), the k-th flow of a
    sequence from the k-th request on that slot, or from the server's flags (its defaults) where
    its log does not say (`server_log` None: a program, not a server)."""
    if server_log is None and Path(command[0]).name not in FLAG_SAMPLING_PROGRAMS:
        return ()
    defaults = sampler_from_command(command)
    launched = launched_requests(server_log) if server_log is not None else {}
    seen: dict[int, int] = {}
    out = []
    for flow in sorted(seq_of_flow):
        seq = seq_of_flow[flow]
        k = seen[seq] = seen.get(seq, -1) + 1
        requests = launched.get(seq, [])
        if k < len(requests):
            out.append(sampler_from_request(requests[k], flow, defaults))
        else:
            out.append(sampler_from_command(command, flow))
    return tuple(out)
