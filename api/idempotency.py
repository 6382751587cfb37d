"""E2B's `Idempotency-Key` on sandbox creates: a client that retries a
create (a timeout, a dropped connection) gets the sandbox the first attempt
made, not a second one.

A key is the team's (two teams may use the same one) and is kept in the
record of the sandbox it made, with a digest of the request, so it
survives a node restart and lasts as long as that sandbox: once it is
killed the key is free again. The same key with a different request is a
Conflict. Creates with one key run one at a time (the second waits for the
first and is then answered from its record); different keys never wait on
each other. A key is 1-255 of a-z, 0-9 and '-', as E2B's SDK checks too.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from layerstore.errors import Conflict, InvalidInput
from vmm.registry import SandboxRecord

KEY = re.compile(r"[a-z0-9-]{1,255}")


def check_key(key: str) -> str:
    if not KEY.fullmatch(key):
        raise InvalidInput("Idempotency-Key must be 1 to 255 lowercase letters, digits and hyphens")
    return key


class Idempotency:
    def __init__(self, records: Callable[[], list[SandboxRecord]]) -> None:
        """`records()`: the client-visible sandboxes (a killed one's key is forgotten with it)."""
        self._records = records
        self._guard = threading.Lock()
        self._held: dict[tuple[str, str], tuple[threading.Lock, int]] = {}  # (team, key) -> (its lock, waiters)

    def once(self, team: str, key: str, digest: str,
             create: Callable[[str], SandboxRecord]) -> tuple[SandboxRecord, bool]:
        """The sandbox `team` made with `key` (and whether it was made
        before), calling `create(mark)` to make it if none was; `mark` goes
        in its record."""
        mark = f"{check_key(key)} {digest}"
        with self._holding((team, key)):
            for record in self._records():
                if record.team == team and record.idempotency.split(" ", 1)[0] == key:
                    if record.idempotency != mark:
                        raise Conflict(f"Idempotency-Key {key!r} was used for a different request "
                                       f"(sandbox {record.sid}): use a new key")
                    return record, True
            return create(mark), False

    @contextmanager
    def _holding(self, name: tuple[str, str]) -> Iterator[None]:
        with self._guard:
            lock, waiters = self._held.get(name, (threading.Lock(), 0))
            self._held[name] = (lock, waiters + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, waiters = self._held[name]
                if waiters == 1:
                    del self._held[name]
                else:
                    self._held[name] = (lock, waiters - 1)
