"""Sandbox records: what a node knows about each of its sandboxes, on disk.

A sandbox outlives the process that booted it (each `strata sandbox` command
is its own process; the API service restarts), so everything needed to find
and control it again is a small JSON file in its work directory:

    WORK_ROOT/<sid>/
        sandbox.json   this record (temp file + rename: never half written)
        vm.json        the VMM backend's own note (pid, ...)
        qmp.sock  agent.sock  console.log  qemu.log   (backend's files)
        ram            guest RAM while the VM runs (a file, so snapshots
                       import it as a chunked layer)
        state          device state of the last snapshot

Sandbox ids become directory names, so they pass `check_sid` (a strict
alphabet, no '/', no leading '.') before they touch the filesystem.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from fusefs.upper import check_sid
from layerstore.errors import CorruptObject, NotFound

RECORD = "sandbox.json"


@dataclass
class SandboxRecord:
    """One sandbox. `state` is what we last did to it: running, paused
    (vCPUs stopped, VM in memory) or suspended (snapshotted, VM and upper
    layer gone: costs the node nothing but the record); whether its VM
    process is still alive is asked of the backend. The lifetime fields are
    the API's (TTL, what happens on expiry, since when it sleeps)."""

    sid: str
    backend: str
    source: str  # "image:NAME:TAG" or "snapshot:<id>"
    memory_mib: int
    state: str = "running"
    pid: int | None = None  # of the VM process (the backend checks it is still ours)
    created: float = field(default_factory=time.time)
    last_snapshot: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    template: str = ""
    end_at: float | None = None
    auto_pause: bool = False
    suspended_at: float | None = None
    timings: dict[str, float] = field(default_factory=dict)


def new_sid() -> str:
    """A fresh sandbox id: 12 random hex digits (never chosen by a user)."""
    return "sb" + secrets.token_hex(6)


class Registry:
    """The records under one work root (one per node)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def workdir(self, sid: str) -> Path:
        return self.root / check_sid(sid)

    def exists(self, sid: str) -> bool:
        return (self.workdir(sid) / RECORD).exists()

    def save(self, record: SandboxRecord) -> None:
        work = self.workdir(record.sid)
        work.mkdir(parents=True, exist_ok=True)
        tmp = work / f".{RECORD}.tmp"
        tmp.write_text(json.dumps(asdict(record), indent=1, sort_keys=True))
        os.replace(tmp, work / RECORD)

    def load(self, sid: str) -> SandboxRecord:
        try:
            data = json.loads((self.workdir(sid) / RECORD).read_text())
        except FileNotFoundError:
            raise NotFound(f"no sandbox {sid}") from None
        except ValueError:
            raise CorruptObject(f"the record of sandbox {sid} is unreadable ({self.workdir(sid) / RECORD})") from None
        return _record(data)

    def all(self) -> list[SandboxRecord]:
        """Every readable record, oldest first (a torn or foreign directory is skipped)."""
        records = []
        for entry in self.root.iterdir():
            try:
                records.append(_record(json.loads((entry / RECORD).read_text())))
            except (OSError, ValueError, TypeError):
                continue
        return sorted(records, key=lambda r: (r.created, r.sid))

    def snapshot_users(self) -> dict[str, list[str]]:
        """Snapshot id -> the paused sandboxes that wake from it ("paused sandbox SID"):
        deleting such a snapshot would lose the sandbox."""
        users: dict[str, list[str]] = {}
        for record in self.all():
            if record.state == "suspended" and record.last_snapshot:
                users.setdefault(record.last_snapshot, []).append(f"paused sandbox {record.sid}")
        return users

    def remove(self, sid: str) -> None:
        shutil.rmtree(self.workdir(sid), ignore_errors=True)


def _record(data: dict) -> SandboxRecord:
    """A record from its JSON, ignoring fields an older or newer Strata wrote."""
    known = {f.name for f in fields(SandboxRecord)}
    return SandboxRecord(**{k: v for k, v in data.items() if k in known})
