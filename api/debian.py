"""Debian 12 roots built from Debian's own packages (mmdebstrap), kept as tars.

    mmdebstrap --variant=minbase --include=PKG,... bookworm partial-PID-NAME.tar
      -> NAME.tar          renamed into place once whole: a reader never sees half a root

The code interpreter's template and the tests that boot a real distribution
take their roots from here. A build downloads every package from Debian's
mirror, so it is made once and then read from its cache.

Why it retries: one failed download (a mirror mid-sync, a reset connection)
fails the whole build, and mmdebstrap exits with perl's leftover errno (25,
ENOTTY, whatever went wrong), so the exit code says nothing. A failed attempt
is tried again after a pause, and the error that ends the last one carries
apt's own lines. A process with no route to the mirror (a network namespace
of its own) fails every attempt the same way, within seconds: build before
entering one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ContextManager

from layerstore.errors import StrataError

SUITE = "bookworm"
TIMEOUT = 1800  # seconds for one attempt: a minute or so is usual here


def build_root(cache: Path, packages: Sequence[str], *, attempts: int = 3, pause: float = 15.0,
               timeout: float = TIMEOUT, status: Callable[[str], ContextManager] | None = None) -> Path:
    """`cache`, a tar of Debian 12 minbase with `packages`, built first if it is not there yet.
    `status(message)` wraps each attempt (a CLI's progress line); StrataError once every attempt failed."""
    if cache.is_file():
        return cache
    if shutil.which("mmdebstrap") is None:
        raise StrataError("mmdebstrap is needed to build a Debian root (apt-get install mmdebstrap)")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        lock = open(cache.with_name(f".{cache.name}.lock"), "a")  # noqa: SIM115 (held by the with below)
    except OSError as exc:
        raise StrataError(f"cannot keep the Debian root at {cache}: {exc.strerror or exc}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build of a cache at a time; the others wait, then take it
        return cache if cache.is_file() else _build(cache, packages, attempts=attempts, pause=pause,
                                                    timeout=timeout, status=status)


def _build(cache: Path, packages: Sequence[str], *, attempts: int, pause: float, timeout: float,
           status: Callable[[str], ContextManager] | None) -> Path:
    failure = ""
    for attempt in range(1, attempts + 1):
        label = f"building a Debian 12 root with {', '.join(packages)} (mmdebstrap, attempt {attempt} of " \
                f"{attempts}; cached in {cache})"
        with status(label) if status else contextlib.nullcontext():
            failure = _attempt(cache, packages, timeout=timeout)
        if not failure:
            return cache
        if attempt < attempts:
            time.sleep(pause)
    raise StrataError(f"mmdebstrap failed {attempts} times; the last: {failure} (it downloads from Debian's "
                      f"mirror: can this process reach it?)")


def _attempt(cache: Path, packages: Sequence[str], *, timeout: float) -> str:
    """One build into a partial file renamed onto `cache`: '' when it worked, else why it did not."""
    part = cache.with_name(f"partial-{os.getpid()}-{cache.name}")  # mmdebstrap picks its format by the suffix
    mode = "root" if os.geteuid() == 0 else "unshare"
    command = ["mmdebstrap", "--variant=minbase", f"--include={','.join(packages)}", f"--mode={mode}", SUITE,
               str(part)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            return f"exit {done.returncode}: {apt_errors(done.stderr)}"
        part.replace(cache)
        return ""
    except subprocess.TimeoutExpired:
        return f"took over {timeout:.0f} s"
    finally:
        part.unlink(missing_ok=True)


def apt_errors(stderr: str, *, limit: int = 600) -> str:
    """The error lines (E:) of mmdebstrap's and apt's output, joined; the last line if there are none."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E:")]
    text = " | ".join(dict.fromkeys(errors or lines[-1:] or ["no message"]))
    return text if len(text) <= limit else "..." + text[-limit:]
