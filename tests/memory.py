"""A process's peak memory, for the rows that bound what an attack may cost."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
from pathlib import Path


def reset_peak(pid: int) -> None:
    """Start the process's peak memory (VmHWM) afresh at what it holds now (Linux >= 4.0)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_rss(pid: int) -> int:
    """The process's high-water resident memory, in bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no VmHWM for pid {pid}")


def run_measured(cmd: list[str], env: dict[str, str], *, timeout: float = 300) -> tuple[int, str, int]:
    """Run `cmd` to its end: (exit status, stderr, its peak resident memory in bytes, from wait4)."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        return proc.returncode, err.read(), usage.ru_maxrss << 10
