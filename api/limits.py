"""Fair sharing of the node's worker threads between short and long work.

Blocking work runs on worker threads. A short request (list, create, info,
pause...) holds one for as long as the node takes; long work holds one for
as long as a guest or a client likes: an exec runs a command to its end, a
data-plane call or stream waits on the guest agent (a process stream for
the life of the process), a file transfer for as long as the bytes flow,
a polling watcher for as long as it is kept. Sharing one pool, a team's
long work could take every thread, and every other team's short requests
would queue behind it (issue #33: 520 `sleep 3000` execs froze the node).

So long work runs on its own limiter, and is admitted first:

    per team  `team_max_streams` (default 256) long requests at once
    per node  `max_streams` (default 1024) in all

Past either, a request is refused at once, 429 naming the limit (it never
waits for a thread, and never takes one of the short requests', which keep
anyio's default limiter, api/app.py). An admitted request holds a `Lease`
until it ends, however it ends; the long limiter has a thread for every
lease, so admitted work never waits for one either. A call that ends long
work (a signal, closing stdin, removing a watcher) may go ENDING_GRACE
places past either limit, so a team at its limit can still wind down.

Short requests can be slow too (a hung guest's metrics, a lock another
request holds, a large upload), so a team has at most SHORT_SHARE of them
in flight; more wait, without a thread, for one of its own to end. However
many a team sends, the others' are answered.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from layerstore.config import NodeConfig
from vmm.shares import Shares

from .exceptions import Capacity
from .teams import Caller, check_quota

T = TypeVar("T")
ENDING_GRACE = 16  # places past the limits that calls ending long work may take
SHORT_THREADS = 512  # worker threads of short requests (anyio's default limiter, set at start)
SHORT_SHARE = SHORT_THREADS // 4  # short requests of one team in flight at once


class StreamsFull(Capacity):
    """The node serves `max_streams` long requests already (429, X-Strata-Limit: node)."""


class Lease:
    """One admitted long request's place; `release` gives it back (once,
    whoever calls it and however often)."""

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back: Callable[[], None] | None = give_back
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


class Limits:
    """Admission and threads for a node's long work (module docstring)."""

    def __init__(self, config: NodeConfig) -> None:
        self._config = config
        self._shares = Shares()  # team -> its long requests in flight
        self._threads = anyio.CapacityLimiter(config.max_streams + ENDING_GRACE)
        self._short: dict[str, anyio.Semaphore] = {}  # per team, made as teams appear (one per key's team)

    def admit(self, team: str, *, ending: bool = False) -> Lease:
        """A place for one long request of `team`, or QuotaExceeded
        (team_max_streams) / StreamsFull (max_streams) at once. `ending`:
        the request ends long work, and may take ENDING_GRACE more."""
        grace = ENDING_GRACE if ending else 0
        limit = self._team_limit(team)
        refused = self._shares.take(team, each=None if limit is None else limit + grace,
                                    total=self._config.max_streams + grace)
        if refused is not None:
            held, total = refused
            if limit is not None and held >= limit + grace:  # raises, naming the quota
                check_quota(self._config, Caller(team), setting="team_max_streams", used=held, adding=1)
            raise StreamsFull(f"this node serves {total} long requests (execs, streams, watchers); the limit "
                              f"is max_streams {self._config.max_streams}: try again when one has ended")
        return Lease(partial(self._shares.give, team))

    def _team_limit(self, team: str) -> int | None:
        return self._config.team_limit(self._config.team_max_streams, team)

    @asynccontextmanager
    async def short(self, team: str) -> AsyncIterator[None]:
        """One of `team`'s SHORT_SHARE places among short requests in flight,
        waited for (in the event loop, holding no thread) if they are taken."""
        share = self._short.setdefault(team, anyio.Semaphore(SHORT_SHARE))  # the event loop's thread only
        async with share:
            yield

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on a thread of the long limiter."""
        return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs), limiter=self._threads)

    async def serve(self, team: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn` as one long request of `team`: admitted, run, given back."""
        with self.admit(team):
            return await self.run(fn, *args, **kwargs)

    async def iterate(self, items: Iterator[T]) -> AsyncIterator[T]:
        """`items`, each one made on a thread of the long limiter."""
        end = object()
        while (item := await self.run(next, items, end)) is not end:
            yield item  # type: ignore[misc]


class LeasedStream(StreamingResponse):
    """A streaming response of blocking work: each block is made on the long
    limiter, and when the response ends (done, failed, or the client gone)
    the blocks' iterator is closed, so what it holds in the guest is let go,
    and the lease is given back. A thread making a block cannot be
    cancelled, so when the client leaves `interrupt` is called (from the
    event loop) to wake it."""

    def __init__(self, blocks: Iterator[bytes], *, limits: Limits, lease: Lease, media_type: str,
                 interrupt: Callable[[], None] = lambda: None) -> None:
        super().__init__(limits.iterate(blocks), media_type=media_type)
        self._blocks, self._limits, self._lease, self._interrupt = blocks, limits, lease, interrupt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._interrupt_when_gone, receive)
                try:
                    await super().__call__(scope, receive, send)
                finally:
                    tasks.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                close = getattr(self._blocks, "close", None)
                try:
                    if close is not None:
                        await self._limits.run(close)
                finally:
                    self._lease.release()

    async def _interrupt_when_gone(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._interrupt()
