"""`strata sandbox ...`: boot, list, exec, pause, resume, snapshot, restore,
fork and kill sandboxes on this node, and a demo that does all of it.

Each command is its own process: sandboxes are found again through their
records (vmm/registry.py) and VMs re-attached over their control sockets.
The node's mount is `--mount` (STRATA_MOUNT, default $STRATA_STATE_DIR/mnt)
and is started on first use (the entry point's NodeContext does that), so `strata sandbox boot IMAGE` works on a
fresh node with nothing but a store.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fusefs.cli import mount_option
from layerstore.clikit import StoreContext, human_bytes, parse_size
from layerstore.errors import InvalidInput, StrataError

from .backend import BACKENDS
from .egress import Egress
from .registry import MAX_FORKS

if TYPE_CHECKING:  # loads the store's modules: only when a command runs
    from .sandbox import Sandbox, Sandboxes

GUEST_BUILD = Path(__file__).resolve().parent / "guest" / "build.sh"
DEMO_IMAGE = "strata-guest:demo"
# `sandbox exec` exits with the guest command's code; Strata's own failure
# there is 255, as ssh does, so a guest's `exit 1` or `exit 2` is never
# mistaken for "strata failed" or "bad usage".
EXIT_EXEC_FAILED = 255


class NodeContext(StoreContext, Protocol):
    """What the sandbox commands use of the entry point's context."""

    def sandboxes(self) -> Sandboxes:
        """The node's sandboxes: its store, its mount (started if needed), its VMM backend."""


def _row(sandbox: Sandbox) -> dict[str, Any]:
    r = sandbox.record
    return {"sid": r.sid, "state": r.state, "source": r.source, "memory_mib": r.memory_mib,
            "pid": sandbox.vm.pid, "last_snapshot": r.last_snapshot,
            "timings_ms": {k: round(v * 1e3, 1) for k, v in r.timings.items()}}


def cmd_boot(args: argparse.Namespace, ctx: NodeContext) -> int:
    out = ctx.out
    node = ctx.sandboxes()
    if not (node.guest_dir / "vmlinuz").exists():
        raise InvalidInput(f"no guest kernel in {node.guest_dir}: build one with `bash {GUEST_BUILD} "
                           f"{node.guest_dir}` (or run `strata sandbox demo`)")
    egress = _egress(args, ctx)
    with out.status(f"booting {args.image}"):
        sb = node.boot(args.image, sid=args.id, memory_mib=args.memory, disk_size=args.disk_size, egress=egress)
    out.result(_row(sb), f"{sb.sid} running ({args.image}, booted in {sb.timings['boot']:.1f} s)")
    return 0


def cmd_restore(args: argparse.Namespace, ctx: NodeContext) -> int:
    out = ctx.out
    node = ctx.sandboxes()
    egress = _egress(args, ctx)
    with out.status(f"restoring {args.snapshot[:16]}"):
        sb = node.restore(args.snapshot, sid=args.id, egress=egress)
    out.result(_row(sb), f"{sb.sid} running (restored in {sb.timings['restore'] * 1e3:.0f} ms)")
    return 0


def _egress(args: argparse.Namespace, ctx: NodeContext, current: Egress | None = None) -> Egress:
    """--allow-out/--deny-out/--[no-]internet as rules (validated: a bad one is a clear error)."""
    if args.internet is not None:
        internet = args.internet
    elif current is not None:
        internet = current.internet
    else:
        internet = ctx.config.network_internet
    return Egress.parse(internet, args.allow_out or [], args.deny_out or [])


def cmd_network(args: argparse.Namespace, ctx: NodeContext) -> int:
    """Show a sandbox's network; with rule options, replace its rules first."""
    out = ctx.out
    node = ctx.sandboxes()
    record = node.registry.load(args.sid)
    if args.allow_out is not None or args.deny_out is not None or args.internet is not None:
        record = node.set_egress(args.sid, _egress(args, ctx, Egress.of(record.network)))
    if record.network is None:
        out.result({"sid": args.sid, "network": None}, f"{args.sid} has no network")
        return 0
    rules = Egress.of(record.network)
    info: dict[str, Any] = {"sid": args.sid, **rules.as_record(), "address": None}
    if node.network is not None and record.state != "suspended":
        info["address"] = node.network.link(args.sid).outside
        info["counters"] = node.network.counters(args.sid)
    out.result(info, "\n".join([
        f"{args.sid}  address {info['address'] or '-'}  internet {'allowed' if rules.internet else 'denied'}",
        f"allow out: {', '.join(rules.allow) or '-'}", f"deny out:  {', '.join(rules.deny) or '-'}",
        *([f"sent {info['counters'].get('sent_bytes', 0)} B, received {info['counters'].get('received_bytes', 0)} B"]
          if "counters" in info else [])]))
    return 0


def cmd_ls(args: argparse.Namespace, ctx: NodeContext) -> int:
    out = ctx.out
    node = ctx.sandboxes()
    rows = node.list()

    def text() -> str:
        if not rows:
            return "no sandboxes"
        lines = [f"{'SANDBOX':<24} {'STATE':<8} {'VM':<5} {'MEMORY':>7}  SOURCE"]
        for r in rows:
            lines.append(f"{r['sid']:<24} {r['state']:<8} {'up' if r['alive'] else 'DEAD':<5} "
                         f"{r['memory_mib']:>4} MiB  {str(r['source'])[:48]}")
        return "\n".join(lines)

    out.result(rows, text)
    return 0


def shell_line(words: list[str]) -> str:
    """What the guest's `sh -c` runs for the words after `--`: one word is a
    command line as typed (`-- 'echo hi > f; uname -r'`); several are argv,
    each quoted, as `docker exec` and `kubectl exec` pass them (joined with
    bare spaces, `-- sh -c 'echo a; echo b'` ran `sh -c echo a; echo b`)."""
    words = words[1:] if words[:1] == ["--"] else words
    if not words or not words[0]:
        raise InvalidInput("no command given: strata sandbox exec SID -- COMMAND...")
    return words[0] if len(words) == 1 else shlex.join(words)


def cmd_exec(args: argparse.Namespace, ctx: NodeContext) -> int:
    out = ctx.out
    node = ctx.sandboxes()
    command = shell_line(args.command)
    result = node.exec(args.sid, command, timeout=args.timeout, max_output=ctx.config.exec_output_limit)
    out.result({"sid": args.sid, "exit_code": result.exit_code, "output": result.output,
                "truncated": result.dropped > 0},
               result.output.rstrip("\n"))
    return result.exit_code


def cmd_pause(args: argparse.Namespace, ctx: NodeContext) -> int:
    out = ctx.out
    sb = ctx.sandboxes().pause(args.sid)
    out.result(_row(sb), f"{sb.sid} paused in {sb.timings['pause'] * 1e3:.1f} ms")
    return 0


def cmd_resume(args: argparse.Namespace, ctx: NodeContext) -> int:
    out = ctx.out
    sb = ctx.sandboxes().resume(args.sid)
    out.result(_row(sb), f"{sb.sid} resumed in {sb.timings['resume'] * 1e3:.1f} ms")
    return 0


def cmd_snapshot(args: argparse.Namespace, ctx: NodeContext) -> int:
    out = ctx.out
    node = ctx.sandboxes()
    with out.status(f"snapshotting {args.sid}"):
        snapshot_id = node.snapshot(args.sid, resume=False if args.pause else None)
    t = node.registry.load(args.sid).timings
    data = {"sid": args.sid, "snapshot": snapshot_id,
            "timings_ms": {k: round(t[k] * 1e3, 1) for k in ("precopy", "paused", "capture", "seal", "publish")}}
    out.result(data, f"snapshot {snapshot_id} (pre-copy while running {t['precopy'] * 1e3:.0f} ms; guest paused "
                     f"{t['paused'] * 1e3:.0f} ms; capture {t['capture'] * 1e3:.0f} ms, seal {t['seal'] * 1e3:.0f} ms, "
                     f"publish {t['publish'] * 1e3:.0f} ms)")
    return 0


def cmd_fork(args: argparse.Namespace, ctx: NodeContext) -> int:
    out = ctx.out
    node = ctx.sandboxes()
    started = time.monotonic()
    with out.status(f"forking {args.sid} x{args.count}"):
        forks = node.fork(args.sid, args.count)
    elapsed = time.monotonic() - started
    rows = [_row(f) for f in forks]
    out.result({"source": args.sid, "forks": rows, "seconds": round(elapsed, 3)},
               "\n".join(r["sid"] for r in rows) + f"\n{len(rows)} fork(s) of {args.sid} in {elapsed:.1f} s")
    return 0


def cmd_kill(args: argparse.Namespace, ctx: NodeContext) -> int:
    out = ctx.out
    node = ctx.sandboxes()
    sids = [r["sid"] for r in node.list()] if args.all else args.sid
    if not sids and not args.all:
        raise InvalidInput("name the sandboxes to kill, or pass --all")
    from layerstore.nodes import existing_node_id

    from .placement import unplace

    holder = existing_node_id(Path(ctx.config.state_dir))  # None: this node never served, placed nothing
    for sid in sids:
        node.kill(sid)
        if holder is not None:  # gateways stop routing to it
            unplace(node.store.backend, sid, holder=holder)
    out.result({"killed": sids}, f"killed {len(sids)} sandbox(es)" + (": " + " ".join(sids) if sids else ""))
    return 0


def cmd_demo(args: argparse.Namespace, ctx: NodeContext) -> int:
    out = ctx.out
    """Build the guest, import its rootfs, boot, write, snapshot, fork, check isolation, clean up."""
    from layerstore.importer import import_image

    guest = ctx.config.guest_dir
    steps: list[tuple[str, str]] = []

    def step(name: str, detail: str) -> None:
        steps.append((name, detail))
        if not out.json_mode:
            print(f"{name:<10} {detail}", flush=True)

    with out.status(f"building the guest in {guest} (first run downloads Debian's cloud kernel)"):
        built = subprocess.run(["bash", str(GUEST_BUILD), str(guest)], capture_output=True, text=True)
    if built.returncode != 0:
        raise StrataError(f"guest build failed: {(built.stderr.strip().splitlines() or ['?'])[-1]}")
    node = ctx.sandboxes()
    with out.progress(f"importing {DEMO_IMAGE}") as (advance, set_total):
        imported = import_image(node.store, guest / "rootfs.ext4", DEMO_IMAGE, progress=advance, on_total=set_total)
    step("import", f"{DEMO_IMAGE}: {human_bytes(imported.size)} rootfs, "
                   f"{human_bytes(imported.new_stored_bytes)} new in the store")
    sid = args.id or f"demo-{os.getpid()}"
    made: list[str] = []
    failures: list[str] = []
    snapshot_id = ""
    try:
        with out.status("booting the demo sandbox"):
            sb = node.boot(DEMO_IMAGE, sid=sid)
        made.append(sid)
        step("boot", f"{sid} answered in {sb.timings['boot']:.1f} s "
                     f"({sb.vm.agent.run('uname -r').output.strip()})")
        sb.vm.agent.run("echo written-before-snapshot > /root/hello; sync; "
                        "(i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done) "
                        ">/dev/null 2>&1 &")
        snapshot_id = node.snapshot(sid)
        t = node.registry.load(sid).timings
        step("snapshot", f"{snapshot_id[:16]} capture {t['capture'] * 1e3:.0f} ms, seal {t['seal'] * 1e3:.0f} ms, "
                         f"publish {t['publish'] * 1e3:.0f} ms")
        started = time.monotonic()
        with out.status(f"forking {args.forks}"):
            forks = node.fork(sid, args.forks)
        made += [f.sid for f in forks]
        step("fork", f"{len(forks)} forks in {time.monotonic() - started:.1f} s: {' '.join(f.sid for f in forks)}")
        for f in forks:
            f.vm.agent.run(f"echo {f.sid} > /root/mine; sync")
        for f in forks:
            seen = f.vm.agent.run("cat /root/hello; cat /root/mine; cat /tmp/counter").output.split()
            if seen[:2] != ["written-before-snapshot", f.sid] or not seen[2:] or not seen[2].isdigit():
                failures.append(f"{f.sid} saw {seen}")
        if sb.vm.agent.run("test -e /root/mine").exit_code == 0:
            failures.append("a fork's file leaked into the source sandbox")
        step("check", "each fork sees the source's file and live counter, writes its own file, "
                      "and nothing leaks between them" if not failures else "; ".join(failures))
    finally:
        if not args.keep:
            for s in reversed(made):
                node.kill(s)
            if made:
                step("cleanup", f"killed {len(made)} sandbox(es)")
    out.result({"steps": [{"step": n, "detail": d} for n, d in steps], "ok": not failures,
                "snapshot": snapshot_id, "sandboxes": made if args.keep else []},
               "demo OK" if not failures else "demo FAILED")
    if failures:
        raise StrataError(f"demo check failed: {failures[0]}")
    return 0


def register(nouns: Any, common: argparse.ArgumentParser) -> None:
    """Add `strata sandbox ...` to the `strata` parser."""
    node = argparse.ArgumentParser(add_help=False, parents=[mount_option()])
    node.add_argument("--guest-dir", metavar="DIR", help="guest kernel + initramfs (env STRATA_GUEST_DIR; "
                                                         "default $STRATA_STATE_DIR/guest)")
    node.add_argument("--vmm", choices=BACKENDS, help="VMM backend (env STRATA_VMM; default qemu)")
    parents = [common, node]

    sandbox = nouns.add_parser("sandbox", help="run microVM sandboxes from images and snapshots")
    sv = sandbox.add_subparsers(dest="verb", metavar="VERB", required=True)
    p = sv.add_parser("boot", parents=parents, help="boot a new sandbox from an image")
    p.add_argument("image", metavar="NAME:TAG")
    p.add_argument("--id", metavar="SID", help="sandbox id (default: a random one)")
    p.add_argument("--memory", type=int, metavar="MIB", help="guest memory (default 256)")
    p.add_argument("--disk-size", type=parse_size, metavar="SIZE",
                   help="a disk larger than the image (e.g. 4G); the guest's root filesystem grows into it")
    _rule_options(p)
    p.set_defaults(func=cmd_boot)
    p = sv.add_parser("restore", parents=parents, help="start a new sandbox from a snapshot (lazily loaded)")
    p.add_argument("snapshot", metavar="SNAPSHOT_ID")
    p.add_argument("--id", metavar="SID")
    _rule_options(p)
    p.set_defaults(func=cmd_restore)
    p = sv.add_parser("network", parents=parents, help="show a sandbox's network; with rule options, replace "
                                                        "its egress rules (applied at its next packet)")
    p.add_argument("sid", metavar="SID")
    _rule_options(p)
    p.set_defaults(func=cmd_network)
    p = sv.add_parser("ls", parents=parents, help="list this node's sandboxes")
    p.set_defaults(func=cmd_ls)
    p = sv.add_parser("exec", parents=parents, help="run a shell command in a sandbox; exits with its code "
                                                       "(255 when strata itself fails)")
    p.add_argument("sid", metavar="SID")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND")
    p.add_argument("--timeout", type=float, default=60.0)
    p.set_defaults(func=cmd_exec, error_exit=EXIT_EXEC_FAILED)
    for verb, func, text in (("pause", cmd_pause, "stop a sandbox's vCPUs"),
                             ("resume", cmd_resume, "continue a paused sandbox")):
        p = sv.add_parser(verb, parents=parents, help=text)
        p.add_argument("sid", metavar="SID")
        p.set_defaults(func=func)
    p = sv.add_parser("snapshot", parents=parents, help="store memory, device state and disk as a snapshot")
    p.add_argument("sid", metavar="SID")
    p.add_argument("--pause", action="store_true", help="leave the sandbox paused afterwards")
    p.set_defaults(func=cmd_snapshot)
    p = sv.add_parser("fork", parents=parents, help="snapshot once and start N copies (the source keeps running)")
    p.add_argument("sid", metavar="SID")
    p.add_argument("-n", "--count", type=int, default=1, help=f"1..{MAX_FORKS} (default 1)")
    p.set_defaults(func=cmd_fork)
    p = sv.add_parser("kill", parents=parents, help="stop sandboxes and drop their upper layers")
    p.add_argument("sid", nargs="*", metavar="SID")
    p.add_argument("--all", action="store_true")
    p.set_defaults(func=cmd_kill)
    p = sv.add_parser("demo", parents=parents, help="build the guest, then boot, snapshot and fork a demo sandbox")
    p.add_argument("--forks", type=int, default=2)
    p.add_argument("--id", metavar="SID")
    p.add_argument("--keep", action="store_true", help="leave the sandboxes running")
    p.set_defaults(func=cmd_demo)


def _rule_options(p: argparse.ArgumentParser) -> None:
    """The egress rule options (vmm/egress.py), the same on every command that takes them."""
    p.add_argument("--allow-out", action="append", metavar="RULE",
                   help="CIDR, IP or domain (example.com, *.example.com) the sandbox may reach; beats --deny-out "
                        "(repeatable)")
    p.add_argument("--deny-out", action="append", metavar="RULE", help="CIDR or IP it may not reach (repeatable)")
    p.add_argument("--internet", dest="internet", action="store_true", default=None,
                   help="allow every address not denied (default: config network.internet)")
    p.add_argument("--no-internet", dest="internet", action="store_false",
                   help="deny every address not allowed")
