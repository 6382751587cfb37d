"""E2B's code interpreter against a real node: `strata template
code-interpreter` builds `code-interpreter-v1` (a Debian root from
mmdebstrap with Jupyter's kernel, vmm/guest/codeinterp/server.py started
and snapshotted warm), and the unchanged `e2b_code_interpreter` SDK runs
code in it through the node's port proxy (`E2b-Sandbox-Port: 49999`,
api/ports.py): results, streams, errors, contexts, pause/resume and forks
keeping the kernel's state, and who gets no access.

The node runs with sandbox networks in a test namespace (tests/netns.py),
as ports need them; the SDK reaches it through a loopback `Forward`. (The
JS SDK's @e2b/code-interpreter is not in the cached JS packages tests/js
uses, and there is no npm registry here: its round trip is not tested.)"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from api.code_interpreter import PACKAGES
from tests.conftest import IN_CI, debian_tar, needs_qemu
from tests.netns import Forward, Lab, start_sdk_runtime
from tests.node_server import API_KEY, NodeServer

pytestmark = [needs_qemu, pytest.mark.slow, pytest.mark.skipif(
    (os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None) and not IN_CI,
    reason="sandbox ports need sandbox networks: root, iproute2 (ip) and nftables (nft)")]

BETA_KEY = "test-beta-key-0001"
CACHE = Path(os.environ.get("STRATA_CODE_INTERPRETER_TAR", "/var/tmp/strata-debian-code-interpreter.tar"))


@dataclass
class Node:
    server: NodeServer
    sdk_url: str  # what the SDK is pointed at (a loopback Forward into the lab)
    built: dict


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, guest: Path) -> Iterator[Node]:
    debian_tar(CACHE, PACKAGES)  # here, not in the lab: the node's namespace has no route to Debian's mirror
    tmp = tmp_path_factory.mktemp("codeinterp")
    lab = Lab(f"c{os.getpid() % 10000}")
    server = forward = None
    try:
        lab.add_node("node")
        start_sdk_runtime()  # the SDK's HTTP threads here, outside the lab
        forward = Forward(lab, "hub")
        with lab.inside("hub"):
            server = NodeServer(tmp, guest, host=lab.addrs["node"],
                                prefix=("nsenter", f"--net=/run/netns/{lab.nodes['node']}", "--"),
                                STRATA_API_KEYS=f"{API_KEY},beta:{BETA_KEY}", STRATA_NETWORK_ENABLED="true",
                                STRATA_NETWORK_POOL="10.201.0.0/26", STRATA_DOMAIN="sandboxes.test",
                                STRATA_SANDBOX_MEMORY="512")
            server.start()
            built = json.loads(server.strata("template", "code-interpreter", "--cache", str(CACHE), "--json").stdout)
            forward.target = (lab.addrs["node"], server.port)
            yield Node(server, f"http://127.0.0.1:{forward.port}", built)
    finally:
        if forward is not None:
            forward.close()
        if server is not None:
            with lab.inside("hub"):
                server.cleanup()
        lab.destroy()


@pytest.fixture
def sdk(node: Node, monkeypatch: pytest.MonkeyPatch) -> type:
    from e2b_code_interpreter import Sandbox

    monkeypatch.setenv("E2B_API_URL", node.sdk_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", node.sdk_url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return Sandbox


def test_the_template_is_built(node: Node, sdk: type, monkeypatch: pytest.MonkeyPatch) -> None:
    assert node.built["template"] == "code-interpreter-v1" and node.built["image"] == "strata-code-interpreter:v1"
    assert {"boot", "start", "snapshot"} <= set(node.built["timings"])
    monkeypatch.setenv("E2B_API_KEY", BETA_KEY)  # another team than the one that built it: it is public
    sbx = sdk.create(timeout=120)
    try:
        assert sbx.run_code("6 * 7").text == "42"
    finally:
        sbx.kill()
    beta = httpx.Client(base_url=node.server.url, headers={"X-API-Key": BETA_KEY}, timeout=60)
    assert beta.delete("/templates/code-interpreter-v1").status_code == 404  # but no team's to remove,
    assert node.server.client.delete("/templates/code-interpreter-v1").status_code == 404  # the builder's included
    r = node.server.client.post("/templates", json={"name": "code-interpreter-v1", "image": "guest:v1"})
    assert r.status_code in (404, 409), r.text  # nor to point elsewhere: it is the store's, not team default's


def test_run_code_keeps_state_streams_output_and_reports_errors(sdk: type) -> None:
    sbx = sdk.create(timeout=300)  # the SDK's default template: code-interpreter-v1
    try:
        first = sbx.run_code("x = 6 * 7\nx")
        assert first.text == "42" and first.error is None and first.results[0].is_main_result
        assert sbx.run_code("x + 1").text == "43"  # state kept across calls

        out, err = [], []
        run = sbx.run_code("import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\nx",
                           on_stdout=out.append, on_stderr=err.append)
        assert [m.line for m in out] == ["to stdout\n"] and [m.line for m in err] == ["to stderr\n"]
        assert run.logs.stdout == ["to stdout\n"] and run.logs.stderr == ["to stderr\n"] and run.text == "42"
        assert run.execution_count is not None and run.execution_count > first.execution_count

        failed = sbx.run_code("1 / 0")
        assert failed.error is not None and failed.error.name == "ZeroDivisionError"
        assert failed.error.value == "division by zero" and "ZeroDivisionError" in failed.error.traceback

        shown = sbx.run_code("from IPython.display import HTML, display\ndisplay(HTML('<b>hi</b>'))\n'done'")
        assert [r.html for r in shown.results if not r.is_main_result] == ["<b>hi</b>"] and shown.text == "done"
        assert sbx.run_code("import os\nprint(os.environ['GREETING'])",
                            envs={"GREETING": "it's \"quoted\""}).logs.stdout == ["it's \"quoted\"\n"]
        assert sbx.run_code("import os\n'GREETING' in os.environ").text == "False"  # for that call only
        assert sbx.commands.run("echo envd works too").stdout == "envd works too\n"  # the same sandbox's envd
    finally:
        sbx.kill()


def test_contexts_create_run_restart_and_remove(sdk: type) -> None:
    sbx = sdk.create(timeout=300)
    try:
        context = sbx.create_code_context(cwd="/tmp")
        assert context.language == "python" and context.cwd == "/tmp"
        assert sbx.run_code("import os\ny = 5\nos.getcwd()", context=context).text == "/tmp"
        assert sbx.run_code("y", context=context).text == "5"
        assert sbx.run_code("y").error.name == "NameError"  # the default context is another kernel
        assert context.id in [c.id for c in sbx.list_code_contexts()]
        sbx.restart_code_context(context)
        assert sbx.run_code("y", context=context).error.name == "NameError"  # a fresh kernel
        sbx.remove_code_context(context)
        assert context.id not in [c.id for c in sbx.list_code_contexts()]
        from e2b import NotFoundException

        with pytest.raises(NotFoundException):
            sbx.run_code("1", context=context)
    finally:
        sbx.kill()


def test_pause_resume_and_fork_keep_the_kernel(sdk: type) -> None:
    sbx = sdk.create(timeout=300)
    forks: list = []
    try:
        sbx.run_code("x = 6 * 7")
        assert sbx.pause()
        sbx = sdk.connect(sbx.sandbox_id, timeout=300)
        assert sbx.run_code("x").text == "42"  # the kernel was in the snapshot

        forks = sbx.fork(count=1)
        fork = forks[0]
        assert not isinstance(fork, Exception), fork
        assert fork.run_code("x").text == "42"
        fork.run_code("x = 1")
        sbx.run_code("x = 2")
        assert (fork.run_code("x").text, sbx.run_code("x").text) == ("1", "2")  # they diverge
    finally:
        for box in [sbx, *forks]:
            if not isinstance(box, Exception):
                box.kill()


def test_who_gets_no_access(sdk: type, node: Node) -> None:
    server = node.server
    public = sdk.create(timeout=300)
    private = sdk.create(timeout=300, network={"allow_public_traffic": False})
    try:
        assert private.run_code("6 * 7").text == "42"  # the SDK sends the traffic token it was given
        execute = f"{server.url}/execute"
        code = {"code": "6 * 7"}

        def ask(sid: str, **headers: str) -> httpx.Response:
            return httpx.post(execute, json=code, timeout=60,
                              headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49999", **headers})

        # running code wants the sandbox's access token (the SDK sends it), by header or by Host
        r = ask(public.sandbox_id)
        assert r.status_code == 401 and "runs code only with its access token" in r.json()["message"], r.text
        by_host = {"Host": f"49999-{public.sandbox_id}.sandboxes.test"}
        for path in ("/execute", "/execute/", "/execute?context_id=x"):
            assert httpx.post(f"{server.url}{path}", json=code, timeout=60, headers=by_host).status_code == 401
        assert httpx.post(f"{server.url}/execute", json=code, timeout=60,
                          headers={**by_host, "X-Access-Token": public._envd_access_token}).status_code == 200
        assert ask(public.sandbox_id, **{"X-Access-Token": public._envd_access_token}).status_code == 200
        assert httpx.get(f"{server.url}/contexts", timeout=60, headers=by_host).status_code == 200  # public, as E2B's
        r = ask(public.sandbox_id, **{"X-Access-Token": "wrong"})
        assert r.status_code == 401 and "access token" in r.json()["message"]
        r = ask(public.sandbox_id, **{"X-Access-Token": private._envd_access_token})  # another sandbox's
        assert r.status_code == 401
        for headers in ({}, {"E2B-Traffic-Access-Token": "wrong"}, {"X-API-Key": BETA_KEY},
                        {"X-API-Key": API_KEY}, {"X-Access-Token": private._envd_access_token}):
            r = ask(private.sandbox_id, **headers)
            assert r.status_code == 403 and "traffic access token" in r.json()["message"], (headers, r.text)
        both = {"E2B-Traffic-Access-Token": private.traffic_access_token}
        assert ask(private.sandbox_id, **both).status_code == 401
        assert ask(private.sandbox_id, **both, **{"X-Access-Token": private._envd_access_token}).status_code == 200
        # another team's key does not even see the sandboxes
        beta = httpx.Client(base_url=server.url, headers={"X-API-Key": BETA_KEY}, timeout=60)
        assert beta.get(f"/sandboxes/{private.sandbox_id}").status_code == 404
        assert beta.post(f"/sandboxes/{public.sandbox_id}/connect", json={"timeout": 60}).status_code == 404

        # an unknown sandbox: the same answer by header as by Host
        by_header = ask("sbnothere0000")
        by_host = httpx.post(f"{server.url}/execute", json=code, timeout=60,
                             headers={"Host": "49999-sbnothere0000.sandboxes.test"})
        assert by_header.status_code == by_host.status_code == 404
        assert by_header.json() == by_host.json()
        assert ask("../../etc").status_code == 404
        # malformed port headers: 400, whatever else the request has
        for port in ("abc", "0", "70000", "+80", "-1", "4999999", "0x50"):
            r = httpx.post(execute, json=code, timeout=60,
                           headers={"E2b-Sandbox-Id": public.sandbox_id, "E2b-Sandbox-Port": port})
            assert r.status_code == 400 and "E2b-Sandbox-Port" in r.json()["message"], (port, r.text)
        r = httpx.post(execute, json=code, timeout=60, headers={"E2b-Sandbox-Port": "49999"})
        assert r.status_code == 400 and "E2b-Sandbox-Id" in r.json()["message"]
        # envd's port by header is the node's own data plane, not a guest port
        r = httpx.post(f"{server.url}/execute", json=code, timeout=60, headers={"E2b-Sandbox-Port": "49983",
                                                                               "E2b-Sandbox-Id": public.sandbox_id})
        assert r.status_code == 401  # the API's answer: no key
    finally:
        public.kill()
        private.kill()


