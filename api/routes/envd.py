"""The envd data plane over HTTP: E2B's SDK sends these to `E2B_SANDBOX_URL`
(the node) with the sandbox in `E2b-Sandbox-Id` and its token in
`X-Access-Token` (or a key of the sandbox's team in `X-API-Key`).

Only transport here: Connect framing (api/connect.py), /files bodies, and
errors; what each call does is api/envd.py's. Not in the node's OpenAPI
document: the contract is envd's process.proto, filesystem.proto and
envd.yaml.
"""

from __future__ import annotations

import base64
import logging
import re
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from layerstore.config import DEFAULT_TEAM
from layerstore.errors import StrataError
from vmm.agent import AgentError, AgentTimeout, Stream

from .. import envd
from ..connect import (HTTP_STATUS, MAX_MESSAGE, STREAM_TYPE, ConnectError, end_of_stream, envelope,
                       request_message)
from ..deps import NodeDep
from ..envd import Target, entry_info, path_of
from ..errors import LIMIT_HEADER
from ..exceptions import Capacity, TooLarge
from ..formdata import FormError, FormReader, boundary_of
from ..limits import Lease, LeasedStream, Limits
from ..teams import QuotaExceeded

router = APIRouter(include_in_schema=False)
log = logging.getLogger("strata.api")
PREFIXES = ("/process.Process/", "/filesystem.Filesystem/")
ENVD_HOST = re.compile(r"^49983-([A-Za-z0-9-]{1,64})\.")
DEFAULT_KEEPALIVE = 50.0  # seconds between keepalive events on a quiet stream (the SDK asks for its own)
MAX_KEEPALIVE = 120.0  # at most: how long a stream's thread waits before it looks again
UPLOAD_BLOCK = 1 << 20  # bytes gathered from the request before each hand-off to the agent
MAX_BODY = MAX_MESSAGE + 5  # a Connect request body: one message, in an envelope if streamed
HANG_UP = {"Connection": "close"}  # on a refusal sent before the body is read: it never will be


def is_data_plane(path: str) -> bool:
    """Paths that authenticate with a sandbox's token instead of an API key."""
    return path.startswith(PREFIXES) or path == "/files"


def _user(request: Request) -> str:
    """The user of `Authorization: Basic base64(user:)` (the SDK's `user=`), or the query's `username`."""
    user = request.query_params.get("username", "")
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("basic "):
        try:  # ValueError: not ASCII (binascii.Error, a ValueError: not base64)
            user = base64.b64decode(auth[6:].strip(), validate=True).decode().split(":", 1)[0]
        except (ValueError, UnicodeDecodeError):
            raise ConnectError("invalid_argument", "malformed Authorization header") from None
    return user


def sandbox_of(request: Request) -> str:
    """The sandbox a request is for: `E2b-Sandbox-Id`, or the host name
    `49983-{id}.{domain}` E2B's SDK uses with a domain (behind a proxy)."""
    given = request.headers.get("e2b-sandbox-id", "")
    if not given:
        match = ENVD_HOST.match(request.headers.get("host", ""))
        given = match.group(1) if match else ""
    return given


async def _target(request: Request, node: Any) -> tuple[Target, str]:
    """The sandbox the request may use, and the team it belongs to (whose
    long requests this one counts among)."""
    def authorize() -> tuple[Target, str]:
        target = node.access.data_plane(sandbox_of(request), token=request.headers.get("x-access-token"),
                                 key=request.headers.get("x-api-key"), user="")
        target.user = _user(request) or target.user  # the sandbox's default user unless named; after the token
        return target, node.lifecycle.record(target.sid).team or DEFAULT_TEAM

    return await run_in_threadpool(authorize)


def _admit(request: Request, team: str, *, ending: bool = False) -> Lease:
    """A place for one long request of `team` (api/limits.py), or the
    Connect error that names the limit it is past."""
    try:
        return _limits(request).admit(team, ending=ending)
    except Capacity as exc:
        raise LimitReached(exc) from None


def _limits(request: Request) -> Limits:
    return request.app.state.limits


async def read_body(request: Request, *, limit: int) -> bytes:
    """The request's body, refused (TooLarge) as soon as it is known to be
    past `limit`: from its Content-Length before a byte is read, or while
    it streams in; never buffered past the limit."""
    declared = request.headers.get("content-length", "")
    if declared and (not declared.isdigit() or int(declared) > limit):
        raise TooLarge(f"the request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise TooLarge(f"the request body is past the limit of {limit} bytes")
    return bytes(body)


# --- Connect services -----------------------------------------------------------------


@dataclass(frozen=True)
class Rpc:
    """One Connect method. Most wait on the guest, so they are long requests
    (api/limits.py); `ending` ones end long work and may go a little past
    the limits, so a team at its limit can still wind down; `short` ones do
    not wait on the guest and take no place."""
    fn: Callable[..., Any]  # (node, target, message, headers) -> a response message, or an iterator of them
    streaming: bool = False
    keeps: bool = False  # what the call makes (a polling watcher) keeps its lease: fn gets it as `lease=`
    kind: str = "long"  # or "ending", "short"


class LimitReached(ConnectError):
    """A long request past its team's or the node's limit; X-Strata-Limit says whose."""

    def __init__(self, exc: Capacity) -> None:
        super().__init__("resource_exhausted", str(exc))
        self.headers = {LIMIT_HEADER: "team" if isinstance(exc, QuotaExceeded) else "node"}


def _keepalive(headers: Any) -> float:
    """The client's keepalive interval, within 1..MAX_KEEPALIVE seconds."""
    try:
        asked = float(headers.get("keepalive-ping-interval", DEFAULT_KEEPALIVE))
    except ValueError:
        return DEFAULT_KEEPALIVE
    return DEFAULT_KEEPALIVE if asked != asked else min(MAX_KEEPALIVE, max(1.0, asked))  # NaN: the default


def _deadline(headers: Any) -> float | None:
    try:
        ms = int(headers.get("connect-timeout-ms", "0"))
    except ValueError:
        return None
    return time.monotonic() + ms / 1000 if ms > 0 else None


def _start(node: Any, t: Target, m: dict[str, Any], headers: Any) -> Iterator[dict[str, Any]]:
    pid, stream = envd.start_process(t, envd.StartRequest.parse(m))
    return envd.follow(t, pid, stream, keepalive=_keepalive(headers), deadline=_deadline(headers))


def _connect(node: Any, t: Target, m: dict[str, Any], headers: Any) -> Iterator[dict[str, Any]]:
    pid = t.pid_of(m)
    stream = t.call(lambda a: a.attach(pid))
    return envd.follow(t, pid, stream, keepalive=_keepalive(headers), deadline=_deadline(headers))


def _input(node: Any, t: Target, m: dict[str, Any], headers: Any) -> dict[str, Any]:
    pid, given = t.pid_of(m), m.get("input")
    if not isinstance(given, dict) or not ({"stdin", "pty"} & given.keys()):
        raise ConnectError("invalid_argument", "input.stdin or input.pty is required")
    data = envd._bytes(given.get("stdin", given.get("pty")), "input")
    t.call(lambda a: a.send_input(pid, data))
    return {}


def _signal(node: Any, t: Target, m: dict[str, Any], headers: Any) -> dict[str, Any]:
    given = m.get("signal")
    pid, sig = t.pid_of(m), envd.SIGNALS.get(given) if isinstance(given, (str, int)) else None
    if sig is None:
        raise ConnectError("invalid_argument", f"signal {m.get('signal')!r} is not SIGNAL_SIGTERM or SIGNAL_SIGKILL")
    t.call(lambda a: a.signal(pid, sig))
    return {}


def _update(node: Any, t: Target, m: dict[str, Any], headers: Any) -> dict[str, Any]:
    pid, size = t.pid_of(m), envd.pty_size(m)
    if size is None:
        raise ConnectError("invalid_argument", "pty.size is required")
    t.call(lambda a: a.resize(pid, *size))
    return {}


def _watch(node: Any, t: Target, m: dict[str, Any], headers: Any) -> Iterator[dict[str, Any]]:
    path = path_of(m)
    stream = t.call(lambda a: a.watch(path, recursive=bool(m.get("recursive"))))
    return _watch_events(t.reads(stream), _keepalive(headers))


def _watch_events(stream: Stream, keepalive: float) -> Iterator[dict[str, Any]]:
    try:
        yield {"start": {}}
        while True:
            try:
                reply = stream.next(keepalive)
            except AgentTimeout:
                yield {"keepalive": {}}
                continue
            except AgentError as exc:
                raise envd.connect_error(exc) from None
            if isinstance(reply.get("event"), dict):
                yield {"filesystem": envd.watch_event(reply["event"])}
    finally:
        stream.cancel()


PROCESS = {
    "Start": Rpc(_start, streaming=True),
    "Connect": Rpc(_connect, streaming=True),
    "List": Rpc(lambda n, t, m, h: {"processes": [envd.process_info(p) for p in t.call(lambda a: a.processes())]}),
    "SendInput": Rpc(_input),
    "SendSignal": Rpc(_signal, kind="ending"),
    "CloseStdin": Rpc(lambda n, t, m, h: (t.call(lambda a: a.close_stdin(t.pid_of(m))), {})[1], kind="ending"),
    "Update": Rpc(_update),
}
FILESYSTEM = {
    "Stat": Rpc(lambda n, t, m, h: {"entry": entry_info(t.call(lambda a: a.stat(path_of(m), user=t.user)))}),
    "MakeDir": Rpc(lambda n, t, m, h: {"entry": entry_info(t.call(lambda a: a.make_dir(path_of(m), user=t.user)))}),
    "Move": Rpc(lambda n, t, m, h: {"entry": entry_info(t.call(
        lambda a: a.move(path_of(m, "source"), path_of(m, "destination"), user=t.user)))}),
    "ListDir": Rpc(lambda n, t, m, h: {"entries": [entry_info(e) for e in t.call(
        lambda a: a.list_dir(path_of(m), depth=envd.int_of(m, "depth", 1) or 1, user=t.user))]}),
    "Remove": Rpc(lambda n, t, m, h: (t.call(lambda a: a.remove(path_of(m), user=t.user)), {})[1]),
    "WatchDir": Rpc(_watch, streaming=True),
    "CreateWatcher": Rpc(lambda n, t, m, h, lease: {"watcherId": n.watchers.create(
        t, path_of(m), bool(m.get("recursive")), release=lease.release)}, keeps=True),
    "GetWatcherEvents": Rpc(lambda n, t, m, h: {"events": n.watchers.poll(t.sid, str(m.get("watcherId", "")))},
                            kind="short"),
    "RemoveWatcher": Rpc(lambda n, t, m, h: (n.watchers.remove(t.sid, str(m.get("watcherId", ""))), {})[1],
                         kind="ending"),  # it tells the guest: a guest that stops reading holds it up to 30 s
}


@router.post("/process.Process/{method}")
async def process_service(method: str, request: Request, node: NodeDep) -> Response:
    return await _rpc(request, node, PROCESS, method)


@router.post("/filesystem.Filesystem/{method}")
async def filesystem_service(method: str, request: Request, node: NodeDep) -> Response:
    return await _rpc(request, node, FILESYSTEM, method)


async def _rpc(request: Request, node: Any, table: dict[str, Rpc], method: str) -> Response:
    """One Connect call: the token before any byte of the body, the body
    capped, a place among the team's long requests, then the call."""
    streaming = request.headers.get("content-type", "").startswith(STREAM_TYPE)
    try:
        rpc = table.get(method)
        if rpc is None:
            raise ConnectError("unimplemented", f"method {method} is not served")
        target, team = await _target(request, node)
        body = await read_body(request, limit=MAX_BODY)
    except TooLarge as exc:
        return _refused(ConnectError("resource_exhausted", str(exc)), streaming, status=413)
    except ConnectError as exc:
        return _refused(exc, streaming, unread=True)
    try:
        message = request_message(request.headers.get("content-type", ""), body)
        if rpc.kind == "short":
            return JSONResponse(await run_in_threadpool(rpc.fn, node, target, message, request.headers))
        lease = _admit(request, team, ending=rpc.kind == "ending")
    except ConnectError as exc:
        return _refused(exc, streaming)
    return await _call(request, node, rpc, (target, message), lease, streaming)


async def _call(request: Request, node: Any, rpc: Rpc, what: tuple[Target, dict[str, Any]], lease: Lease,
                streaming: bool) -> Response:
    """Run `rpc` on a long-work thread; its lease is given back when the
    answer is made, or when the stream ends (or goes with a watcher)."""
    limits, handed = _limits(request), False
    fn = partial(rpc.fn, lease=lease) if rpc.keeps else rpc.fn
    try:
        result = await limits.run(fn, node, *what, request.headers)
        if rpc.streaming:
            handed = True
            return LeasedStream(_envelopes(result), limits=limits, lease=lease, media_type=STREAM_TYPE,
                                interrupt=what[0].interrupt)
        handed = rpc.keeps
        return JSONResponse(result)
    except ConnectError as exc:
        return _refused(exc, streaming)
    finally:
        if not handed:
            lease.release()


def _refused(exc: ConnectError, streaming: bool, *, status: int | None = None, unread: bool = False) -> Response:
    """A Connect error: in a stream's end message (HTTP 200), or as an HTTP
    status (always for one the body was never read for, 413: the
    connection is closed with it, so the body never will be)."""
    headers = {**getattr(exc, "headers", {}), **(HANG_UP if unread or status == 413 else {})}
    if streaming and status is None:
        return Response(end_of_stream(exc), media_type=STREAM_TYPE, headers=headers)
    return JSONResponse(exc.body(), status_code=status or HTTP_STATUS[exc.code], headers=headers)


def _envelopes(messages: Iterator[dict[str, Any]]) -> Iterator[bytes]:
    try:
        for message in messages:
            yield envelope(message)
    except ConnectError as exc:
        yield end_of_stream(exc)
        return
    except StrataError as exc:
        yield end_of_stream(ConnectError("internal", str(exc)))
        return
    finally:
        getattr(messages, "close", lambda: None)()  # now, not when collected: it holds a guest stream
    yield end_of_stream()


# --- /files ---------------------------------------------------------------------------


def _files_error(exc: ConnectError, *, unread: bool = False) -> JSONResponse:
    status = {"not_found": 404, "invalid_argument": 400, "unauthenticated": 401, "permission_denied": 403,
              "already_exists": 409, "resource_exhausted": 429, "unavailable": 502,
              "deadline_exceeded": 504}.get(exc.code, 500)
    if isinstance(exc, envd.DiskFull):
        status = 507
    headers = {**getattr(exc, "headers", {}), **(HANG_UP if unread else {})}
    return JSONResponse({"code": status, "message": str(exc)}, status_code=status, headers=headers)


@router.get("/files")
async def download(request: Request, node: NodeDep) -> Response:
    try:
        target, team = await _target(request, node)
        path = request.query_params.get("path", "")
        if not path:
            raise ConnectError("invalid_argument", "path is required")
        lease = _admit(request, team)
    except ConnectError as exc:
        return _files_error(exc)
    limits, handed = _limits(request), False
    try:
        blocks = await limits.run(target.call, lambda a: a.read_file(path, user=target.user))
        handed = True
        return LeasedStream(_guarded(blocks), limits=limits, lease=lease, media_type="application/octet-stream")
    except ConnectError as exc:
        return _files_error(exc)
    finally:
        if not handed:
            lease.release()


def _guarded(blocks: Iterator[bytes]) -> Iterator[bytes]:
    """A file's blocks; a failure midway aborts the response, so the client
    sees a broken transfer (no final chunk), never a short file as whole."""
    try:
        yield from blocks
    except AgentError as exc:
        log.warning("a download from a sandbox broke off: %s", exc)
        raise


@router.post("/files")
async def upload(request: Request, node: NodeDep) -> Response:
    """The token before any byte of the body; a refused or failed upload
    closes the connection, so the rest of its body is never read."""
    try:
        target, team = await _target(request, node)
        with _admit(request, team):
            written = await _upload(request, target, _limits(request))
    except ConnectError as exc:
        return _files_error(exc, unread=True)
    return JSONResponse([{"name": e.name, "type": "file", "path": e.path} for e in written])


async def _upload(request: Request, target: Target, limits: Limits) -> list[Any]:
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    path = request.query_params.get("path", "")
    if kind == "multipart/form-data":
        return await _upload_form(request, target, path, limits)
    if not path:
        raise ConnectError("invalid_argument", "path is required for an octet-stream upload")
    return [await _upload_stream(request, target, path, limits)]


class _Writer:
    """One file being written into the guest, a block at a time; the agent
    calls on long-work threads."""

    def __init__(self, agent: Any, handle: Any, limits: Limits) -> None:
        self._agent, self._handle, self._limits = agent, handle, limits
        self._pending = bytearray()

    @classmethod
    async def open(cls, target: Target, path: str, limits: Limits) -> "_Writer":
        try:
            agent = await limits.run(target.agent_of)
            return cls(agent, await limits.run(agent.open_write, path, user=target.user), limits)
        except AgentError as exc:
            raise envd.connect_error(exc) from None

    async def add(self, data: bytes) -> None:
        self._pending += data
        if len(self._pending) >= UPLOAD_BLOCK:
            await self._flush()

    async def close(self) -> Any:
        """The file's entry once all of it is in the guest; the file is
        closed even if the last block fails."""
        try:
            try:
                await self._flush()
            finally:
                entry = await self._limits.run(self._agent.close_write, self._handle)
            return entry
        except AgentError as exc:
            raise envd.connect_error(exc) from None

    async def _flush(self) -> None:
        if self._pending:
            block, self._pending = bytes(self._pending), bytearray()
            try:
                await self._limits.run(self._agent.write_block, self._handle, block)
            except AgentError as exc:
                raise envd.connect_error(exc) from None


async def _upload_stream(request: Request, target: Target, path: str, limits: Limits) -> Any:
    gzipped = request.headers.get("content-encoding", "").lower() == "gzip"
    inflate = zlib.decompressobj(wbits=31) if gzipped else None
    writer = await _Writer.open(target, path, limits)
    try:
        async for chunk in request.stream():
            if inflate is None:
                await writer.add(chunk)
                continue
            for block in _inflated(inflate, chunk):  # a block at a time: a small body may inflate a thousandfold
                await writer.add(block)
        if inflate is not None:
            await writer.add(inflate.flush())
            if not inflate.eof or inflate.unused_data:
                raise ConnectError("invalid_argument", "the gzip body is cut short or has data past its end")
    finally:
        entry = await writer.close()
    return entry


def _inflated(inflate: Any, chunk: bytes) -> Iterator[bytes]:
    try:
        yield inflate.decompress(chunk, UPLOAD_BLOCK)
        while inflate.unconsumed_tail:
            yield inflate.decompress(inflate.unconsumed_tail, UPLOAD_BLOCK)
    except zlib.error:
        raise ConnectError("invalid_argument", "the gzip body is corrupt") from None


async def _upload_form(request: Request, target: Target, path: str, limits: Limits) -> list[Any]:
    """Each file of the form into the guest as it arrives (api/formdata.py):
    to `path` if given (then the form carries one file: E2B's SDK names
    `path` only for one), else to its filename."""
    try:
        form = FormReader(boundary_of(request.headers.get("content-type", "")))
    except FormError as exc:
        raise ConnectError("invalid_argument", str(exc)) from None
    written: list[Any] = []
    writer: _Writer | None = None
    try:
        async for chunk in request.stream():
            for kind, value in _events(form, chunk):
                if kind == "file":
                    writer = await _Writer.open(target, _destination(path, value, len(written)), limits)
                elif kind == "data" and writer is not None:
                    await writer.add(value)
                elif kind == "end" and writer is not None:
                    writer, done = None, writer
                    written.append(await done.close())
        _events(form, None)
    finally:
        if writer is not None:
            await writer.close()
    if not written:
        raise ConnectError("invalid_argument", "the form has no file")
    return written


def _events(form: FormReader, chunk: bytes | None) -> list[tuple[str, Any]]:
    """The form's events for `chunk` (None: the body has ended)."""
    try:
        if chunk is None:
            form.finish()
            return []
        return form.feed(chunk)
    except FormError as exc:
        raise ConnectError("invalid_argument", str(exc)) from None


def _destination(path: str, filename: str, before: int) -> str:
    if path and before:
        raise ConnectError("invalid_argument", "?path= names one file, and the form carries more: "
                                               f"{before} written, the rest refused; name each by its filename")
    if not (path or filename):
        raise ConnectError("invalid_argument", "a file in the form has no name and no path was given")
    return path or filename
