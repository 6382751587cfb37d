"""A sandbox's event log: what happened to it and in it, with times.

One JSON object per line in `events.jsonl` in the sandbox's work directory:

    {"t": 1733290000.123, "level": "info", "message": "booted", "fields": {"image": "guest:v1"}}

Written by the VMM layer for lifecycle events (boot, restore, snapshot,
suspend, wake, recovery) and by the API for what clients ran (process
started, exited). Bounded: at `limit` bytes the file becomes
`events.jsonl.1` (the previous one is dropped), so a sandbox that runs a
million commands costs the node at most twice the limit. Appends are one
write(2) of a whole line with O_APPEND, so concurrent writers (the API and
a CLI process) interleave whole lines.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOG = "events.jsonl"
DEFAULT_LIMIT = 1 << 20
LEVELS = ("debug", "info", "warn", "error")


@dataclass(frozen=True)
class Event:
    t: float
    level: str
    message: str
    fields: dict[str, str]


def append(workdir: Path, level: str, message: str, *, limit: int = DEFAULT_LIMIT, **fields: Any) -> None:
    """Add an event; never raises (a full disk must not fail the operation logged)."""
    assert level in LEVELS, level
    line = json.dumps({"t": time.time(), "level": level, "message": message,
                       "fields": {k: str(v) for k, v in fields.items()}}, separators=(",", ":")) + "\n"
    path = workdir / LOG
    try:
        if path.exists() and path.stat().st_size + len(line) > limit:
            os.replace(path, workdir / (LOG + ".1"))
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def read(workdir: Path, *, since: float = 0.0, limit: int = 1000) -> list[Event]:
    """Events at or after `since`, oldest first, at most `limit` (the newest
    ones when there are more). Lines that do not parse are skipped."""
    out: list[Event] = []
    for name in (LOG + ".1", LOG):
        try:
            text = (workdir / name).read_text(errors="replace")
        except OSError:
            continue
        for raw in text.splitlines():
            try:
                d = json.loads(raw)
                ev = Event(float(d["t"]), str(d["level"]), str(d["message"]),
                           {str(k): str(v) for k, v in (d.get("fields") or {}).items()})
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            if ev.t >= since and ev.level in LEVELS:
                out.append(ev)
    return out[-limit:] if limit > 0 else []
