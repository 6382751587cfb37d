"""Sandbox networks with real guests in real namespaces: a node in a test
namespace on a hub bridge, two web hosts (namespaces) beside it, guests
that reach one and not the other by CIDR and by domain, rules changed live,
sandboxes that cannot reach each other or the node, forks, pause/resume,
and nothing left after kill. No traffic leaves the test's namespaces."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import IN_CI, ROOT, needs_qemu
from tests.netns import Lab
from tests.node_server import API_KEY, NodeServer

pytestmark = [needs_qemu, pytest.mark.slow, pytest.mark.skipif(
    (os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None) and not IN_CI,
    reason="sandbox networks need root, iproute2 (ip) and nftables (nft)")]

WEB = "http://{}:8000/"


def guest_run(node: NodeServer, sid: str, command: str, *, ok: bool = True) -> str:
    r = node.client.post(f"/sandboxes/{sid}/exec", json={"command": command, "timeout": 60})
    assert r.status_code == 200, r.text
    if ok:
        assert r.json()["exitCode"] == 0, (command, r.json())
    return r.json()["output"].strip() if ok else str(r.json()["exitCode"])


def fetch(node: NodeServer, sid: str, url: str, *, wait: int = 4) -> str | None:
    """What the guest gets from `url`, None if it cannot within `wait` s (a
    denied packet is dropped: the wait is what a refusal costs, so checks that
    expect one wait 2 s). (busybox 1.35's wget crashes on -T, hence timeout(1).)"""
    r = node.client.post(f"/sandboxes/{sid}/exec",
                         json={"command": f"timeout {wait} wget -q -O - {url}", "timeout": 60})
    assert r.status_code == 200, r.text
    return r.json()["output"].strip() if r.json()["exitCode"] == 0 else None


def counter_server(lab: Lab, where: str, port: int) -> list[int]:
    """A TCP server in namespace `where` counting the bytes its one client sends."""
    received = [0]
    with lab.inside(where):
        server = socket.create_server((lab.addrs[where], port))
    server.settimeout(120)

    def run() -> None:
        with server:
            conn, _ = server.accept()
            conn.settimeout(120)
            with conn:
                while True:
                    try:
                        data = conn.recv(4096)
                    except OSError:
                        return
                    if not data:
                        return
                    received[0] += len(data)

    threading.Thread(target=run, daemon=True).start()
    return received


def leftovers(lab: Lab, node: NodeServer, sids: list[str]) -> list[str]:
    """Every trace of these sandboxes' networks: namespaces, links, leases."""
    found = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
             if ns in {f"strata-{s}" for s in sids}]
    links = subprocess.run([*lab.prefix("node"), "ip", "-o", "link"], capture_output=True, text=True).stdout
    found += [line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if ": stv" in line]
    slots = node.tmp / "state" / "network" / "slots"
    found += [f"lease {p.name}" for p in slots.iterdir()] if slots.exists() else []
    return found


def test_sandbox_networks(guest: Path, tmp_path: Path) -> None:
    lab = Lab(f"n{os.getpid() % 10000}")
    servers: list[subprocess.Popen] = []
    node = None
    try:
        for name in ("node", "web1", "web2"):
            lab.add_node(name)
        for name in ("web1", "web2"):
            root = tmp_path / name
            root.mkdir()
            (root / "index.html").write_text(f"this is {name}")
            for port in ("8000", "80"):
                servers.append(subprocess.Popen([*lab.prefix(name), sys.executable, "-m", "http.server", "--bind",
                                                 lab.addrs[name], "--directory", str(root), port],
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        web1, web2 = lab.addrs["web1"], lab.addrs["web2"]
        # nsenter, not `ip netns exec`: the node keeps the host's mount namespace, as in production, so
        # the namespaces it makes for its sandboxes are visible to this test
        node = NodeServer(tmp_path / "node", guest, host=lab.addrs["node"],
                          prefix=("nsenter", f"--net=/run/netns/{lab.nodes['node']}", "--"),
                          STRATA_NETWORK_ENABLED="true", STRATA_NETWORK_POOL="10.201.0.0/29",
                          STRATA_DOMAIN="sandboxes.test", STRATA_NETWORK_MAX_CONNECTIONS="8",
                          # the web hosts are in 10/8, blocked by default: opened, the node (.11) and hub are not
                          STRATA_NETWORK_OPEN=f"{web1}/31",
                          STRATA_NETWORK_HOSTS=f"web1.test={web1},web2.test={web2},api.web1.test={web1}",
                          STRATA_NETWORK_UPSTREAM_DNS=lab.addrs["hub"])  # nothing answers there
        node.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
        with lab.inside("hub"):
            node.start()
            _check(lab, node, web1, web2)
    finally:
        if node is not None:
            with lab.inside("hub"):
                node.cleanup()
        for server in servers:
            server.kill()
            server.wait()
        lab.destroy()


def _check(lab: Lab, node: NodeServer, web1: str, web2: str) -> None:
    c = node.client
    # bad rules: 400 naming the rule, nothing made
    r = c.post("/sandboxes", json={"templateID": "guest:v1", "network": {"denyOut": ["10.0.0.300"]}})
    assert r.status_code == 400 and "10.0.0.300" in r.json()["message"], r.text
    r = c.post("/sandboxes", json={"templateID": "guest:v1", "network": {"allowOut": ["exa mple.com"]}})
    assert r.status_code == 400 and "exa mple.com" in r.json()["message"], r.text
    assert c.get("/sandboxes").json() == [] and leftovers(lab, node, []) == []

    a = c.post("/sandboxes", json={"templateID": "guest:v1", "allow_internet_access": False,
                                   "network": {"allowOut": [web1]}}).json()["sandboxID"]
    created = c.post("/sandboxes", json={"templateID": "guest:v1", "network": {"allowPublicTraffic": False}}).json()
    b, b_token = created["sandboxID"], created["trafficAccessToken"]
    assert b_token and created["domain"] == "sandboxes.test"
    # the /29 pool holds two: a third is refused whole
    r = c.post("/sandboxes", json={"templateID": "guest:v1"})
    assert r.status_code == 429 and "no free address" in r.json()["message"], r.text
    assert sorted(s["sandboxID"] for s in c.get("/sandboxes").json()) == sorted([a, b])
    assert len(leftovers(lab, node, [])) == 4  # a's and b's link and lease, no more

    # a: web1 by CIDR, not web2; names come from the node's resolver
    assert web2 in guest_run(node, a, "nslookup web2.test")
    assert fetch(node, a, WEB.format(web1)) == "this is web1"
    assert fetch(node, a, WEB.format(web2), wait=2) is None
    detail = c.get(f"/sandboxes/{a}").json()
    assert detail["allow_internet_access"] is False and detail["network"]["allowOut"] == [f"{web1}/32"]
    a_addr = detail["network"]["address"]

    # a rule changed live stops an open connection at its next packet
    ticks = counter_server(lab, "web1", 9000)
    guest_run(node, a, f"setsid sh -c 'while true; do echo tick; sleep 0.2; done | nc {web1} 9000' "
                       ">/dev/null 2>&1 &")
    _wait(lambda: ticks[0] > 20, "the guest's connection to carry data")
    assert c.put(f"/sandboxes/{a}/network", json={"allowOut": []}).status_code == 204
    time.sleep(1.0)
    stopped = ticks[0]
    time.sleep(2.0)
    assert ticks[0] == stopped, "data kept flowing after the rule was removed"
    # a bad update changes nothing
    r = c.put(f"/sandboxes/{a}/network", json={"allowOut": ["300.1.1.1"]})
    assert r.status_code == 400 and "300.1.1.1" in r.json()["message"]
    assert c.get(f"/sandboxes/{a}").json()["network"]["allowOut"] == []

    # domains: allowed through the resolver's answers, not before
    assert c.put(f"/sandboxes/{a}/network", json={"allowOut": ["web2.test", "*.web1.test"]}).status_code == 204
    assert fetch(node, a, WEB.format(web2), wait=2) is None  # nobody asked for web2.test yet
    assert fetch(node, a, WEB.format("web2.test")) == "this is web2"
    assert fetch(node, a, WEB.format(web1), wait=2) is None  # nobody asked for a name of web1's yet
    assert fetch(node, a, WEB.format("api.web1.test")) == "this is web1"
    # port 80 and 443 pass the domain gate, which goes by the name asked for, not the address dialled
    assert fetch(node, a, "http://web2.test/") == "this is web2"
    assert fetch(node, a, f"--header 'Host: other.test' http://{web2}/", wait=2) is None
    assert fetch(node, a, f"--header 'Host: web2.test' http://{web1}/") == "this is web2"

    # sandboxes cannot reach each other or the node, only the world
    guest_run(node, a, "mkdir -p /tmp/www && echo served-by-a > /tmp/www/index.html && "
                       "busybox httpd -p 7000 -h /tmp/www")
    with lab.inside("node"):  # the node itself reaches a's ports at a's address
        assert httpx.get(f"http://{a_addr}:7000/", timeout=10).text.strip() == "served-by-a"
    _ports(node, a)
    assert fetch(node, b, f"http://{a_addr}:7000/", wait=2) is None
    assert fetch(node, b, WEB.format(web1)) == "this is web1"
    assert fetch(node, b, f"http://{lab.addrs['node']}:{node.port}/health", wait=2) is None
    assert fetch(node, b, f"http://10.201.0.1:{node.port}/health", wait=2) is None
    assert fetch(node, b, "http://169.254.169.254/", wait=2) is None

    assert c.delete(f"/sandboxes/{a}").status_code == 204
    assert len(leftovers(lab, node, [a])) == 2  # b's link and lease; nothing of a's

    # the same through the unchanged E2B SDK: rules on create, update_network. In a process of its
    # own in the hub's namespace: the SDK's HTTP runtime keeps threads made wherever it first ran.
    script = f"""
from e2b import Sandbox
sbx = Sandbox.create(template="guest:v1", allow_internet_access=False, network={{"allow_out": ["{web2}"]}})
print(sbx.sandbox_id, flush=True)
assert sbx.commands.run("timeout 4 wget -q -O - {WEB.format(web2)}").stdout.strip() == "this is web2"
input()  # the test checks web1 is denied
sbx.update_network({{"allow_out": ["{web1}"]}})
print("updated", flush=True)
"""
    sdk = subprocess.Popen([*lab.prefix("hub"), sys.executable, "-c", script], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "E2B_API_URL": node.url, "E2B_SANDBOX_URL": node.url,
                                "E2B_API_KEY": API_KEY})
    try:
        assert sdk.stdout is not None and sdk.stdin is not None
        sid = sdk.stdout.readline().strip()
        assert sid.startswith("sb"), sid
        assert fetch(node, sid, WEB.format(web1), wait=2) is None
        sdk.stdin.write("\n")
        sdk.stdin.flush()
        assert sdk.stdout.readline().strip() == "updated"
        assert sdk.wait(timeout=120) == 0
    finally:
        if sdk.poll() is None:
            sdk.kill()
    assert fetch(node, sid, WEB.format(web1)) == "this is web1"
    assert fetch(node, sid, WEB.format(web2), wait=2) is None
    assert c.delete(f"/sandboxes/{sid}").status_code == 204

    # b's ports need its traffic token
    guest_run(node, b, "mkdir -p /tmp/www && echo served-by-b > /tmp/www/index.html && "
                       "busybox httpd -p 7000 -h /tmp/www")
    port_url, host = f"http://{lab.addrs['node']}:{node.port}/", f"7000-{b}.sandboxes.test"
    r = httpx.get(port_url, headers={"Host": host}, timeout=30)
    assert r.status_code == 403 and "traffic access token" in r.json()["message"]
    r = httpx.get(port_url, headers={"Host": host, "e2b-traffic-access-token": "wrong"}, timeout=30)
    assert r.status_code == 403
    r = httpx.get(port_url, headers={"Host": host, "e2b-traffic-access-token": b_token}, timeout=30)
    assert r.status_code == 200 and r.text.strip() == "served-by-b"

    # pause and resume: the guest's network is back
    assert c.post(f"/sandboxes/{b}/pause").status_code == 204
    assert c.post(f"/sandboxes/{b}/resume", json={}).status_code == 201
    assert fetch(node, b, WEB.format("web1.test")) == "this is web1"
    sample = c.get(f"/sandboxes/{b}/metrics").json()[0]
    assert sample["netSentBytes"] > 0 and sample["netReceivedBytes"] > 0, sample
    scraped = node.admin.get("/metrics").text
    assert f'strata_sandbox_network_bytes{{direction="received",sandbox="{b}"}}' in scraped

    # a fork: its own address, the same reach
    r = c.post(f"/sandboxes/{b}/fork", json={"count": 1})
    assert r.status_code == 201, r.text
    f = r.json()[0]["sandbox"]["sandboxID"]
    b_addr = c.get(f"/sandboxes/{b}").json()["network"]["address"]
    f_addr = c.get(f"/sandboxes/{f}").json()["network"]["address"]
    assert f_addr and b_addr and f_addr != b_addr
    assert fetch(node, f, WEB.format(web2)) == "this is web2"
    assert fetch(node, b, WEB.format(web2)) == "this is web2"

    _cli(node, f, f_addr, web1, web2)
    _connection_limit(lab, node, b)

    # a VM that dies while the node is down: the restarted node removes its network, keeps the others
    node.stop()
    pid = _pid(node, f)
    os.kill(pid, 9)
    with lab.inside("hub"):
        node.start()
    assert c.get(f"/sandboxes/{f}").json()["state"] == "paused"
    assert sorted(leftovers(lab, node, [a, b, f])) == sorted([f"strata-{b}", "stv0", "lease 0"])
    assert fetch(node, b, WEB.format(web1)) == "this is web1"

    for sid in (b, f):
        assert c.delete(f"/sandboxes/{sid}").status_code == 204
    assert leftovers(lab, node, [a, b, f]) == []
    print(json.dumps({"a": a_addr, "b": b_addr, "fork": f_addr}))


def _connection_limit(lab: Lab, node: NodeServer, sid: str) -> None:
    """network.max_connections = 8: twelve held connections, at most eight get through."""
    accepted: list[socket.socket] = []
    with lab.inside("web1"):
        server = socket.create_server((lab.addrs["web1"], 9100), backlog=64)
    server.settimeout(0.5)
    guest_run(node, sid, f"for i in $(seq 12); do setsid sh -c 'sleep 20 | nc {lab.addrs['web1']} 9100' "
                         ">/dev/null 2>&1 & done")
    deadline = time.monotonic() + 8
    with server:
        while time.monotonic() < deadline:
            try:
                accepted.append(server.accept()[0])
            except (TimeoutError, socket.timeout):
                continue
    for conn in accepted:
        conn.close()
    assert 1 <= len(accepted) <= 8, len(accepted)


def _pid(node: NodeServer, sid: str) -> int:
    record = json.loads((node.tmp / "state" / "sandboxes" / sid / "sandbox.json").read_text())
    return int(record["pid"])


def _cli(node: NodeServer, sid: str, address: str, web1: str, web2: str) -> None:
    """`strata sandbox network` beside the node."""
    cli = [str(ROOT / ".venv/bin/strata"), "sandbox", "network", sid]
    r = subprocess.run([*cli, "--json"], env=node.env, capture_output=True, text=True, timeout=60)
    info = json.loads(r.stdout)
    assert info["address"] == address and info["internet"] is True and info["counters"]["sent_bytes"] > 0, info
    r = subprocess.run([*cli, "--no-internet", "--allow-out", web1], env=node.env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "internet denied" in r.stdout and web1 in r.stdout, r.stderr
    assert fetch(node, sid, WEB.format(web2), wait=2) is None
    assert fetch(node, sid, WEB.format(web1)) == "this is web1"
    r = subprocess.run([*cli, "--deny-out", "10.0.0.0/33"], env=node.env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "10.0.0.0/33" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert node.client.get(f"/sandboxes/{sid}").json()["network"]["allowOut"] == [f"{web1}/32"]  # unchanged


WS_SERVER = r"""key=""
while IFS= read -r line; do
  line=$(printf %s "$line" | tr -d '\r')
  [ -z "$line" ] && break
  case "$line" in [Ss]ec-[Ww]eb[Ss]ocket-[Kk]ey:*) key=$(printf %s "${line#*:}" | tr -d ' ') ;; esac
done
accept=$(printf %s "${key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11" | sha1sum | cut -d' ' -f1 | xxd -r -p | base64)
printf 'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n'
printf 'Sec-WebSocket-Accept: %s\r\n\r\n' "$accept"
printf '\201\024hello from the guest'
sleep 3
"""


def _ports(node: NodeServer, sid: str) -> None:
    """a's port 7000 (busybox httpd) through the node's port proxy, by Host;
    a WebSocket one (a shell script speaking RFC 6455's handshake) on 7002."""
    url = f"http://{node.host}:{node.port}/"
    r = httpx.get(url, headers={"Host": f"7000-{sid}.sandboxes.test"}, timeout=30)  # no API key: a public URL
    assert r.status_code == 200 and r.text.strip() == "served-by-a", r.text
    r = httpx.get(url, headers={"Host": f"7001-{sid}.sandboxes.test"}, timeout=30)
    assert r.status_code == 502 and "port 7001" in r.json()["message"]
    r = httpx.get(url, headers={"Host": "7000-sbnosuchthing.sandboxes.test"}, timeout=30)
    assert r.status_code == 404
    assert httpx.get(f"{url}health", timeout=30).status_code == 200  # other hosts: the API as before

    guest_run(node, sid, f"cat > /tmp/ws.sh <<'EOF'\n{WS_SERVER}EOF\nsetsid nc -l -p 7002 -e sh /tmp/ws.sh "
                         ">/dev/null 2>&1 &")
    time.sleep(0.5)
    with socket.create_connection((node.host, node.port), timeout=30) as conn:
        conn.sendall(f"GET /chat HTTP/1.1\r\nHost: 7002-{sid}.sandboxes.test\r\nUpgrade: websocket\r\n"
                     "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     "Sec-WebSocket-Version: 13\r\n\r\n".encode())
        reply = b""
        while b"hello from the guest" not in reply:
            block = conn.recv(4096)
            assert block, reply
            reply += block
    assert reply.startswith(b"HTTP/1.1 101") and b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in reply  # RFC 6455's example


def _wait(check, what: str, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
