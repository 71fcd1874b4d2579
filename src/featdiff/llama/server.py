"""llama-server under capture: started with the preload on a free loopback port, asked one
greedy /completion per request, and always stopped.

Consumes the user's llama-server command (its --host/--port replaced) and the requests;
produces a `ServerResult` per request: generated tokens and the server's own draft statistics.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from featdiff.errors import InputError
from featdiff.llama.preload import Preload
from featdiff.tokens import parse_tokens

SERVER_PROGRAMS = ("llama-server",)
HOST = "127.0.0.1"  # loopback only
OWNED_FLAGS = ("--host", "--port")  # featdiff chooses these; the user's (and their values) are dropped
N_PREDICT = 16
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 15.0
POLL_S = 0.1
LOG_TAIL_LINES = 5


@dataclass(frozen=True)
class CompletionRequest:
    """One greedy /completion request: text (tokenized by the server) or token ids."""

    prompt: str | tuple[int, ...]
    n_predict: int = N_PREDICT

    def body(self) -> dict[str, Any]:
        prompt = self.prompt if isinstance(self.prompt, str) else list(self.prompt)
        # temperature 0: llama.cpp samples greedily; no prompt cache, so each request starts at position 0
        return {
            "prompt": prompt,
            "n_predict": self.n_predict,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
        }


@dataclass(frozen=True)
class ServerResult:
    """What the server answered to one request."""

    tokens: tuple[int, ...]  # the generated token ids
    draft_n: int  # tokens drafted, as the server counts them
    draft_n_accepted: int  # drafted tokens the target accepted
    predicted_n: int

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokens"] = list(self.tokens)
        return dict(sorted(d.items()))


class RequestFailed(InputError):
    """llama-server answered the completion with an error: the run failed inside the server
    (a decode it refused), after it had decoded what the spool holds."""


def is_server(command: list[str]) -> bool:
    return bool(command) and Path(command[0]).name in SERVER_PROGRAMS


def request_from(prompt: str | None, tokens: str | None, n_predict: int = N_PREDICT) -> CompletionRequest:
    """The request for `--prompt TEXT` or `--tokens 1,2,3` (exactly one)."""
    if (prompt is None) == (tokens is None):
        raise InputError(
            "capture --exec of llama-server sends one completion: give exactly one of --prompt TEXT or --tokens 1,2,3"
        )
    return CompletionRequest(prompt if prompt is not None else tuple(parse_tokens(tokens or "")), n_predict)


def server_command(command: list[str], port: int) -> list[str]:
    """`command` with featdiff's loopback host and port instead of the user's."""
    out, skip = [], False
    for arg in command:
        if skip:
            skip = False
        elif arg in OWNED_FLAGS:
            skip = True
        elif not any(arg.startswith(f + "=") for f in OWNED_FLAGS):
            out.append(arg)
    return out + ["--host", HOST, "--port", str(port)]


def free_port() -> int:
    """A loopback port nobody listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def serve(
    command: list[str], pre: Preload, requests: list[CompletionRequest], prefix: Path
) -> tuple[ServerResult, ...]:
    """Start the server with the preload, send `requests` in order, stop it; return the answers."""
    port = free_port()
    log_path = Path(f"{prefix}.server.log")
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            server_command(command, port),
            env=pre.environ(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_ready(proc, port, log_path)
            return tuple(_complete(port, r, log_path) for r in requests)
        finally:
            stop_process(proc)


def serve_one(command: list[str], pre: Preload, request: CompletionRequest, prefix: Path) -> ServerResult:
    return serve(command, pre, [request], prefix)[0]


def _opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy


def _wait_ready(proc: subprocess.Popen, port: int, log_path: Path) -> None:
    """Poll /health until the model is loaded (200; 503 while loading)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise InputError(
                f"{log_path}: llama-server exited with code {proc.returncode} before it was ready: {_tail(log_path)}"
            )
        try:
            with _opener().open(f"http://{HOST}:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(POLL_S)
    raise InputError(f"{log_path}: llama-server not ready after {START_TIMEOUT_S:.0f} s: {_tail(log_path)}")


def _complete(port: int, request: CompletionRequest, log_path: Path) -> ServerResult:
    data = json.dumps(request.body()).encode()
    req = urllib.request.Request(
        f"http://{HOST}:{port}/completion", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with _opener().open(req, timeout=REQUEST_TIMEOUT_S) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RequestFailed(
            f"{log_path}: llama-server answered {e.code} to /completion ({e.read()[:200]!r}); check the request and the server flags"
        ) from None
    timings = answer.get("timings", {})
    return ServerResult(
        tokens=tuple(int(t) for t in answer.get("tokens", ())),
        draft_n=int(timings.get("draft_n", 0)),
        draft_n_accepted=int(timings.get("draft_n_accepted", 0)),
        predicted_n=int(timings.get("predicted_n", 0)),
    )


def stop_process(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM (llama-server shuts down cleanly), then SIGKILL if it lingers past `timeout_s`,
    or if featdiff is interrupted again while it waits."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _tail(log_path: Path) -> str:
    lines = log_path.read_text(errors="replace").strip().splitlines() if log_path.is_file() else []
    return " | ".join(lines[-LOG_TAIL_LINES:]) or "no output"
