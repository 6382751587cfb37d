"""E2B's code-interpreter protocol inside a sandbox, on port 49999, backed by
Jupyter kernels (Debian's python3-ipykernel and python3-jupyter-client).

    GET    /health                      -> "OK"
    POST   /execute                     {code, context_id?, language?, env_vars?} -> lines of JSON, streamed
    POST   /contexts                    {language?, cwd?} -> {id, language, cwd}
    GET    /contexts                    -> [{id, language, cwd}, ...]
    POST   /contexts/{id}/restart       -> null (the kernel starts afresh: its state is gone)
    DELETE /contexts/{id}               -> null

/execute answers one JSON object per line as the kernel sends them:
`stdout`/`stderr` {text, timestamp}, `result` {text, html, markdown, svg,
png, jpeg, pdf, latex, json, javascript, data, chart, extra,
is_main_result}, `error` {name, value, traceback},
`number_of_executions` {execution_count}, `keepalive` every few seconds
while the kernel is quiet (so proxies and the client see a live stream, and
a client that went away is noticed: its execution is interrupted), and
`end_of_execution` last. These are E2B's names (its server in
e2b-dev/code-interpreter, template/server), which both of E2B's SDKs parse.

Why stdlib + jupyter_client and not E2B's server (FastAPI + Jupyter Server
+ websockets): everything here comes from Debian's packages, so a template
is built without any network but Debian's mirror, and one process holds
the kernels directly over ZeroMQ. The kernels are processes of the guest,
so a pause, a restore or a fork keeps them and their variables as they
were: a fork's kernels are copies that diverge from there.

Contexts are kernels; the default (Python) one is started before the server
listens, warmed up by a first execution, and only then is `--ready-file`
written: a template build snapshots the sandbox after that, and sandboxes
restore it serving. One execution runs at a time per context (a notebook's
order); others wait their turn.

Limits, since every byte a client sends is hostile: request bodies up to
MAX_BODY, MAX_CONTEXTS kernels, MAX_CONNECTIONS concurrent connections
(more are answered 503), an idle connection is closed after IDLE_TIMEOUT,
and an execution runs at most --max-execution seconds (then it is
interrupted and ends with a TimeoutError).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from jupyter_client.manager import KernelManager

PORT = 49999
MAX_BODY = 8 << 20  # bytes of a request body (the code of a cell, mostly)
MAX_CONTEXTS = 8  # kernels (each is ~40 MiB of the guest's memory)
MAX_CONNECTIONS = 64
IDLE_TIMEOUT = 60.0  # seconds a connection may send nothing (or take nothing we send)
KEEPALIVE = 5.0  # seconds between keepalive lines of a quiet execution
TICK = 1.0  # seconds between checks that a running execution's kernel is still its own
KERNEL_START_TIMEOUT = 120.0
SETTLE = 10.0  # seconds an interrupted execution gets to wind down before the next one is sent
DEFAULT_CWD = "/home/user"  # E2B's
LANGUAGES = {"python": "python3"}  # language -> kernel name (what Debian packages)
MIME = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
        "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
        "application/json": "json", "application/javascript": "javascript", "e2b/data": "data",
        "e2b/chart": "chart"}

log = logging.getLogger("codeinterp")
Emit = Callable[[dict[str, Any]], None]


class ClientGone(Exception):
    """The client of an execution hung up or stopped reading."""


class Refused(Exception):
    """An answer other than success: an HTTP status and a plain-text message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Context:
    """One kernel, and the lock that lets one execution at a time use it."""

    def __init__(self, language: str, cwd: str) -> None:
        self.id = str(uuid.uuid4())
        self.language, self.cwd = language, cwd
        self.lock = threading.Lock()  # held by an execution, or by whoever replaces the kernel's client
        self.generation = 0  # bumped by restart and removal: a running execution then lets go
        self.manager = KernelManager(kernel_name=LANGUAGES[language])
        self.client: Any = None
        self._start()

    def as_json(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def _start(self) -> None:
        if not self.manager.has_kernel:
            self.manager.start_kernel(cwd=self.cwd)
        self.client = self.manager.client()
        self.client.start_channels(hb=False)  # no heartbeat thread: a paused VM would look like a dead kernel
        self.client.wait_for_ready(timeout=KERNEL_START_TIMEOUT)

    def restart(self) -> None:
        """A fresh kernel in place (same id); an execution running now ends with an error."""
        self.generation += 1
        self.manager.restart_kernel(now=True)
        with self.lock:
            self.client.stop_channels()
            self._start()

    def shutdown(self) -> None:
        self.generation += 1
        self.manager.shutdown_kernel(now=True)
        with self.lock:
            self.client.stop_channels()

    def execute(self, code: str, env: dict[str, str], emit: Emit, *, deadline: float,
                gone: Callable[[], bool] = lambda: False) -> None:
        """Run `code`, emitting what the kernel sends until it is idle again.
        ClientGone (its code interrupted) once `emit` fails or `gone()` says so."""
        self._wait_turn(emit, deadline)
        try:
            if not self.manager.is_alive():  # the code before this one killed it (os._exit, a segfault)
                self.client.stop_channels()
                self.manager.restart_kernel(now=True)
                self._start()
            generation = self.generation
            if env:
                self.client.execute(_set_env(env), silent=True, store_history=False)
            msg_id = self.client.execute(code, store_history=True, allow_stdin=False, stop_on_error=True)
            try:
                self._relay(msg_id, emit, generation, deadline, gone)
            except (OSError, ValueError, ClientGone):  # its client went away: stop its code before the next runs
                self._stop(msg_id)
                raise ClientGone() from None
            finally:
                if env:
                    self.client.execute(_restore_env(), silent=True, store_history=False)
                _drain(self.client)
        finally:
            self.lock.release()

    def _wait_turn(self, emit: Emit, deadline: float) -> None:
        """Take the context's lock, keeping the client's stream alive while another execution has it."""
        while not self.lock.acquire(timeout=KEEPALIVE):
            try:
                emit({"type": "keepalive"})
            except (OSError, ValueError):
                raise ClientGone() from None
            if time.monotonic() > deadline:
                raise Refused(504, "the execution waited past its deadline for its turn")

    def _relay(self, msg_id: str, emit: Emit, generation: int, deadline: float, gone: Callable[[], bool]) -> None:
        quiet_since, started = time.monotonic(), False
        while True:
            now = time.monotonic()
            if self.generation != generation:
                emit({"type": "error", "name": "ContextRestarting", "value": "Context was restarted", "traceback": ""})
                return
            if now > deadline:
                self._stop(msg_id)
                emit(_timeout_line())
                return
            try:
                msg = self.client.get_iopub_msg(timeout=TICK)
            except queue.Empty:
                if gone():
                    raise ClientGone()
                if not self.manager.is_alive():
                    emit({"type": "error", "name": "KernelDied", "value": "the kernel died; it restarts on the "
                          "next execution, without its state", "traceback": ""})
                    return
                if now - quiet_since >= KEEPALIVE:
                    emit({"type": "keepalive"})  # raises if the client went away: then the run is interrupted
                    quiet_since = now
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                if not started:  # the kernel dropped it unrun (it was still aborting after an error)
                    emit({"type": "error", "name": "ExecutionAborted", "value": "Execution was aborted",
                          "traceback": ""})
                return
            started = started or msg["msg_type"] == "execute_input"
            line = to_line(msg)
            if line is not None:
                emit(line)
                quiet_since = time.monotonic()

    def _stop(self, msg_id: str) -> None:
        """Interrupt the execution `msg_id` and wait (a few seconds at most) for
        the kernel to be done with it, so the next execution is not aborted."""
        try:
            self.manager.interrupt_kernel()
        except (RuntimeError, OSError) as exc:
            log.warning("interrupting context %s: %s", self.id, exc)
        deadline = time.monotonic() + SETTLE
        while time.monotonic() < deadline:
            try:
                msg = self.client.get_iopub_msg(timeout=TICK)
            except queue.Empty:
                continue
            if msg.get("parent_header", {}).get("msg_id") == msg_id and msg["msg_type"] == "status" \
                    and msg["content"].get("execution_state") == "idle":
                return


def _timeout_line() -> dict[str, Any]:
    return {"type": "error", "name": "TimeoutError", "value": "the execution ran past the server's limit and was "
            "interrupted", "traceback": ""}


def _set_env(env: dict[str, str]) -> str:
    """Code setting `env` for one execution, remembering what it replaced (repr: any value is a literal)."""
    return ("import os as __strata_os\n"
            f"__strata_env = {{k: __strata_os.environ.get(k) for k in {sorted(env)!r}}}\n"
            f"__strata_os.environ.update({env!r})\n")


def _restore_env() -> str:
    return ("for __k, __v in __strata_env.items():\n"
            "    __strata_os.environ.pop(__k, None) if __v is None else __strata_os.environ.__setitem__(__k, __v)\n"
            "del __strata_env, __k, __v\n")


def _drain(client: Any) -> None:
    """Drop the shell channel's replies (the iopub channel carries what we send on)."""
    try:
        while True:
            client.get_shell_msg(timeout=0)
    except queue.Empty:
        return


def to_line(msg: dict[str, Any]) -> dict[str, Any] | None:
    """The line of E2B's protocol for one kernel message (None: nothing to say)."""
    kind, content = msg["msg_type"], msg["content"]
    if kind == "stream":
        return {"type": "stderr" if content.get("name") == "stderr" else "stdout", "text": content.get("text", ""),
                "timestamp": _iso(msg.get("header", {}).get("date"))}
    if kind in ("execute_result", "display_data"):
        return result_line(content.get("data") or {}, main=kind == "execute_result")
    if kind == "error":
        return {"type": "error", "name": content.get("ename", ""), "value": content.get("evalue", ""),
                "traceback": "\n".join(content.get("traceback") or [])}
    if kind == "execute_input":
        return {"type": "number_of_executions", "execution_count": content.get("execution_count")}
    return None


def result_line(data: dict[str, Any], *, main: bool) -> dict[str, Any]:
    """A `result` line: the MIME bundle by E2B's names, the rest under `extra`."""
    line: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra = {}
    for mime, value in data.items():
        if mime in MIME:
            line[MIME[mime]] = value
        else:
            extra[mime] = value
    text = line.get("text")
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        line["text"] = text[1:-1]  # as E2B's server does: a string's repr shows as the string
    if extra:
        line["extra"] = extra
    return line


def _iso(date: Any) -> str:
    return date.isoformat() if isinstance(date, datetime) else str(date or datetime.now().astimezone().isoformat())


class Contexts:
    """The server's kernels by id; `default` is the Python one made at start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all: dict[str, Context] = {}
        self._starting = 0
        self.default = self.create("python", DEFAULT_CWD)

    def create(self, language: str, cwd: str) -> Context:
        if language not in LANGUAGES:
            raise Refused(400, f"language {language!r} is not installed in this sandbox (installed: "
                               f"{', '.join(LANGUAGES)})")
        if not os.path.isdir(cwd):
            raise Refused(400, f"cwd {cwd!r} is not a directory in the sandbox")
        with self._lock:
            if len(self._all) + self._starting >= MAX_CONTEXTS:
                raise Refused(429, f"at most {MAX_CONTEXTS} contexts: remove one first")
            self._starting += 1  # holds its place while its kernel starts (seconds)
        try:
            context = Context(language, cwd)
        finally:
            with self._lock:
                self._starting -= 1
        with self._lock:
            self._all[context.id] = context
        return context

    def get(self, context_id: str) -> Context:
        with self._lock:
            context = self._all.get(context_id)
        if context is None:
            raise Refused(404, f"Context {context_id} not found")
        return context

    def list(self) -> list[Context]:
        with self._lock:
            return list(self._all.values())

    def remove(self, context_id: str) -> None:
        context = self.get(context_id)
        if context is self.default:
            raise Refused(409, "the default context cannot be removed (restart it instead)")
        with self._lock:
            self._all.pop(context_id, None)
        context.shutdown()

    def for_execution(self, context_id: Any, language: Any) -> Context:
        if context_id and language:
            raise Refused(400, "Only one of context_id or language can be provided")
        if context_id:
            return self.get(str(context_id))
        if language and str(language).strip().lower() not in LANGUAGES:
            raise Refused(400, f"language {language!r} is not installed in this sandbox")
        return self.default


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT
    disable_nagle_algorithm = True  # each line goes out as it is written
    server: "Server"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        return  # one line per request would fill the guest's disk; errors are logged where they happen

    def do_GET(self) -> None:
        self._answer(lambda: self._route("GET"))

    def do_POST(self) -> None:
        self._answer(lambda: self._route("POST"))

    def do_DELETE(self) -> None:
        self._answer(lambda: self._route("DELETE"))

    def _route(self, method: str) -> Any:
        parts = self.path.split("?", 1)[0].strip("/").split("/")
        contexts = self.server.contexts
        if method == "GET" and parts == ["health"]:
            return "OK"
        if method == "POST" and parts == ["execute"]:
            return self._execute(self._json())
        if parts[0] == "contexts" and len(parts) == 1:
            if method == "GET":
                return [c.as_json() for c in contexts.list()]
            if method == "POST":
                body = self._json()
                language = str(body.get("language") or "python").strip().lower()
                return contexts.create(language, str(body.get("cwd") or DEFAULT_CWD)).as_json()
        if parts[0] == "contexts" and len(parts) == 3 and parts[2] == "restart" and method == "POST":
            contexts.get(parts[1]).restart()
            return None
        if parts[0] == "contexts" and len(parts) == 2 and method == "DELETE":
            contexts.remove(parts[1])
            return None
        raise Refused(404, f"no {method} {self.path[:200]}")

    def _json(self) -> dict[str, Any]:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise Refused(411, "a JSON body with Content-Length is required")
        if int(length) > MAX_BODY:
            raise Refused(413, f"body over {MAX_BODY} bytes")
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise Refused(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise Refused(400, "the body must be a JSON object")
        return body

    def _execute(self, body: dict[str, Any]) -> Iterator[dict[str, Any]] | None:
        code = body.get("code")
        if not isinstance(code, str):
            raise Refused(400, "code must be a string")
        env = body.get("env_vars") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and k and "=" not in k and "\0" not in k
                                                and isinstance(v, str) and "\0" not in v for k, v in env.items()):
            raise Refused(400, "env_vars must map names to strings")
        context = self.server.contexts.for_execution(body.get("context_id"), body.get("language"))
        self._start_stream()
        try:
            context.execute(code, env, self._emit, deadline=time.monotonic() + self.server.max_execution,
                            gone=self._hung_up)
        except ClientGone:
            self.close_connection = True
            return None
        except Refused as exc:
            self._emit({"type": "error", "name": "ServerError", "value": str(exc), "traceback": ""})
        self._emit({"type": "end_of_execution"})
        self.wfile.write(b"0\r\n\r\n")
        return None

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._streaming = True

    def _hung_up(self) -> bool:
        """Whether the client closed its end (it sends nothing while it waits for the stream)."""
        try:
            return select.select([self.connection], [], [], 0)[0] != [] and \
                self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _emit(self, line: dict[str, Any]) -> None:
        data = (json.dumps(line, default=str) + "\n").encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _answer(self, route: Callable[[], Any]) -> None:
        self._streaming = False
        try:
            result = route()
        except Refused as exc:
            if not self._streaming:
                self._reply(exc.status, str(exc).encode(), "text/plain; charset=utf-8")
            return
        except Exception as exc:  # a kernel that would not start, a failed restart: the client hears why
            log.exception("%s %s", self.command, self.path[:200])
            if not self._streaming:
                self._reply(500, f"{type(exc).__name__}: {exc}".encode(), "text/plain; charset=utf-8")
            else:
                self.close_connection = True
            return
        if not self._streaming:
            self._reply(200, json.dumps(result).encode(), "application/json")

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], contexts: Contexts, *, max_execution: float) -> None:
        super().__init__(address, Handler)
        self.contexts, self.max_execution = contexts, max_execution
        self._places = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._places.acquire(blocking=False):
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._places.release()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="E2B's code-interpreter protocol over Jupyter kernels")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--ready-file", type=Path, help="written once the server answers and its kernel is warm")
    parser.add_argument("--max-execution", type=float, default=3600.0, help="seconds an execution may run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    os.makedirs(DEFAULT_CWD, exist_ok=True)
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # ipykernel's debugger, quiet in the kernels' log
    contexts = Contexts()
    lines: list[dict[str, Any]] = []
    contexts.default.execute("1", {}, lines.append, deadline=time.monotonic() + KERNEL_START_TIMEOUT)  # warm up
    server = Server((args.host, args.port), contexts, max_execution=args.max_execution)
    if args.ready_file:
        args.ready_file.write_text(f"{os.getpid()}\n")
    log.info("serving on %s:%d (default context %s)", args.host, args.port, contexts.default.id)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
