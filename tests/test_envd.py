"""E2B's data plane (api/envd.py, api/routes/envd.py) through the unchanged
`e2b` SDK against a real `strata serve` and real TCG guests: an agent's loop
of commands and files, background processes, pause/resume and forks; and
the bad requests a data plane gets (no token, another sandbox's token,
malformed Connect bodies, path tricks)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, debian_tar, needs_qemu
from tests.js_sdk import run_js
from tests.memory import peak_rss, reset_peak
from tests.node_server import API_KEY, NodeServer

pytestmark = needs_qemu
PAD_BLOCKS = 16  # 64 MiB files padding the image that is bigger than the node's disk


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, guest: Path) -> Iterator[NodeServer]:
    srv = NodeServer(tmp_path_factory.mktemp("envd"), guest)
    srv.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
    srv.start()
    assert srv.client.post("/templates", json={"name": "base", "image": "guest:v1"}).status_code == 201
    yield srv
    srv.cleanup()
    assert subprocess.run(["pgrep", "-f", str(srv.tmp / "state")], capture_output=True).stdout == b""


@pytest.fixture
def sdk(server: NodeServer, monkeypatch: pytest.MonkeyPatch) -> type:
    from e2b import Sandbox

    monkeypatch.setenv("E2B_API_URL", server.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", server.url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return Sandbox


AGENT_SCRIPT = """\
import os, sys
print("hello from", os.environ.get("ROLE"), os.environ.get("PER_CALL"))
print("to stderr", file=sys.stderr)
"""


def test_an_agent_loop_through_the_sdk(sdk: type) -> None:
    sbx = sdk.create(template="base", timeout=300, envs={"ROLE": "agent"})
    try:
        # files: write a script, list, read, stat, make_dir, rename, remove
        info = sbx.files.write("/root/work/job.sh", "echo hello from $ROLE $PER_CALL\necho to stderr >&2\nexit 3\n")
        assert info.path == "/root/work/job.sh"
        assert [e.name for e in sbx.files.list("/root/work")] == ["job.sh"]
        assert sbx.files.read("/root/work/job.sh").startswith("echo hello")
        assert sbx.files.exists("/root/work/job.sh") and not sbx.files.exists("/root/work/nope")
        assert sbx.files.make_dir("/root/work/out") is True
        assert sbx.files.make_dir("/root/work/out") is False
        sbx.files.rename("/root/work/job.sh", "/root/work/run.sh")
        assert sbx.files.get_info("/root/work/run.sh").size > 0

        # a command: env from create and per call, stdout and stderr apart, the exit code
        from e2b import CommandExitException

        out, err = [], []
        with pytest.raises(CommandExitException) as failed:
            sbx.commands.run("sh /root/work/run.sh", envs={"PER_CALL": "x"}, on_stdout=out.append,
                             on_stderr=err.append)
        assert failed.value.exit_code == 3
        assert "".join(out) == "hello from agent x\n" and "".join(err) == "to stderr\n"
        ok = sbx.commands.run("pwd; echo $HOME", cwd="/tmp")
        assert ok.exit_code == 0 and ok.stdout == "/tmp\n/root\n"

        # a background process: stream its output, list it, send stdin, kill it
        bg = sbx.commands.run("while read line; do echo got $line; done", background=True, stdin=True)
        assert bg.pid in [p.pid for p in sbx.commands.list()]
        sbx.commands.send_stdin(bg.pid, "ping\n")
        seen = ""
        for stdout, _, _ in bg:  # streamed as it comes
            seen += stdout or ""
            if "got ping" in seen:
                break
        assert seen == "got ping\n"
        assert sbx.commands.kill(bg.pid) is True
        assert sbx.commands.kill(bg.pid) is False
        assert bg.pid not in [p.pid for p in sbx.commands.list()]

        # bytes: a binary file both ways, and a missing one
        blob = bytes(range(256)) * 4096
        sbx.files.write("/root/blob.bin", blob)
        assert bytes(sbx.files.read("/root/blob.bin", format="bytes")) == blob
        from e2b import NotFoundException

        with pytest.raises(NotFoundException):
            sbx.files.read("/root/nothing-here")
        sbx.files.remove("/root/work")
        assert not sbx.files.exists("/root/work")
    finally:
        sbx.kill()


def test_files_and_env_survive_pauses_and_forks(sdk: type, server: NodeServer) -> None:
    """E2B's issue #884 lost files after the second resume: here, five."""
    sbx = sdk.create(template="base", timeout=600, envs={"KEPT": "yes"}, metadata={"who": "tester"})
    try:
        for i in range(5):
            sbx.files.write(f"/root/f{i}", f"round {i}")
            sbx.commands.run("sync")
            assert sbx.pause() is True
            sbx = sdk.connect(sbx.sandbox_id, timeout=600)
            assert [sbx.files.read(f"/root/f{j}") for j in range(i + 1)] == [f"round {j}" for j in range(i + 1)]
        assert sbx.commands.run("echo $KEPT").stdout == "yes\n"
        sbx.commands.run("sync")
        forks = sbx.fork(count=4)
        assert all(not isinstance(f, Exception) for f in forks), forks
        assert len({f._envd_access_token for f in forks} | {sbx._envd_access_token}) == 5
        for n, f in enumerate(forks):
            f.files.write("/root/mine", f"fork {n}")
        for n, f in enumerate(forks):
            assert f.files.read("/root/mine") == f"fork {n}"
            assert f.get_info().metadata == {"who": "tester"}
            assert f.files.read("/root/f4") == "round 4"
            assert f.commands.run("echo $KEPT").stdout == "yes\n"
        assert not sbx.files.exists("/root/mine")
        for f in forks:
            f.kill()
    finally:
        sbx.kill()


def _envelope(message: dict) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(data)) + data


def test_the_data_plane_refuses_what_it_should(sdk: type, server: NodeServer) -> None:
    a = sdk.create(template="base", timeout=300)
    b = sdk.create(template="base", timeout=300)
    try:
        url = f"{server.url}/filesystem.Filesystem/Stat"
        good = {"E2b-Sandbox-Id": a.sandbox_id, "X-Access-Token": a._envd_access_token}
        stat = {"path": "/root"}
        assert httpx.post(url, json=stat, headers=good).json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
        for headers in ({"E2b-Sandbox-Id": a.sandbox_id},  # no token
                        {"E2b-Sandbox-Id": a.sandbox_id, "X-Access-Token": b._envd_access_token},  # b's token
                        {"E2b-Sandbox-Id": "sbdeadbeef0000", "X-Access-Token": a._envd_access_token},
                        {"E2b-Sandbox-Id": a.sandbox_id, "X-API-Key": "not-a-key-1234"}):
            r = httpx.post(url, json=stat, headers=headers)
            assert r.status_code == 401 and r.json()["code"] == "unauthenticated", (headers, r.text)
        keyed = {"E2b-Sandbox-Id": a.sandbox_id, "X-API-Key": API_KEY}  # a key of the sandbox's team works too
        assert httpx.post(url, json=stat, headers=keyed).status_code == 200
        assert httpx.post(url, content=b"{not json", headers={**good, "Content-Type": "application/json"}
                          ).json()["code"] == "invalid_argument"
        assert httpx.post(f"{server.url}/filesystem.Filesystem/Nope", json={}, headers=good).status_code == 501
        assert httpx.post(url, json={"path": "../../../../etc/../root/../nope"}, headers=good).status_code == 404
        # a stream with a broken envelope, and one with an unknown pid, end with an error, not a hang
        stream_headers = {**good, "Content-Type": "application/connect+json"}
        r = httpx.post(f"{server.url}/process.Process/Start", content=b"\x00\x00\x00\x10{}", headers=stream_headers)
        assert r.status_code == 200 and b'"invalid_argument"' in r.content
        r = httpx.post(f"{server.url}/process.Process/Connect", content=_envelope({"process": {"pid": 99999}}),
                       headers=stream_headers)
        assert b'"not_found"' in r.content
        # /files: no path, a directory, a path that is not there
        files = f"{server.url}/files"
        assert httpx.get(files, headers=good).status_code == 400
        assert httpx.get(files, params={"path": "/root"}, headers=good).status_code == 400
        assert httpx.get(files, params={"path": "/nope/x"}, headers=good).status_code == 404
        assert httpx.get(files, params={"path": "/etc/hostname"}, headers={"E2b-Sandbox-Id": a.sandbox_id}
                         ).status_code == 401
        # b is untouched by all of this, and still answers
        assert b.commands.run("echo fine").stdout == "fine\n"
    finally:
        a.kill()
        b.kill()


def test_a_process_survives_pause_and_resume_and_the_sandbox_reports_logs_and_metrics(
        sdk: type, server: NodeServer) -> None:
    sbx = sdk.create(template="base", timeout=600)
    try:
        counter = sbx.commands.run("i=0; while true; do echo $i; i=$((i+1)); sleep 0.2; done", background=True)
        seen = ""
        for out, _, _ in counter:
            seen += out or ""
            if seen.count("\n") >= 3:
                break
        counter.disconnect()
        before = [int(x) for x in seen.split()]
        assert sbx.pause() is True
        sbx = sdk.connect(sbx.sandbox_id, timeout=600)
        assert counter.pid in [p.pid for p in sbx.commands.list()]
        later = ""
        for out, _, _ in sbx.commands.connect(counter.pid):
            later += out or ""
            if later.count("\n") >= 4:
                break
        after = [int(x) for x in later.split()]
        assert after[0] > before[-1] and after == list(range(after[0], after[0] + len(after)))
        assert sbx.commands.kill(counter.pid) is True

        sample = sbx.get_metrics()
        assert len(sample) == 1 and sample[0].cpu_count >= 1
        assert 0 < sample[0].mem_used < sample[0].mem_total and 0 < sample[0].disk_used < sample[0].disk_total

        logs = server.client.get(f"/v2/sandboxes/{sbx.sandbox_id}/logs").json()["logs"]
        messages = [entry["message"] for entry in logs]
        for wanted in ("booted from", "paused to the store", "resumed from", f"process {counter.pid} started"):
            assert any(wanted in msg for msg in messages), (wanted, messages)
        newest = server.client.get(f"/v2/sandboxes/{sbx.sandbox_id}/logs",
                                   params={"direction": "backward", "limit": 1}).json()["logs"]
        assert newest == logs[-1:]
        assert server.client.get(f"/sandboxes/{sbx.sandbox_id}/logs").json()["logEntries"] == logs
        assert server.client.get("/sandboxes/sbnotthere00/logs").status_code == 404
    finally:
        sbx.kill()


def test_the_js_sdk_from_npm(server: NodeServer) -> None:
    """The same agent loop with E2B's JavaScript SDK (`e2b` from npm, run by node)."""
    seen = run_js("agent_loop.mjs", {"E2B_API_URL": server.url, "E2B_SANDBOX_URL": server.url,
                                     "E2B_API_KEY": API_KEY})
    assert seen["listed"] == ["job.sh"]
    assert (seen["exitCode"], seen["stdout"], seen["stderr"]) == (4, "hello from js-agent\n", "oops\n")
    assert "tick1\ntick2\ntick3\n" in seen["streamed"]
    assert seen["killed"] is True and seen["exists"] is False
    assert seen["read"].startswith("echo hello from $ROLE")


def test_a_stream_goes_on_across_a_snapshot_without_loss_or_repeats(sdk: type, server: NodeServer) -> None:
    """A snapshot hangs up on the guest agent (vmm/sandbox.py); the node's
    stream re-attaches from the last byte it sent (api/envd.py)."""
    sbx = sdk.create(template="base", timeout=300)
    try:
        counter = sbx.commands.run("i=0; while [ $i -lt 40 ]; do echo $i; i=$((i+1)); sleep 0.1; done",
                                   background=True)
        seen, snapped = "", 0
        for out, _, _ in counter:
            seen += out or ""
            if seen.count("\n") >= 5 * (snapped + 1) and snapped < 2:
                r = server.client.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={})
                assert r.status_code == 201, r.text
                snapped += 1
        assert snapped == 2 and seen == "".join(f"{i}\n" for i in range(40))
    finally:
        sbx.kill()


BAD_MESSAGES = [{}, {"process": "x"}, {"process": {"cmd": 5}}, {"process": {"cmd": "/bin/true", "args": "x"}},
                {"process": {"cmd": "/bin/true", "envs": {"A": 1}}}, {"process": {"pid": "one"}},
                {"process": {"pid": True}}, {"process": {"tag": "nope"}}, {"pty": {"size": {"cols": "wide"}}},
                {"pty": {"size": {"cols": 0, "rows": 0}}}, {"process": {"pid": 1}, "pty": 7}, {"path": 5},
                {"path": "/root", "depth": "deep"}, {"path": "/root", "depth": [1]}, {"signal": "SIGFOO"},
                {"process": {"pid": 1}, "signal": ["x"]}, {"input": {"stdin": "!!"}}, {"watcherId": 7},
                {"source": "/nope", "destination": 3}, {"path": "\x00/etc"}]


def test_malformed_messages_get_clear_errors_never_a_500(sdk: type, server: NodeServer) -> None:
    from api.routes.envd import FILESYSTEM, PROCESS

    sbx = sdk.create(template="base", timeout=300)
    try:
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
            for service, table in (("process.Process", PROCESS), ("filesystem.Filesystem", FILESYSTEM)):
                for method, rpc in table.items():
                    for message in BAD_MESSAGES:
                        if rpc.streaming:
                            r = c.post(f"/{service}/{method}", content=_envelope(message),
                                       headers={"Content-Type": "application/connect+json"}, timeout=10)
                            if b'"start"' in r.content[:64]:  # a message that happens to be valid: a real stream
                                continue
                            assert r.status_code == 200 and b'"code"' in r.content, (method, message, r.content)
                            assert b'"internal"' not in r.content and b'"unknown"' not in r.content, (method, message)
                        else:
                            r = c.post(f"/{service}/{method}", json=message)
                            assert r.status_code < 500 or r.json()["code"] not in ("internal", "unknown"), (
                                method, message, r.text)
        assert sbx.commands.run("echo still fine").stdout == "still fine\n"
    finally:
        sbx.kill()


def busybox_oci(root: Path) -> Path:
    """A container-style image: static busybox and a few of its applets, no
    /sbin/init, an image config with Env and WorkingDir."""
    from tests.oci_images import layer, write_oci

    busybox = Path(shutil.which("busybox") or "/bin/busybox").read_bytes()
    applets = ["sh", "echo", "cat", "ls", "pwd", "id", "sleep", "sync", "head", "true"]
    entries = [("dir", "bin"), ("dir", "etc"), ("dir", "tmp"), ("dir", "root"), ("dir", "work"),
               ("file", "bin/busybox", busybox, 0o755), *[("symlink", f"bin/{a}", "busybox") for a in applets],
               ("file", "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")]
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": ["PATH=/bin", "GREETING=from-the-image"], "WorkingDir": "/work"}}
    return write_oci(root, [layer(entries)], config=config)


def test_an_oci_image_without_an_init_boots_with_its_config(sdk: type, server: NodeServer, tmp_path: Path) -> None:
    """The initramfs injects the agent into any root: here one with no init
    at all, whose Env and WorkingDir apply to every process."""
    server.strata("image", "import", str(busybox_oci(tmp_path / "oci")), "busybox-oci:v1")
    sbx = sdk.create(template="busybox-oci:v1", timeout=300, envs={"EXTRA": "mine"})
    try:
        r = sbx.commands.run("echo $GREETING $EXTRA; pwd; ls /sbin 2>&1; id -u")
        assert r.stdout.splitlines()[:2] == ["from-the-image mine", "/work"]
        assert "No such file" in r.stdout and r.stdout.splitlines()[-1] == "0"
        sbx.files.write("/work/note", "kept")
        sbx.commands.run("sync")
        assert sbx.pause() is True
        sbx = sdk.connect(sbx.sandbox_id, timeout=300)
        assert sbx.files.read("/work/note") == "kept"
        assert sbx.commands.run("echo $GREETING").stdout == "from-the-image\n"
    finally:
        sbx.kill()


def test_a_disk_larger_than_its_image_is_seen_by_the_guest(sdk: type, server: NodeServer) -> None:
    """diskSizeMB on create: the disk is that large and the agent grew the
    root filesystem into it at boot; the space is usable and survives a pause."""
    r = server.client.post("/sandboxes", json={"templateID": "guest:v1", "timeout": 300, "diskSizeMB": 512})
    assert r.status_code == 201, r.text
    sbx = sdk.connect(r.json()["sandboxID"])
    try:
        total_mb = int(sbx.commands.run("df -m / | tail -1").stdout.split()[1])
        assert 450 < total_mb <= 512, total_mb  # the image is 64 MiB
        sbx.commands.run("head -c 200000000 /dev/zero > /root/big; sync")  # more than the image could hold
        assert sbx.pause() is True
        sbx = sdk.connect(sbx.sandbox_id, timeout=300)
        assert sbx.files.get_info("/root/big").size == 200_000_000
        snap = server.client.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={"name": "big-disk"})
        assert snap.status_code == 201, snap.text
    finally:
        sbx.kill()
    too_small = server.client.post("/sandboxes", json={"templateID": "guest:v1", "diskSizeMB": 8})
    assert too_small.status_code == 400 and "disk size" in too_small.json()["message"]
    resized = server.client.post("/sandboxes", json={"templateID": "big-disk", "diskSizeMB": 1024})
    assert resized.status_code == 400 and "booted from an image" in resized.json()["message"]
    restored = sdk.connect(server.client.post("/sandboxes", json={"templateID": "big-disk"}).json()["sandboxID"])
    try:  # a snapshot of the larger disk restores with it
        assert int(restored.commands.run("df -m / | tail -1").stdout.split()[1]) > 450
    finally:
        restored.kill()


def test_a_template_built_with_the_sdk_restores_running(sdk: type, server: NodeServer, tmp_path: Path) -> None:
    """E2B's Template builder against the node: base template, ENV, WORKDIR,
    COPY (uploaded through the signed URL), RUN, a start command waited for
    by its ready command; a sandbox from the template restores it running."""
    from e2b import Template

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "app.sh").write_text("echo built-by-$STAGE\n")
    template = (Template(file_context_path=str(ctx)).from_template("base")
                .set_envs({"STAGE": "template"}).set_workdir("/srv/app")
                .copy("app.sh", "/srv/app/app.sh")
                .run_cmd("sh app.sh > out.txt")
                .set_start_cmd("echo started > /tmp/started; sleep 100000", "test -f /tmp/started"))
    logs: list = []
    Template.build(template, "built-tpl", on_build_logs=logs.append)
    assert any("ready" in str(entry.message) for entry in logs), [str(e.message) for e in logs]
    sbx = sdk.create(template="built-tpl", timeout=300)
    try:
        r = sbx.commands.run("cat out.txt; echo $STAGE; pwd; cat /tmp/started; ps | grep -c 'sleep 100000'")
        lines = r.stdout.split()
        assert lines[:4] == ["built-by-template", "template", "/srv/app", "started"]
        assert int(lines[4]) >= 1  # the start command is still running: restored, not booted
    finally:
        sbx.kill()
    failing = Template().from_template("base").run_cmd("exit 7")
    from e2b import BuildException

    with pytest.raises(BuildException, match="exit status 7"):
        Template.build(failing, "broken-tpl")
    assert server.client.get("/v2/sandboxes").json() == []  # build sandboxes are gone


def test_template_build_on_the_command_line(sdk: type, server: NodeServer, tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_text("copied")
    built = json.loads(server.strata(
        "template", "build", "cli-tpl", "--from", "guest:v1", "--env", "K=v", "--workdir", "/opt",
        "--copy", f"{tmp_path / 'f.txt'}:/opt/f.txt", "--run", "cat f.txt > g.txt", "--start", "sleep 100000",
        "--ready", "true", "--json").stdout)
    assert built["template"] == "cli-tpl" and {"boot", "steps", "start", "snapshot"} <= set(built["timings"])
    assert "cli-tpl" in server.strata("template", "ls").stdout
    sbx = sdk.create(template="cli-tpl", timeout=300)
    try:
        assert sbx.commands.run("cat g.txt; echo; echo $K; pwd").stdout == "copied\nv\n/opt\n"
    finally:
        sbx.kill()
    failed = subprocess.run([str(ROOT / ".venv/bin/strata"), "template", "build", "bad-tpl", "--from", "guest:v1",
                             "--run", "exit 3"], env=server.env, capture_output=True, text=True, timeout=300)
    assert failed.returncode != 0 and failed.stderr.strip().splitlines()[-1].startswith("strata: error: template")
    assert "exit status 3" in failed.stderr


DEBIAN_TAR = Path(os.environ.get("STRATA_DEBIAN_TAR", "/var/tmp/strata-debian-minbase-python3.tar"))


def debian_rootfs() -> Path:
    """Debian 12 minbase + python3 from Debian's packages (mmdebstrap, ~40 s,
    cached like the guest kernel)."""
    return debian_tar(DEBIAN_TAR, ("python3",))


def test_a_debian_image_from_mmdebstrap_boots_and_runs_python(sdk: type, server: NodeServer, tmp_path: Path) -> None:
    """A real distribution as an OCI image: no init of its own, the agent from
    the initramfs serves it, and its python3 runs what the SDK writes."""
    from tests.oci_images import write_oci

    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"], "WorkingDir": "/root"}}
    archive = write_oci(tmp_path / "debian", [debian_rootfs().read_bytes()], config=config)
    server.strata("image", "import", str(archive), "debian:12")
    sbx = sdk.create(template="debian:12", timeout=300)
    try:
        assert sbx.commands.run("cat /etc/debian_version").stdout.startswith("12.")
        sbx.files.write("job.py", "import json, platform\nprint(json.dumps({'py': platform.python_version()}))\n")
        out = sbx.commands.run("python3 job.py").stdout
        assert json.loads(out)["py"].startswith("3.11")
        assert sbx.commands.run("id -un; pwd").stdout == "root\n/root\n"
    finally:
        sbx.kill()


@pytest.mark.slow
def test_a_sandbox_boots_an_image_bigger_than_the_nodes_disk(guest: Path, tmp_path: Path) -> None:
    """The Debian image padded with 1 GiB of real files (1.4 GiB disk) on a
    node whose state (chunk cache, upper layers, sandboxes) sits on a 512 MiB
    loop-mounted ext4: the guest reads every padding byte (checked by hash),
    writes, pauses and resumes, and the cache never passes its 128 MiB cap."""
    import hashlib
    import threading

    import blake3

    from tests.oci_images import padding_layer, write_oci

    small = tmp_path / "small.ext4"
    with open(small, "wb") as f:
        f.truncate(512 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(small)], check=True)
    state = tmp_path / "state-on-small-disk"
    state.mkdir()
    subprocess.run(["mount", "-o", "loop", str(small), str(state)], check=True)
    srv = NodeServer(tmp_path, guest, STRATA_STATE_DIR=str(state), STRATA_CACHE_SIZE="128M")
    done = threading.Event()
    try:
        hashed = hashlib.sha256()

        def pad() -> Iterator[tuple[str, bytes]]:  # 1 GiB, 64 MiB in memory at a time
            yield "pad", b""
            for i in range(PAD_BLOCKS):
                block = blake3.blake3(i.to_bytes(4, "little")).digest(length=64 << 20)
                hashed.update(block)
                yield f"pad/{i:02d}", block

        padding = padding_layer(tmp_path / "padding.tar", pad())
        want = hashed.hexdigest()
        config = {"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/usr/bin:/bin"]}}
        archive = write_oci(tmp_path / "big", [debian_rootfs().read_bytes(), padding], config=config)
        # imported where there is room to unpack it (a build machine, say); the node only serves it
        subprocess.run([str(ROOT / ".venv/bin/strata"), "image", "import", str(archive), "bigdeb:v1"],
                       env={**srv.env, "STRATA_STATE_DIR": str(tmp_path / "build-state")}, check=True,
                       capture_output=True, timeout=900)
        shutil.rmtree(tmp_path / "big")
        disk = json.loads(srv.strata("image", "inspect", "--json", "bigdeb:v1").stdout)["size"]
        assert disk > 2 * os.statvfs(state).f_blocks * os.statvfs(state).f_frsize  # the image dwarfs the node's disk
        srv.start()
        peak = [0]

        def watch_cache() -> None:
            while not done.wait(0.2):
                try:
                    peak[0] = max(peak[0], srv.client.get("/cache").json()["size"])
                except httpx.HTTPError:  # the service stopped under it (a failed test's cleanup)
                    return

        watcher = threading.Thread(target=watch_cache, daemon=True)
        watcher.start()
        r = srv.client.post("/sandboxes", json={"templateID": "bigdeb:v1", "timeout": 900})
        assert r.status_code == 201, (r.text, srv.log.read_text()[-6000:])
        sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
        os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=API_KEY)
        from e2b import Sandbox

        sbx = Sandbox.connect(sid)
        started = time.monotonic()
        got = sbx.commands.run("cat /pad/* | sha256sum", timeout=900).stdout.split()[0]
        took = time.monotonic() - started
        assert got == want
        sbx.files.write("/root/written", "after reading it all")
        sbx.commands.run("sync")
        assert sbx.pause() is True
        sbx = Sandbox.connect(sid, timeout=600)
        assert sbx.files.read("/root/written") == "after reading it all"
        assert sbx.commands.run(f"head -c 1000 /pad/{PAD_BLOCKS - 1:02d} | wc -c").stdout.strip() == "1000"
        done.set()
        watcher.join()
        assert 0 < peak[0] <= 128 << 20, peak[0]
        print(f"disk {disk >> 20} MiB on a {os.statvfs(state).f_blocks * os.statvfs(state).f_frsize >> 20} MiB "
              f"state fs; {PAD_BLOCKS * 64} MiB read and hashed in the guest in {took:.1f} s; cache peak {peak[0] >> 20} MiB")
        assert token  # the data plane was used with the sandbox's own token
        sbx.kill()
    finally:
        done.set()
        srv.stop()
        subprocess.run([str(ROOT / ".venv/bin/strata"), "sandbox", "kill", "--all"], env=srv.env,
                       capture_output=True, timeout=300)
        subprocess.run([str(ROOT / ".venv/bin/strata"), "umount", str(state / "mnt")], env=srv.env,
                       capture_output=True, timeout=60)
        subprocess.run(["umount", str(state)], capture_output=True)


# --- what the data plane reads, and from whom (issue #33, findings 6 and 11) ---------------

HUGE = 20 << 30  # the Content-Length an attacker declares: 20 GiB
SEND_AT_MOST = 256 << 20  # what the test sends of it before it gives up waiting for an answer


@pytest.fixture(scope="module")
def quiet(server: NodeServer) -> Iterator[dict]:
    """A running sandbox of the node's default team, for the requests below."""
    r = server.client.post("/sandboxes", json={"templateID": "base", "timeout": 600})
    assert r.status_code == 201, r.text
    yield r.json()
    server.client.delete(f"/sandboxes/{r.json()['sandboxID']}")


def rss(pid: int) -> int:
    """Resident bytes of process `pid`."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def push_body(port: int, head: bytes, *, at_most: int = SEND_AT_MOST) -> tuple[bytes, int]:
    """Send `head` (a request line and headers declaring a huge body), then
    body bytes until the server answers, hangs up or `at_most` are sent.
    Returns (what the server answered, body bytes sent before that)."""
    import select
    import socket

    block, sent, got = b"\0" * (1 << 20), 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        s.setblocking(False)
        while sent < at_most and not got:
            readable, writable, _ = select.select([s], [s], [], 5)
            if readable:
                try:
                    got = s.recv(65536)
                except ConnectionResetError:
                    break
                if not got:
                    break
            elif writable:
                try:
                    sent += s.send(block)
                except (BrokenPipeError, ConnectionResetError):
                    break
            else:
                break  # neither: the server stopped reading and said nothing
        s.setblocking(True)
        s.settimeout(10)
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return got, sent


def post_head(path: str, headers: dict[str, str | bytes], *, length: int = HUGE, method: str = "POST") -> bytes:
    """A request line and headers as they are, declaring a body of `length` bytes."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", f"Content-Length: {length}".encode()]
    lines += [k.encode() + b": " + (v if isinstance(v, bytes) else v.encode()) for k, v in headers.items()]
    return b"\r\n".join(lines) + b"\r\n\r\n"


@pytest.mark.parametrize("path, kind", [("/filesystem.Filesystem/Stat", "application/json"),
                                        ("/process.Process/Start", "application/connect+json"),
                                        ("/files?path=/root/big", "application/octet-stream")])
def test_an_anonymous_huge_body_is_refused_before_it_is_read(server: NodeServer, quiet: dict, path: str,
                                                              kind: str) -> None:
    """A 20 GiB body without a token: 401 comes back while the client is
    still sending, the connection is closed, and the node's memory does not
    grow with what was sent."""
    assert server.proc is not None
    before = rss(server.proc.pid)
    head = post_head(path, {"E2b-Sandbox-Id": quiet["sandboxID"], "Content-Type": kind})
    got, sent = push_body(server.port, head)
    assert got.startswith(b"HTTP/1.1 401") or b'"unauthenticated"' in got, got[:300]
    assert sent < SEND_AT_MOST, f"the node read {sent >> 20} MiB of an anonymous body and said nothing"
    assert rss(server.proc.pid) - before < 64 << 20


def test_a_body_over_the_message_limit_is_413_before_it_is_read(server: NodeServer, quiet: dict) -> None:
    """With the sandbox's token: a declared Content-Length past the Connect
    message limit is 413 before the body; a chunked body is cut off at the
    limit (413), never buffered whole."""
    good = {"E2b-Sandbox-Id": quiet["sandboxID"], "X-Access-Token": quiet["envdAccessToken"],
            "Content-Type": "application/json"}
    got, sent = push_body(server.port, post_head("/filesystem.Filesystem/Stat", good))
    assert got.startswith(b"HTTP/1.1 413"), got[:300]
    assert sent < SEND_AT_MOST

    def chunks() -> Iterator[bytes]:
        for _ in range(64):  # 64 MiB, chunked: no Content-Length to refuse up front
            yield b" " * (1 << 20)

    r = httpx.post(f"{server.url}/filesystem.Filesystem/Stat", content=chunks(), headers=good, timeout=60)
    assert r.status_code == 413, r.text
    assert httpx.post(f"{server.url}/filesystem.Filesystem/Stat", json={"path": "/root"}, headers=good
                      ).status_code == 200


NON_ASCII = ["é" * 32, "токен-токен-токен", "\u00ff" * 32]


@pytest.mark.parametrize("value", NON_ASCII)
@pytest.mark.parametrize("header", ["X-Access-Token", "X-API-Key"])
def test_a_non_ascii_token_is_401_never_500(server: NodeServer, quiet: dict, header: str, value: str) -> None:
    """A token or key that is not ASCII (sent as UTF-8 or Latin-1 bytes) on
    every data-plane route: refused like any wrong one."""
    import socket

    from tests.attacks.lab import status_of

    for raw_value in (value.encode("utf-8"), value.encode("latin-1", "replace")):
        for path, kind, body in (("/filesystem.Filesystem/Stat", "application/json", b'{"path": "/root"}'),
                                 ("/process.Process/Start", "application/connect+json",
                                  _envelope({"process": {"cmd": "/bin/true"}})),
                                 ("/files?path=/root/x", "application/octet-stream", b"data")):
            head = post_head(path, {"E2b-Sandbox-Id": quiet["sandboxID"], "Content-Type": kind, header: raw_value,
                                "Connection": "close"}, length=len(body))
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
                s.sendall(head + body)
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
            assert status_of(reply) == 401 or b'"unauthenticated"' in reply, (path, reply[:400])
        r = httpx.get(f"{server.url}/files", params={"path": "/etc/hostname"},
                      headers={"E2b-Sandbox-Id": quiet["sandboxID"], header: value.encode()})
        assert r.status_code == 401, r.text


@pytest.mark.parametrize("value", NON_ASCII)
def test_a_non_ascii_user_is_400_and_only_after_the_token(server: NodeServer, quiet: dict, value: str) -> None:
    """`Authorization: Basic` (the SDK's user) that is not ASCII, or base64
    of bytes that are no user name: without the token 401 (the token is
    checked first), with it 400 (a malformed header, or a user the guest
    does not have); never a 500."""
    for raw in (b"Basic " + value.encode(), b"Basic " + base64.b64encode(value.encode("latin-1", "replace")),
                b"Basic " + base64.b64encode(b"\xff\xfe:")):
        headers = {"E2b-Sandbox-Id": quiet["sandboxID"], "Authorization": raw}
        r = httpx.post(f"{server.url}/filesystem.Filesystem/Stat", json={"path": "/root"}, headers=headers)
        assert r.status_code == 401, r.text
        r = httpx.post(f"{server.url}/filesystem.Filesystem/Stat", json={"path": "/root"},
                       headers={**headers, "X-Access-Token": quiet["envdAccessToken"]})
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text


def files_headers(sandbox: dict, kind: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox["sandboxID"], "X-Access-Token": sandbox["envdAccessToken"],
            "Content-Type": kind}


def test_a_form_reaches_the_guest_while_it_is_still_arriving(server: NodeServer, quiet: dict) -> None:
    """A multipart upload goes to the guest a block at a time, never staged
    whole on the node (whose disk a client could otherwise fill with one
    upload, whatever its sandbox's disk): with 8 MiB of a file's part sent
    and the form not finished, the guest already has most of it."""
    boundary = "strata-test-boundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/root/arriving\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    block = bytes(range(256)) * 4096  # 1 MiB
    total = len(head) + 16 * len(block) + len(tail)
    stat = {"path": "/root/arriving"}
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(post_head("/files", files_headers(quiet, f"multipart/form-data; boundary={boundary}"),
                            length=total) + head)
        for _ in range(8):
            s.sendall(block)
        size = 0
        for _ in range(100):  # the guest's copy, while the rest of the form is unsent
            r = httpx.post(f"{server.url}/filesystem.Filesystem/Stat", json=stat,
                           headers=files_headers(quiet, "application/json"), timeout=30)
            size = int(r.json()["entry"]["size"]) if r.status_code == 200 else 0
            if size >= 6 << 20:
                break
            time.sleep(0.1)
        assert size >= 6 << 20, f"the guest had {size} bytes of the 8 MiB sent"
        for _ in range(8):
            s.sendall(block)
        s.sendall(tail)
        reply = s.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    r = httpx.get(f"{server.url}/files", params={"path": "/root/arriving"},
                  headers=files_headers(quiet, "application/octet-stream"), timeout=60)
    assert r.content == block * 16


def test_forms_of_several_files_and_malformed_forms(sdk: type, server: NodeServer, quiet: dict) -> None:
    """Several files in one form each go to their own name (the SDK's
    write_files); a form that is cut short, has no closing boundary or no
    boundary at all, or names ?path= for two files, is a clear 400."""
    sbx = sdk.connect(quiet["sandboxID"])
    infos = sbx.files.write_files([{"path": "/root/many/a", "data": "first"},
                                   {"path": "/root/many/b", "data": b"\x00second"}])
    assert sorted(i.path for i in infos) == ["/root/many/a", "/root/many/b"]
    assert sbx.files.read("/root/many/a") == "first"
    assert bytes(sbx.files.read("/root/many/b", format="bytes")) == b"\x00second"
    url, form = f"{server.url}/files", "multipart/form-data; boundary=b"
    part = b'--b\r\nContent-Disposition: form-data; name="file"; filename="/root/many/c"\r\n\r\ndata\r\n'
    for body, kind, params, says in [
            (part, form, {}, "closing boundary"),
            (part + b"--b--\r\n", "multipart/form-data", {}, "boundary"),
            (part + part.replace(b"/c", b"/d") + b"--b--\r\n", form, {"path": "/root/many/e"}, "names one file"),
            (b"--b\r\n\x00\x01garbage", form, {}, "malformed"),
            (b"--b--\r\n", form, {}, "no file")]:
        r = httpx.post(url, content=body, params=params, headers=files_headers(quiet, kind), timeout=60)
        assert r.status_code == 400 and says in r.text, (body[:40], r.status_code, r.text)


def test_a_gzip_body_is_inflated_a_block_at_a_time(server: NodeServer) -> None:
    """64 MiB of zeros in 64 KiB of gzip: written to the guest whole and
    exact, and the node's peak memory grows by a few blocks, not by what a
    thousandfold chunk inflates to. A corrupt gzip body is a clear 400; a
    file larger than the guest's free space is 507 (the SDK's
    NotEnoughSpaceException), never a 500."""
    import gzip

    r = server.client.post("/sandboxes", json={"templateID": "base", "timeout": 600, "diskSizeMB": 256})
    assert r.status_code == 201, r.text
    try:
        _inflate_rows(server, r.json(), gzip.compress(bytes(64 << 20), compresslevel=9))
    finally:
        server.client.delete(f"/sandboxes/{r.json()['sandboxID']}")


def _inflate_rows(server: NodeServer, quiet: dict, body: bytes) -> None:
    assert server.proc is not None
    pid = server.proc.pid
    reset_peak(pid)
    before = rss(pid)
    headers = {**files_headers(quiet, "application/octet-stream"), "Content-Encoding": "gzip"}
    r = httpx.post(f"{server.url}/files", params={"path": "/root/zeros"}, content=body, headers=headers,
                   timeout=300)
    assert r.status_code == 200, r.text
    assert peak_rss(pid) - before < 24 << 20, f"peak grew {(peak_rss(pid) - before) >> 20} MiB"
    check = server.client.post(f"/sandboxes/{quiet['sandboxID']}/exec", json={
        "command": "cmp -n 67108864 /root/zeros /dev/zero && stat -c %s /root/zeros && rm /root/zeros"},
        timeout=120)
    assert check.json()["output"] == "67108864\n", check.text
    r = httpx.post(f"{server.url}/files", params={"path": "/root/bad"}, content=body[:1000] + b"x" * 1000,
                   headers=headers, timeout=60)
    assert r.status_code == 400 and "gzip" in r.text, r.text
    free = int(server.client.post(f"/sandboxes/{quiet['sandboxID']}/exec", json={
        "command": "df -k /root | awk 'NR==2 {print $4 * 1024}'"}).json()["output"])

    def past_the_disk() -> Iterator[bytes]:
        deflate = zlib.compressobj(1, zlib.DEFLATED, 31)
        for _ in range((free >> 20) + 64):
            yield deflate.compress(bytes(1 << 20))
        yield deflate.flush()

    r = httpx.post(f"{server.url}/files", params={"path": "/root/huge"}, content=past_the_disk(),
                   headers=headers, timeout=600)
    assert r.status_code == 507 and "no space" in r.text, r.text


def test_a_create_retried_with_its_idempotency_key_returns_the_first_sandbox(sdk: type, server: NodeServer) -> None:
    """E2B's Idempotency-Key: the SDK's create retried with the same key
    gives back the sandbox the first made (even when both arrive at once);
    the key with another request is 409; a malformed key is 400; once the
    sandbox is killed the key makes a new one."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        made = list(pool.map(lambda _: sdk.create(template="base", timeout=300, idempotency_key="job-7"), range(2)))
    try:
        assert made[0].sandbox_id == made[1].sandbox_id
        again = httpx.post(f"{server.url}/v2/sandboxes", headers={"X-API-Key": API_KEY, "Idempotency-Key": "job-7"},
                           json={"templateID": "base", "timeout": 300}, timeout=120)
        assert again.status_code == 201 and again.json()["sandboxID"] == made[0].sandbox_id
        assert again.headers["Idempotent-Replayed"] == "true"
        other = httpx.post(f"{server.url}/v2/sandboxes", headers={"X-API-Key": API_KEY, "Idempotency-Key": "job-7"},
                           json={"templateID": "base", "timeout": 60}, timeout=120)
        assert other.status_code == 409 and "different request" in other.text
        bad = httpx.post(f"{server.url}/v2/sandboxes", headers={"X-API-Key": API_KEY, "Idempotency-Key": "Job_7"},
                         json={"templateID": "base"}, timeout=120)
        assert bad.status_code == 400 and "Idempotency-Key" in bad.text
        listed = [s["sandboxID"] for s in server.client.get("/v2/sandboxes").json()]
        assert listed.count(made[0].sandbox_id) == 1
    finally:
        made[0].kill()
    fresh = sdk.create(template="base", timeout=300, idempotency_key="job-7")
    try:
        assert fresh.sandbox_id != made[0].sandbox_id
    finally:
        fresh.kill()
