"""llama-server under capture, in one of two ways. Given requests, it is started with the
preload on a free loopback port, asked one greedy /completion per request, and always stopped.
Given none, it is started as the user wrote it (their --host/--port) and records the user's own
traffic until featdiff is stopped or `--requests N` requests have completed.

Consumes the user's llama-server command and the requests; produces a `ServerResult` per request
(generated tokens and the server's own draft statistics), or a `Traffic` of the user's requests.
"""

from __future__ import annotations

import http.client
import json
import logging
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from featdiff.core.errors import InputError
from featdiff.core.tokens import parse_tokens
from featdiff.llama.tools import SERVER_PROGRAMS
from featdiff.programs.preload import Preload

HOST = "127.0.0.1"  # loopback only
OWNED_FLAGS = ("--host", "--port")  # featdiff chooses these; the user's (and their values) are dropped
N_PREDICT = 16
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 15.0
POLL_S = 0.1
# A failed program's log line worth quoting: its error or failed assertion (llama.cpp's LOG_ERR,
# GGML_ASSERT's "... failed"); gdb's backtrace frames ("#3 0x... in main") never are.
CLUE_WORDS = ("error", "failed", "GGML_ASSERT", "terminate called")
CLUE_MAX_CHARS = 200

# The user's own traffic: where llama-server listens when the command does not say (common/common.h
# `hostnames`, `port`; common/arg.cpp reads the flags, else their LLAMA_ARG_* variables).
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
HOST_FLAGS, HOST_ENV = ("--host",), "LLAMA_ARG_HOST"
PORT_FLAGS, PORT_ENV = ("--port",), "LLAMA_ARG_PORT"
API_PREFIX_FLAGS, API_PREFIX_ENV = ("--api-prefix",), "LLAMA_ARG_API_PREFIX"  # every route, /health too, under it
SSL_FLAGS = (("--ssl-key-file",), "LLAMA_ARG_SSL_KEY_FILE"), (("--ssl-cert-file",), "LLAMA_ARG_SSL_CERT_FILE")
SOCKET_SUFFIX = ".sock"  # a --host ending so is a UNIX socket (tools/server/server-http.cpp)
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1"}  # a wildcard bind: reached on this machine's loopback
# A slot's release() logs this at INFO, after its final response is queued (tools/server/server-context.cpp):
# one line per request the server finished (or cancelled).
RELEASED = b"stop processing: n_tokens"
# Flags that keep RELEASED out of the server's stdout/stderr (common/arg.cpp, common/log.h)
LOG_QUIET_FLAGS, LOG_FILE_ENV = ("--log-disable", "--log-file"), "LLAMA_ARG_LOG_FILE"
VERBOSITY_FLAGS, VERBOSITY_ENV = ("-lv", "--verbosity", "--log-verbosity"), "LLAMA_ARG_LOG_VERBOSITY"
INFO_VERBOSITY = 3  # common/log.h LOG_LEVEL_INFO: a lower threshold drops RELEASED
# RELEASED follows send_final_response(): the HTTP thread writes that answer to the client after it;
# stopping the server at once could cut it off
RESPONSE_GRACE_S = 1.0

log = logging.getLogger(__name__)
EndedBy = Literal["requests", "SIGINT", "SIGTERM", "exit"]


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


@dataclass(frozen=True)
class Address:
    """Where a llama-server answers: what featdiff polls (/health), and all it connects to."""

    host: str
    port: int
    api_prefix: str = ""
    scheme: str = "http"

    def url(self, path: str = "") -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        return f"{self.scheme}://{host}:{self.port}{self.api_prefix}{path}"


@dataclass(frozen=True)
class Traffic:
    """What a capture of the user's own requests saw."""

    url: str  # where the server listened
    n_requests: int  # slot releases the server logged (RELEASED): requests it finished
    ended_by: EndedBy  # `--requests N` reached, featdiff stopped by a signal, or the server ended itself
    exit_code: int = 0  # the server's, when it ended itself

    def to_json(self) -> dict[str, Any]:
        return dict(sorted(asdict(self).items()))


def is_server(command: list[str]) -> bool:
    return bool(command) and Path(command[0]).name in SERVER_PROGRAMS


def check_traffic(command: list[str], n_requests: int | None, sends_own: bool, environ: Mapping[str, str]) -> None:
    """Refuse, before anything starts, a capture of the user's traffic that cannot work: a server
    featdiff cannot reach (`user_address`), or `--requests N` where it counts nothing (another
    program than llama-server, a capture that sends its own request, a log that hides RELEASED)."""
    if is_server(command) and not sends_own:
        user_address(command, environ)
    if n_requests is None:
        return
    if not is_server(command):
        raise InputError(f"--requests {n_requests} counts llama-server's requests; {command[0]} is not llama-server")
    if sends_own:
        raise InputError(
            f"--requests {n_requests} counts the requests your own client sends; with --prompt / --tokens "
            "featdiff sends one itself: give one or the other"
        )
    quiet = [f for f in LOG_QUIET_FLAGS if any(a == f or a.startswith(f + "=") for a in command[1:])]
    quiet += [LOG_FILE_ENV] if environ.get(LOG_FILE_ENV) else []
    verbosity = option_value(command, VERBOSITY_FLAGS, VERBOSITY_ENV, environ)
    if verbosity is not None and verbosity.strip().lstrip("-").isdigit() and int(verbosity) < INFO_VERBOSITY:
        quiet.append(f"--log-verbosity {verbosity}")
    if quiet:
        raise InputError(
            f"{command[0]}: --requests {n_requests} counts the server's '{RELEASED.decode()}' log lines, "
            f"which {', '.join(quiet)} keeps out of its output; drop it, or stop the capture with Ctrl-C"
        )


def user_address(command: list[str], environ: Mapping[str, str]) -> Address:
    """Where the user's llama-server command listens (its first TCP address), as llama-server reads it."""
    hosts = option_value(command, HOST_FLAGS, HOST_ENV, environ) or DEFAULT_HOST
    host = next((h.strip() for h in hosts.split(",") if h.strip()), DEFAULT_HOST)
    port = option_value(command, PORT_FLAGS, PORT_ENV, environ) or str(DEFAULT_PORT)
    if host.endswith(SOCKET_SUFFIX):
        raise InputError(
            f"--host {host}: featdiff waits for the server's /health over TCP, not a UNIX socket; "
            "give the server a --host address and --port for the capture"
        )
    if not port.strip().isdigit() or int(port) == 0:
        raise InputError(f"--port {port}: featdiff needs the port your client will use; give --port N (N > 0)")
    is_ssl = all(option_value(command, flags, env, environ) for flags, env in SSL_FLAGS)
    prefix = option_value(command, API_PREFIX_FLAGS, API_PREFIX_ENV, environ) or ""
    return Address(WILDCARDS.get(host, host), int(port), prefix, "https" if is_ssl else "http")


def option_value(command: list[str], flags: tuple[str, ...], env: str, environ: Mapping[str, str]) -> str | None:
    """The value llama-server takes for an option: its last `--flag V` / `--flag=V`, else `env`'s."""
    found = None
    for i, arg in enumerate(command[1:], 1):
        name, eq, value = arg.partition("=")
        if name in flags:
            found = value if eq else (command[i + 1] if i + 1 < len(command) else None)
    return found if found is not None else environ.get(env)


def request_from(prompt: str | None, tokens: str | None, n_predict: int = N_PREDICT) -> CompletionRequest:
    """The request for `--prompt TEXT` or `--tokens 1,2,3` (exactly one)."""
    if (prompt is None) == (tokens is None):
        raise InputError(
            "capture --exec of llama-server sends one completion for --prompt TEXT or --tokens 1,2,3: give one, "
            "not both (or neither, to capture the requests your own client sends)"
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
    command: list[str], pre: Preload, requests: list[CompletionRequest], prefix: Path, log_path: Path | None = None
) -> tuple[ServerResult, ...]:
    """Start the server with the preload, send `requests` in order, stop it; return the answers.
    Its output goes to `log_path` (default: the spool's `<prefix>.server.log`)."""
    port = free_port()
    log_path = log_path or Path(f"{prefix}.server.log")
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            server_command(command, port),
            env=pre.environ(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_ready(proc, Address(HOST, port), log_path)
            return tuple(_complete(port, r, log_path) for r in requests)
        finally:
            stop_process(proc)


def serve_one(
    command: list[str], pre: Preload, request: CompletionRequest, prefix: Path, log_path: Path | None = None
) -> ServerResult:
    return serve(command, pre, [request], prefix, log_path)[0]


def record_traffic(
    command: list[str], pre: Preload, prefix: Path, n_requests: int | None, log_path: Path | None = None
) -> Traffic:
    """Start the user's llama-server as they wrote it, with the preload, and let it serve their
    client until `n_requests` requests have completed (None: no limit), featdiff is stopped
    (SIGINT / SIGTERM after the server was ready: the normal end, not an interruption), or the
    server ends itself; stop it and say what it served."""
    address = user_address(command, pre.environ())
    log_path = log_path or Path(f"{prefix}.server.log")
    with open(log_path, "wb") as out:
        # its own session: a terminal's Ctrl-C reaches featdiff alone, which stops the server with
        # one SIGTERM (a second signal makes llama-server exit at once, tools/server/server.cpp);
        # it still dies with featdiff (the preload's parent-death signal)
        proc = subprocess.Popen(
            command,
            env=pre.environ(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        is_ready = False
        try:
            _wait_ready(proc, address, log_path)
            is_ready = True
            until = f"Ctrl-C or {n_requests} requests" if n_requests else "Ctrl-C"
            log.info("capturing llama-server at %s until %s; send your requests now", address.url(), until)
            ended_by = _await_requests(proc, log_path, n_requests)
        except KeyboardInterrupt as stop:
            if not is_ready:
                raise  # stopped before it served anything: an interruption like any other
            ended_by = "SIGTERM" if getattr(stop, "signum", signal.SIGINT) == signal.SIGTERM else "SIGINT"
        finally:
            stop_process(proc)
    rc = proc.returncode if ended_by == "exit" else 0
    return Traffic(address.url(), _count_released(log_path.read_bytes()), ended_by, rc)


def _await_requests(proc: subprocess.Popen, log_path: Path, n_requests: int | None) -> EndedBy:
    """Follow the server's log until it has released `n_requests` slots (None: never) or it ends."""
    offset, tail, seen = 0, b"", 0
    while proc.poll() is None:
        with open(log_path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
        offset += len(chunk)
        *lines, tail = (tail + chunk).split(b"\n")  # only complete lines count
        seen += _count_released(b"\n".join(lines))
        if n_requests is not None and seen >= n_requests:
            time.sleep(RESPONSE_GRACE_S)
            return "requests"
        time.sleep(POLL_S)
    return "exit"


def _count_released(text: bytes) -> int:
    return sum(RELEASED in line for line in text.splitlines())


def _opener(scheme: str = "http") -> urllib.request.OpenerDirector:
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]  # never a proxy
    if scheme == "https":  # the user's own server on the address they gave, its certificate often self-signed
        handlers.append(urllib.request.HTTPSHandler(context=ssl._create_unverified_context()))
    return urllib.request.build_opener(*handlers)


def _is_ready(address: Address) -> bool:
    """Whether /health answers 200 (503 while the model loads; nothing before the server listens)."""
    try:
        with _opener(address.scheme).open(address.url("/health"), timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _wait_ready(proc: subprocess.Popen, address: Address, log_path: Path) -> None:
    """Poll /health until the model is loaded."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise InputError(failure_line("llama-server", proc.returncode, log_path, " before it was ready"))
        if _is_ready(address):
            return
        time.sleep(POLL_S)
    raise InputError(f"llama-server: not ready after {START_TIMEOUT_S:.0f} s; its output is in {log_path}")


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
    except (ConnectionError, http.client.HTTPException, urllib.error.URLError) as e:  # it died answering
        raise RequestFailed(
            f"llama-server: closed the connection without answering /completion ({e}): it died decoding the "
            f"request; its output is in {log_path}{_quoted(log_clue(log_path))}"
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


def ended(rc: int) -> str:
    """How a program ended, from its exit status (subprocess's: -N for signal N), in words."""
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


def failure_line(program: str, rc: int, log_path: Path, when: str = "") -> str:
    """One line for a program that failed: its name, how it ended, the file holding its whole
    output and the error it last logged (never its backtrace): "llama-server: was killed by
    SIGABRT before it was ready; its output is in run.npz.log (it says: ...)"."""
    return f"{program}: {ended(rc)}{when}; its output is in {log_path}{_quoted(log_clue(log_path))}"


def log_clue(log_path: Path) -> str | None:
    """The last line of a program's log that states an error (CLUE_WORDS), outside gdb's
    backtrace frames, cut to CLUE_MAX_CHARS; None when it states none."""
    lines = log_path.read_text(errors="replace").splitlines() if log_path.is_file() else []
    said = [
        line.strip()
        for line in lines
        if not line.lstrip().startswith("#") and any(w.lower() in line.lower() for w in CLUE_WORDS)
    ]
    if not said:
        return None
    clue = said[-1]
    return clue if len(clue) <= CLUE_MAX_CHARS else clue[: CLUE_MAX_CHARS - 3] + "..."


def _quoted(clue: str | None) -> str:
    return f" (it says: {clue})" if clue else ""
