"""What every package's `strata` commands share: `Output` (JSON or text on
stdout, progress on stderr), the exit codes, size parsing and printing, the
options every command takes, and `StoreContext`, the least a command uses of
the entry point's context. The store's own commands are layerstore/cli.py.

The `strata` entry point (api/cli.py) builds the parser from each package's
`register`, loads the node's configuration once, and calls a command as
`func(args, ctx)`. `ctx` is the entry point's `NodeContext`; each command
module declares in a Protocol just what it uses of it (`StoreContext` here,
which the other packages' Protocols extend), so no package reaches above
itself for the node.

Conventions: nouns then verbs; every command takes `--json` (one JSON
document on stdout) and `--store`; failures print one line, `strata: error:
...`, on stderr and exit non-zero (EXIT_FAILED for a failed operation,
EXIT_USAGE for bad usage, EXIT_PROBLEMS when `verify` finds problems). Long
work shows a progress bar when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

from .config import NodeConfig, parse_bytes

if TYPE_CHECKING:  # the store's modules load when a command opens one: `strata --help` stays quick
    from .reach import Name
    from .store import Store

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PROBLEMS = 3


def parse_size(text: str) -> int:
    """Parse `1048576`, `64K`, `1M`, `1MiB`, `2G` (powers of 1024) into bytes (argparse type)."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class Output:
    """Where results go: JSON on stdout for scripts, text otherwise; progress on stderr."""

    def __init__(self, *, json_mode: bool) -> None:
        self.json_mode = json_mode
        self.show_progress = not json_mode and sys.stderr.isatty()

    def result(self, data: object, text: str | Callable[[], str]) -> None:
        if self.json_mode:
            json.dump(data, sys.stdout, indent=2, sort_keys=True)
            sys.stdout.write("\n")
        else:
            sys.stdout.write((text() if callable(text) else text) + "\n")

    def note(self, text: str) -> None:
        """A line of what long work is doing (a build's log), on stderr; nothing with --json."""
        if not self.json_mode:
            sys.stderr.write(text + "\n")

    @contextlib.contextmanager
    def progress(self, description: str) -> Iterator[tuple[Callable[[int], None], Callable[[int], None]]]:
        """Yield (advance, set_total) callbacks driving a rich progress bar (or nothing)."""
        if not self.show_progress:
            yield (lambda n: None), (lambda n: None)
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            transient=True,
        ) as bar:
            task = bar.add_task(description, total=None)
            yield (lambda n: bar.advance(task, n)), (lambda n: bar.update(task, total=n))

    @contextlib.contextmanager
    def status(self, description: str) -> Iterator[None]:
        """A spinner with `description` on a terminal while a long step runs (else nothing)."""
        if not self.show_progress:
            yield
            return
        from rich.console import Console

        with Console(stderr=True).status(description):
            yield


class StoreContext(Protocol):
    """What every command may use of the entry point's context (the store's commands
    use just this; fusefs and vmm extend it)."""

    config: NodeConfig
    out: Output

    def open_store(self, spec: str | None = None, *, level: int | None = None, bulk: bool = False) -> Store:
        """The store `spec` (default: the node's), opened with the node's
        settings; `bulk` for a command that writes many chunks nobody reads
        back soon (a local store then writes them around the page cache)."""

    def node_roots(self, store: Store) -> list[Name]:
        """What GC of `store` must keep beyond refs, templates and snapshots
        (the layers this node's sandbox disks sit on)."""

    def node_snapshot_users(self) -> dict[str, list[str]]:
        """Snapshot id -> this node's sandboxes that need it ("paused sandbox SID")."""


def common_options() -> argparse.ArgumentParser:
    """Options every command takes (added as a parent parser at each level)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", default=argparse.SUPPRESS,
                        help="store: a directory or s3://BUCKET/PREFIX (env STRATA_STORE)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document")
    return common
