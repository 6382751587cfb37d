"""Network namespaces a test creates (and removes): a hub with a bridge, and
one namespace per node wired to it by a veth pair. Nothing touches the host's
own namespace: the test thread enters the hub with setns(2) to talk to the
nodes, and processes start inside a namespace through `ip netns exec`. A
client whose connections come from threads the test does not own (the E2B
SDK's HTTP runtime) goes through a `Forward`: a loopback port here relayed
into a namespace. Such threads live in the namespace of the thread that
started them (a new thread inherits its creator's), so the SDK's runtime is
started here, outside every namespace, by `start_sdk_runtime`."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vmm.domain_gate import _relay as relay

CLONE_NEWNET = 0x40000000


def ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


class Lab:
    """hub (bridge br0, 10.99.0.1/24) + nodes NAME at 10.99.0.<10+i>/24."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.hub = f"st-{tag}-hub"
        self.nodes: dict[str, str] = {}  # name -> netns
        self.addrs: dict[str, str] = {"hub": "10.99.0.1"}
        ip("netns", "add", self.hub)
        ip("-n", self.hub, "link", "set", "lo", "up")
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "addr", "add", "10.99.0.1/24", "dev", "br0")
        ip("-n", self.hub, "link", "set", "br0", "up")

    def add_node(self, name: str) -> str:
        ns = f"st-{self.tag}-{name}"
        addr = f"10.99.0.{10 + len(self.nodes) + 1}"
        ip("netns", "add", ns)
        ip("-n", ns, "link", "set", "lo", "up")
        inside, outside = f"v{name}", f"h{name}"
        ip("-n", ns, "link", "add", inside, "type", "veth", "peer", "name", outside, "netns", self.hub)
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inside)
        ip("-n", ns, "link", "set", inside, "up")
        ip("-n", self.hub, "link", "set", outside, "master", "br0")
        ip("-n", self.hub, "link", "set", outside, "up")
        self.nodes[name], self.addrs[name] = ns, addr
        return ns

    def cut(self, name: str) -> None:
        """Unplug a node from the hub (its processes keep running)."""
        ip("-n", self.hub, "link", "set", f"h{name}", "down")

    def prefix(self, name: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.nodes[name] if name != "hub" else self.hub)

    @contextmanager
    def inside(self, name: str = "hub") -> Iterator[None]:
        """Run this thread's network calls inside a namespace (setns(2) is per thread)."""
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{self.nodes.get(name, self.hub)}", os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns")
            yield
        finally:
            libc.setns(own, CLONE_NEWNET)
            os.close(own)
            os.close(target)

    def destroy(self) -> None:
        for ns in [*self.nodes.values(), self.hub]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def start_sdk_runtime() -> None:
    """Start the E2B SDK's HTTP runtime with its threads in this thread's namespace, and check they are.

    The SDK (2.63 on) sends all its HTTP through pyqwest, whose tokio worker threads make every
    connection. pyqwest starts them once per process, when the first transport is built, from the
    thread building it: they inherit that thread's namespace and keep it for good. A test whose first
    SDK call comes from inside `Lab.inside` would have them connect from the hub (and every later
    SDK test with them); one that ran after another SDK test would have them here. Call this before
    entering a namespace, so they are here whichever test runs first."""
    from e2b.api.client_sync import get_pyqwest_transport

    get_pyqwest_transport(None)  # the SDK's shared pool: building it starts pyqwest's runtime
    here = os.readlink(f"/proc/self/task/{threading.get_native_id()}/ns/net")
    workers = {task.name: os.readlink(task / "ns/net") for task in Path("/proc/self/task").iterdir()
               if (task / "comm").read_text().startswith("tokio-rt")}
    assert workers, "no pyqwest runtime threads after building the E2B SDK's transport"
    elsewhere = {tid: ns for tid, ns in workers.items() if ns != here}
    assert not elsewhere, (f"the E2B SDK's HTTP threads {elsewhere} are not in this thread's namespace {here}: "
                           "the SDK was first used from inside a test namespace in this process")


class Forward:
    """127.0.0.1:`port` in the namespace that creates it, each connection
    relayed to `target` (host, port) from inside namespace `name` of `lab`.
    Create it before entering a namespace; set `target` once known. Its
    clients' threads must live in that namespace too: for the E2B SDK, call
    `start_sdk_runtime` there first."""

    def __init__(self, lab: Lab, name: str) -> None:
        self.lab, self.name = lab, name
        self.target: tuple[str, int] | None = None
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()  # a thread of this namespace

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            assert self.target is not None, "Forward.target was never set"
            with self.lab.inside(self.name):  # the new socket belongs to the namespace it is made in
                upstream = socket.create_connection(self.target, timeout=10)
        except (OSError, AssertionError):
            client.close()
            return
        relay(client, upstream)  # both ways until both sides are done
        client.close()
        upstream.close()

    def close(self) -> None:
        self.listener.close()

