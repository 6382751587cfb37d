"""`strata template build`: an E2B-style template build (api/builds.py) from
the command line, on this node, with its log shown as it runs.

    strata template build NAME --from BASE [--env K=V] [--workdir DIR] [--user U]
        [--copy SRC:DEST] [--run CMD] ... [--start CMD --ready CMD]

Steps run in the order given. BASE is a template or an image NAME:TAG.
`strata template code-interpreter` (api/code_interpreter.py) builds E2B's
code-interpreter template with the same machinery.
"""

from __future__ import annotations

import argparse
import hashlib
import tarfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerstore.errors import InvalidInput, StrataError

from . import code_interpreter
from .compose import NodeContext
from .teams import ADMIN

if TYPE_CHECKING:  # the builds (and the registry client under them) load only when a build runs
    from .builds import Build, Builds


class _Step(argparse.Action):
    """Keeps --env/--workdir/--user/--copy/--run in the order given."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, value: Any,
                 option: str | None = None) -> None:
        ns.steps = [*(getattr(ns, "steps", None) or []), (self.dest, value)]


def register(verbs: dict[str, Any], common: argparse.ArgumentParser) -> None:
    p = verbs["template"].add_parser("build", parents=[common],
                                     help="build a template: boot BASE, run steps, start/ready command, snapshot")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--from", dest="base", required=True, metavar="BASE", help="a template or an image NAME:TAG")
    for flag, dest, what in (("--env", "ENV", "K=V for the steps and every later process"),
                             ("--workdir", "WORKDIR", "directory for the steps and later processes"),
                             ("--user", "USER", "user for the steps and later processes"),
                             ("--copy", "COPY", "SRC:DEST, a local file or directory into the sandbox"),
                             ("--run", "RUN", "a shell command (repeatable, in order)")):
        p.add_argument(flag, dest=dest, action=_Step, metavar=dest, help=what)
    p.add_argument("--start", metavar="CMD", help="left running in the template's snapshot")
    p.add_argument("--ready", metavar="CMD", help="polled until it succeeds before the snapshot")
    p.set_defaults(func=cmd_template_build, steps=[])
    code_interpreter.register(verbs, common)


def cmd_template_build(args: argparse.Namespace, ctx: NodeContext) -> int:
    node = ctx.node()
    steps = [_step(node.builds, kind, value) for kind, value in args.steps]
    base = {"fromImage": args.base} if ":" in args.base else {"fromTemplate": args.base}
    build = run_build(ctx, node.builds, args.name,
                      {**base, "steps": steps, "startCmd": args.start, "readyCmd": args.ready})
    ctx.out.result({"template": build.name, "build": build.build_id, "timings": build.timings},
                   f"template {build.name} built ({', '.join(f'{k} {v:.1f} s' for k, v in build.timings.items())})")
    return 0


def run_build(ctx: NodeContext, builds: Builds, name: str, spec: dict[str, Any]) -> Build:
    """Build template `name` from `spec` (E2B's build body) as the node's
    operator, its log shown as it runs; StrataError naming why if it failed."""
    build = builds.request(ADMIN, name)
    builds.start(ADMIN, build.name, build.build_id, spec)
    shown = 0
    while build.status in ("waiting", "building"):
        shown = _show(ctx, build, shown)
        time.sleep(0.2)
    _show(ctx, build, shown)
    if build.status != "ready":
        raise StrataError(f"template {build.name}: {build.reason}")
    return build


def _show(ctx: NodeContext, build: Any, shown: int) -> int:
    for entry in build.logs[shown:]:
        ctx.out.note(entry.message)
    return len(build.logs)


def _step(builds: Builds, kind: str, value: str) -> dict[str, Any]:
    if kind == "ENV":
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise InvalidInput(f"--env {value!r}: give K=V")
        return {"type": "ENV", "args": [key, val]}
    if kind == "COPY":
        src, sep, dest = value.partition(":")
        if not sep or not Path(src).exists():
            raise InvalidInput(f"--copy {value!r}: give SRC:DEST with an existing local SRC")
        return {"type": "COPY", "args": [Path(src).name, dest], "filesHash": _pack(builds, Path(src))}
    return {"type": kind, "args": [value]}


def _pack(builds: Builds, src: Path) -> str:
    """Tar `src` (named by its base name, as the SDK's context-relative
    paths are) into the operator's build files, by content hash."""
    builds.files.mkdir(parents=True, exist_ok=True)
    part = builds.files / f".upload-cli-{time.time_ns()}"
    try:
        with tarfile.open(part, "w") as tar:
            tar.add(src, arcname=src.name)
        digest = hashlib.sha256(part.read_bytes()).hexdigest()
        builds.keep_upload(part, builds.upload_path(ADMIN.team, digest))
    finally:
        part.unlink(missing_ok=True)
    return digest
