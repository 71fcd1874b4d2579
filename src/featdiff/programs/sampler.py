"""How each flow of a program featdiff ran chose its tokens (the manifest's `samplers`): a
program's sampling flags, or, for llama-server, its account of each request it launched (its
debug log's "launching slot" line: the request's fields over the server's defaults).

Consumes the program's command line, the flows (flow, sequence) and the program's log; produces
one `Sampler` per flow (docs/dump.md "samplers").
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from featdiff.dump.sampling import Sampler, sampler_from_command, sampler_from_request

log = logging.getLogger(__name__)

# tools/server/server-context.cpp launch_slot_with_task logs, at debug verbosity, the slot's JSON
# with the request's sampling `params` (server-task.cpp task_params::to_json); the line opens with
# SLT_DBG's "slot <func>: id <slot> | task <task> | " (server-common.h)
LAUNCHED = "launching slot : "
# Programs that build their target's sampler from common's flags (common_sampler_init); another
# program (llama-simple: its own greedy chain) is taken to choose greedily, and gets no record
FLAG_SAMPLING_PROGRAMS = ("llama-speculative-simple", "llama-speculative", "llama-cli", "llama-completion")
# common/log.h LOG_LEVEL_DEBUG: the verbosity at which llama-server writes LAUNCHED
DEBUG_VERBOSITY = 5


def launched_requests(text: str) -> dict[int, list[dict]]:
    """Slot id -> the sampling `params` of each request launched on it, in log order."""
    out: dict[int, list[dict]] = {}
    for line in text.splitlines():
        head, found, body = line.partition(LAUNCHED)
        if not found:
            continue
        try:
            slot = json.loads(body)
        except ValueError:
            log.warning("llama-server's log: a '%s' line is not JSON; its request reads as the defaults", LAUNCHED)
            continue
        if isinstance(slot, dict) and isinstance(slot.get("id"), int) and isinstance(slot.get("params"), dict):
            out.setdefault(slot["id"], []).append(slot["params"])
    return out


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
