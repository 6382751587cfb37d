"""The fault matrix: real processes killed, a real object store taken away,
at random points, and what a user sees afterwards.

Each test injects faults the way they happen in production (SIGKILL of a
process, the SeaweedFS server vanishing mid-request) at random moments, then
checks the two promises: the user gets a clear error, never wrong data; and
nothing that was committed before the fault is lost (every byte read back
and compared). The figures (faults injected, bytes verified, 5xx answers)
add up in `fault_ledger` and are printed at the end of the run; tests/README.md's
fault matrix quotes them and names the tests covering the other rows
(corrupt chunks, full cache disk, lying peers, guest floods, teams).

The seed of each test's random schedule is printed on failure (STRATA_FAULT_SEED
replays one).
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import IN_CI, seaweed_env
from tests.images import MiB
from tests.seaweedfs_server import SeaweedFS, find_weed
from tests.test_cli import run, strata_cmd
from tests.test_fusefs_mount import Mount

pytestmark = pytest.mark.skipif(find_weed() is None and not IN_CI, reason="SeaweedFS binary `weed` not installed")

IMAGE_MIB = 48  # random bytes: every chunk distinct, so a push has work to be interrupted in


@pytest.fixture
def weed(tmp_path: Path) -> Iterator[SeaweedFS]:
    """A SeaweedFS of this test's own, so the test can take it away and bring it back."""
    server = SeaweedFS(tmp_path / "weed").start()
    server.create_bucket("faults")
    try:
        yield server
    finally:
        server.stop()


def _image(path: Path, rng: random.Random, mib: int = IMAGE_MIB) -> bytes:
    data = rng.randbytes(mib * MiB)
    path.write_bytes(data)
    return data


def _remote(weed: SeaweedFS) -> tuple[str, dict[str, str]]:
    return f"s3://faults/{uuid.uuid4().hex[:10]}", seaweed_env(weed)


def _refs(store: str, env: dict[str, str]) -> list[str]:
    r = run(["image", "ls", "--json"], {**env, "STRATA_STORE": store})
    assert r.returncode == 0, r.stderr
    return [row["ref"] for row in json.loads(r.stdout)]


def _read_back(store: str, env: dict[str, str], ref: str, out: Path) -> bytes:
    """Export through the store's verified read path (every chunk re-hashed)."""
    out.unlink(missing_ok=True)
    r = run(["image", "export", ref, str(out)], {**env, "STRATA_STORE": store})
    assert r.returncode == 0, r.stderr
    return out.read_bytes()


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "AWS_"))} | env
    return subprocess.Popen(strata_cmd() + args, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _push_seconds(local: dict[str, str], weed: SeaweedFS) -> float:
    """How long a whole push takes here, process start to exit: kills are
    scheduled inside that window (to a scratch prefix, so the real target
    starts empty)."""
    remote, env = _remote(weed)
    began = time.monotonic()
    r = run(["push", "a:1", "--to", remote], {**local, **env})
    assert r.returncode == 0, r.stderr
    return time.monotonic() - began


def _one_clear_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata: error:"), stderr
    return lines[0]


def test_push_killed_at_random_points_publishes_all_or_nothing(tmp_path: Path, weed: SeaweedFS,
                                                              rng: random.Random,
                                                              fault_ledger: dict[str, int]) -> None:
    local = {"STRATA_STORE": str(tmp_path / "local"), "STRATA_STATE_DIR": str(tmp_path / "state")}
    data = _image(tmp_path / "a.img", rng)
    assert run(["image", "import", str(tmp_path / "a.img"), "a:1"], local).returncode == 0
    window = _push_seconds(local, weed)
    remote, env = _remote(weed)
    for attempt in range(5):
        push = _start(["push", "a:1", "--to", remote, "--json"], {**local, **env})
        time.sleep(rng.uniform(0.1, 1.0) * window)
        os.killpg(push.pid, signal.SIGKILL)
        push.communicate(timeout=30)
        fault_ledger["faults injected"] += 1
        if "a:1" in _refs(remote, env):  # finished before the kill: then it must be whole
            assert _read_back(remote, env, "a:1", tmp_path / "out") == data, f"attempt {attempt}"
            fault_ledger["bytes verified"] += len(data)
    r = run(["push", "a:1", "--to", remote, "--json"], {**local, **env})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["chunks_total"] == IMAGE_MIB
    assert _read_back(remote, env, "a:1", tmp_path / "out") == data
    fault_ledger["bytes verified"] += len(data)
    verify = run(["verify", "--json"], {**env, "STRATA_STORE": remote})
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_store_lost_mid_push_fails_clearly_then_resumes(tmp_path: Path, weed: SeaweedFS, rng: random.Random,
                                                        fault_ledger: dict[str, int]) -> None:
    local = {"STRATA_STORE": str(tmp_path / "local"), "STRATA_STATE_DIR": str(tmp_path / "state")}
    data = _image(tmp_path / "a.img", rng)
    assert run(["image", "import", str(tmp_path / "a.img"), "a:1"], local).returncode == 0
    window = _push_seconds(local, weed)
    for attempt in range(6):  # a push can outrun its estimate: aim earlier until the fault lands mid-push
        remote, env = _remote(weed)
        push = _start(["push", "a:1", "--to", remote, "--json"], {**local, **env})
        time.sleep(rng.uniform(0.6, 0.85) * window * 0.6 ** attempt)  # past start-up, before the end
        weed.stop(crash=True)
        fault_ledger["faults injected"] += 1
        out, err = push.communicate(timeout=300)
        if push.returncode != 0:
            break
        weed.restart()
    assert push.returncode != 0, f"every push finished before the store went away ({out})"
    line = _one_clear_line(err)
    assert "cannot reach" in line or "unavailable" in line, line
    weed.restart()
    assert _refs(remote, env) == []  # nothing named: the ref is written last
    r = run(["push", "a:1", "--to", remote, "--json"], {**local, **env})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["chunks_sent"] <= IMAGE_MIB
    assert _read_back(remote, env, "a:1", tmp_path / "out") == data
    fault_ledger["bytes verified"] += len(data)


def test_store_lost_mid_read_gives_eio_never_wrong_bytes(tmp_path: Path, weed: SeaweedFS, rng: random.Random,
                                                         fault_ledger: dict[str, int]) -> None:
    remote, env = _remote(weed)
    data = _image(tmp_path / "a.img", rng)
    m = Mount(tmp_path, store=remote, env=env)
    m.strata("image", "import", str(tmp_path / "a.img"), "lazy:v1")
    m.start()
    try:
        half = 4 * MiB  # read-ahead fetches at most 8 chunks past it: the last chunk stays in the store
        with open(m.image("lazy:v1"), "rb", buffering=0) as f:
            assert os.pread(f.fileno(), half, 0) == data[:half]  # now cached
        # the read-ahead window may have fetched past the half: read what is surely uncached, the last chunk
        weed.stop(crash=True)
        fault_ledger["faults injected"] += 1
        with open(m.image("lazy:v1"), "rb", buffering=0) as f:
            with pytest.raises(OSError) as exc:
                os.pread(f.fileno(), MiB, len(data) - MiB)
            assert exc.value.errno == errno.EIO
            assert os.pread(f.fileno(), half, 0) == data[:half]  # the cache still serves, verified
        os.kill(m.pid, 0)  # the daemon lives on
        weed.restart()
        with open(m.image("lazy:v1"), "rb", buffering=0) as f:
            assert os.pread(f.fileno(), len(data), 0) == data
        fault_ledger["bytes verified"] += len(data) + half
    finally:
        m.stop()


def test_serve_killed_mid_upload_publishes_all_or_nothing(tmp_path: Path, rng: random.Random,
                                                          fault_ledger: dict[str, int]) -> None:
    from tests.node_server import NodeServer

    node = NodeServer(tmp_path, tmp_path / "no-guest")  # images only: no VM is started
    data = rng.randbytes(IMAGE_MIB * MiB)
    store = {"STRATA_STORE": node.env["STRATA_STORE"], "STRATA_STATE_DIR": str(tmp_path / "reader")}
    try:
        node.start()
        began = time.monotonic()
        assert node.client.put("/images/probe:v1", content=data).status_code == 201
        window = time.monotonic() - began
        for attempt in range(4):
            upload = subprocess.Popen(["curl", "-sS", "-o", "/dev/null", "-X", "PUT", "--data-binary", "@-",
                                       "-H", "X-API-Key: " + node.client.headers["X-API-Key"],
                                       "-H", "Content-Type: application/octet-stream",
                                       f"{node.url}/images/up:v{attempt}"],
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            killer_delay = rng.uniform(0.1, 1.2) * window
            killed_at = time.monotonic() + killer_delay
            upload.stdin.write(data)  # type: ignore[union-attr]
            upload.stdin.close()  # type: ignore[union-attr]
            time.sleep(max(0.0, killed_at - time.monotonic()))
            node.proc.kill()  # type: ignore[union-attr]  # serve only: its mount daemon lives on, as in a crash
            node.proc.wait()  # type: ignore[union-attr]
            upload.wait(timeout=60)
            fault_ledger["faults injected"] += 1
            node.start()
            assert not list((tmp_path / "state" / "uploads").glob(".upload-*")), "a killed upload's file was kept"
            listed = [row["ref"] for row in node.client.get("/images").json()]
            if f"up:v{attempt}" in listed:
                assert _read_back(store["STRATA_STORE"], store, f"up:v{attempt}", tmp_path / "out") == data
                fault_ledger["bytes verified"] += len(data)
            assert _read_back(store["STRATA_STORE"], store, "probe:v1", tmp_path / "out") == data  # committed
            fault_ledger["bytes verified"] += len(data)
        r = node.client.put("/images/up:final", content=data)
        assert r.status_code == 201, r.text
        assert _read_back(store["STRATA_STORE"], store, "up:final", tmp_path / "out") == data
        fault_ledger["bytes verified"] += len(data)
    finally:
        node.cleanup()


def test_serve_killed_mid_pause_loses_nothing_committed(tmp_path: Path, guest: Path, rng: random.Random,
                                                        fault_ledger: dict[str, int]) -> None:
    """SIGKILL of `strata serve` while it pauses (snapshots, then frees) a
    sandbox: after the restart the sandbox is running or paused, its record
    says which, and a connect brings it back with every file written before
    the last completed pause."""
    import threading

    node = _serving(tmp_path, guest)
    try:
        c = node.client
        sid = c.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
        _exec(node, sid, "echo committed > /root/kept; sync")
        began = time.monotonic()
        assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
        window = time.monotonic() - began
        for attempt in range(2):
            assert c.post(f"/sandboxes/{sid}/connect", json={"timeout": 600}).status_code in (200, 201)
            _exec(node, sid, f"echo round{attempt} >> /root/kept; sync")
            answers: list[int] = []
            pause = threading.Thread(target=lambda: answers.append(_status(c, f"/sandboxes/{sid}/pause")))
            pause.start()
            time.sleep(rng.uniform(0.05, 1.0) * window)
            node.proc.kill()  # type: ignore[union-attr]
            node.proc.wait()  # type: ignore[union-attr]
            pause.join(timeout=60)
            fault_ledger["faults injected"] += 1
            node.start()
            state = c.get(f"/sandboxes/{sid}").json()["state"]
            assert state in ("running", "paused"), state
            fault_ledger["5xx responses"] += sum(code >= 500 for code in answers)
            r = c.post(f"/sandboxes/{sid}/connect", json={"timeout": 600})
            assert r.status_code in (200, 201), r.text
            kept = _exec(node, sid, "cat /root/kept")
            assert kept.splitlines() == ["committed"] + [f"round{i}" for i in range(attempt + 1)], kept
            fault_ledger["bytes verified"] += len(kept)
    finally:
        node.cleanup()


def _serving(tmp_path: Path, guest: Path, **env: str):  # noqa: ANN202 - tests.node_server.NodeServer
    """A started `strata serve` whose store holds the guest as guest:v1 and
    its template `base` (the caller cleans it up)."""
    from tests.node_server import NodeServer

    node = NodeServer(tmp_path, guest, **env)
    node.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
    try:
        node.start()
        assert node.client.post("/templates", json={"name": "base", "image": "guest:v1"}).status_code == 201
    except BaseException:
        node.cleanup()
        raise
    return node


def _status(client: object, path: str) -> int:
    import httpx

    try:
        return client.post(path).status_code  # type: ignore[attr-defined]
    except httpx.HTTPError:
        return 0  # the server died under the request: no answer, not a 5xx


def _exec(node: object, sid: str, command: str) -> str:
    r = node.client.post(f"/sandboxes/{sid}/exec", json={"command": command})  # type: ignore[attr-defined]
    assert r.status_code == 200 and r.json()["exitCode"] == 0, r.text
    return r.json()["output"].strip()


def test_corrupt_chunks_in_store_and_cache_are_never_served(tmp_path: Path, weed: SeaweedFS, rng: random.Random,
                                                            fault_ledger: dict[str, int]) -> None:
    """Damage random cache files (while the mount is down, as a torn write or
    a lost disk sector would) and random chunk objects in S3, then read every
    chunk: a range reads back exactly, or fails with EIO when no good copy of
    its chunk is left; verify names exactly the damaged objects."""
    from layerstore.digest import digest_bytes

    remote, env = _remote(weed)
    data = _image(tmp_path / "a.img", rng)
    digests = [digest_bytes(data[i:i + MiB]) for i in range(0, len(data), MiB)]
    m = Mount(tmp_path, store=remote, env=env)
    m.strata("image", "import", str(tmp_path / "a.img"), "c:v1")
    m.start()
    try:
        assert m.image("c:v1").read_bytes() == data  # every chunk now cached
        m.stop()
        bad_cache = set(rng.sample(digests, 8))
        for digest, damage in zip(sorted(bad_cache), ["flip", "truncate", "empty", "delete"] * 2):
            _damage(tmp_path / "cache" / "chunks" / digest[:2] / digest, damage, rng)
        bad_store = set(rng.sample(digests, 5))
        s3, bucket, prefix = weed.client(), "faults", remote.removeprefix("s3://faults/")
        for digest in bad_store:
            key = f"{prefix}/chunks/{digest[:2]}/{digest}"
            body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            s3.put_object(Bucket=bucket, Key=key, Body=body[: len(body) // 2] if rng.random() < 0.5
                          else rng.randbytes(len(body)))
        fault_ledger["faults injected"] += len(bad_cache) + len(bad_store)
        m.start()
        lost = {i for i, d in enumerate(digests) if d in bad_cache and d in bad_store}
        failed = set()
        with open(m.image("c:v1"), "rb", buffering=0) as f:
            for i in range(len(digests)):
                try:
                    got = os.pread(f.fileno(), MiB, i * MiB)
                except OSError as exc:
                    assert exc.errno == errno.EIO
                    failed.add(i)
                    continue
                assert got == data[i * MiB:(i + 1) * MiB], f"chunk {i} served wrong bytes"
                fault_ledger["bytes verified"] += len(got)
        assert failed == lost
        os.kill(m.pid, 0)  # the daemon lives on
    finally:
        m.stop()
    r = run(["verify", "--json"], {**env, "STRATA_STORE": remote})
    assert r.returncode == 3
    assert {d for d in bad_store if d in r.stdout} == bad_store


def _damage(path: Path, how: str, rng: random.Random) -> None:
    if how == "delete":
        path.unlink()
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "truncate":
        os.truncate(path, path.stat().st_size // 3)
    else:
        raw = bytearray(path.read_bytes())
        raw[rng.randrange(len(raw))] ^= 0xFF
        path.write_bytes(bytes(raw))


def test_a_guest_flooding_output_and_console_is_capped(tmp_path: Path, guest: Path,
                                                       fault_ledger: dict[str, int]) -> None:
    """A real guest prints 16 MB from one command and floods its console:
    the exec answers 200 with the head of the output and a truncation marker,
    two commands at once on the sandbox each get their own answer, the
    console log on the node stays near its cap, and the sandbox goes on
    working."""
    import threading

    node = _serving(tmp_path, guest, STRATA_EXEC_OUTPUT_LIMIT="64K", STRATA_CONSOLE_LOG_LIMIT="128K")
    try:
        c = node.client
        sid = c.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
        r = c.post(f"/sandboxes/{sid}/exec", json={"command": "yes flood | head -c 16000000", "timeout": 300},
                   timeout=330)
        fault_ledger["faults injected"] += 1
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["exitCode"] == 0 and body["truncated"] is True
        assert body["output"].startswith("flood\nflood\n")
        assert "[strata: output truncated: " in body["output"] and len(body["output"]) < 70_000
        fault_ledger["bytes verified"] += len(body["output"])

        # one sandbox, two commands at once: each answer is its own
        answers: dict[int, dict] = {}

        def run(i: int) -> None:
            answers[i] = c.post(f"/sandboxes/{sid}/exec", json={"command": f"sleep 1; echo mine-{i}"},
                                timeout=120).json()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert {i: a.get("output", a).strip() for i, a in answers.items()} == {i: f"mine-{i}" for i in range(3)}

        # the console: 1.5 MB written to ttyS0 while the node samples the log's size
        console = tmp_path / "state" / "sandboxes" / sid / "console.log"
        sizes: list[int] = []
        flooding = threading.Thread(target=lambda: answers.update(flood=c.post(
            f"/sandboxes/{sid}/exec", json={"command": "head -c 1500000 /dev/zero | tr '\\0' c > /dev/console",
                                            "timeout": 600}, timeout=630).json()))
        flooding.start()
        while flooding.is_alive():
            sizes.append(console.stat().st_size if console.exists() else 0)
            time.sleep(0.1)
        fault_ledger["faults injected"] += 1
        assert answers["flood"].get("exitCode") == 0, answers["flood"]
        time.sleep(2.5)  # the rotation after the last write
        biggest = max(sizes + [console.stat().st_size])
        assert console.with_name("console.log.1").exists(), "the console log was never rotated"
        assert console.with_name("console.log.1").stat().st_size <= 128 << 10
        # rotation runs once a second: the log may pass its cap by what a guest's serial port writes in one
        assert biggest < 1 << 20, f"console log reached {biggest} bytes against a 128K cap"
        assert _exec(node, sid, "echo alive") == "alive"
    finally:
        node.cleanup()


def test_mount_daemon_killed_is_restarted_and_sandboxes_regain_their_disks(tmp_path: Path, guest: Path,
                                                                           rng: random.Random,
                                                                           fault_ledger: dict[str, int]) -> None:
    """SIGKILL of the node's FUSE daemon at a random point while a guest
    writes: strata serve stays up, starts a new daemon (/health counts the
    restart), reboots the running sandbox on its disk with every synced file
    (its record says what happened), resumes the paused one intact, and the
    committed image still reads back exactly."""
    from fusefs.client import MountClient

    node = _serving(tmp_path, guest)
    try:
        c = node.client
        running = c.post("/sandboxes", json={"templateID": "guest:v1", "timeout": 600}).json()["sandboxID"]
        paused = c.post("/sandboxes", json={"templateID": "guest:v1", "timeout": 600}).json()["sandboxID"]
        _exec(node, running, "echo kept > /root/synced; sync")
        _exec(node, paused, "echo asleep > /root/f; sync")
        assert c.post(f"/sandboxes/{paused}/pause").status_code == 204
        _exec(node, running, "(i=0; while true; do i=$((i+1)); echo $i > /root/counter; sync; done) "
                             ">/dev/null 2>&1 &")
        time.sleep(rng.uniform(0.1, 2.0))
        daemon = MountClient(tmp_path / "state" / "mnt", run_dir=tmp_path / "run").ping().pid
        os.kill(daemon, signal.SIGKILL)
        fault_ledger["faults injected"] += 1
        deadline = time.monotonic() + 180
        health: dict = {}
        while time.monotonic() < deadline:
            health = c.get("/health").json()
            record = next((r for r in node.admin.get("/admin/sandboxes").json() if r["sid"] == running), {})
            if health.get("mount_restarts") == 1 and record.get("recovered") and record.get("state") == "running":
                break
            time.sleep(0.5)
        assert health["mount_restarts"] == 1 and health["mount_state"] == "ok" and health["status"] == "ok", health
        assert "mount daemon died" in record["recovered"], record
        assert _exec(node, running, "cat /root/synced") == "kept"
        assert c.post(f"/sandboxes/{paused}/connect", json={"timeout": 600}).status_code == 201
        assert _exec(node, paused, "cat /root/f") == "asleep"
        out = tmp_path / "out.img"
        env = {**node.env, "STRATA_STATE_DIR": str(tmp_path / "reader")}
        subprocess.run([str(Path(__file__).resolve().parent.parent / ".venv/bin/strata"), "image", "export", "guest:v1",
                        str(out)], env=env,
                       check=True, capture_output=True, timeout=300)
        assert out.read_bytes() == (guest / "rootfs.ext4").read_bytes()
        fault_ledger["bytes verified"] += out.stat().st_size
    finally:
        node.cleanup()


def test_a_vm_lost_while_serve_was_down_goes_back_to_its_last_snapshot(tmp_path: Path, guest: Path,
                                                                       fault_ledger: dict[str, int]) -> None:
    """strata serve SIGKILLed and the sandbox's VM gone when it comes back
    (a host restart, or a kill between a pause's snapshot and its record):
    the sandbox is paused at its last snapshot, not removed, and resumes
    with what that snapshot holds."""
    node = _serving(tmp_path, guest)
    try:
        c = node.client
        sid = c.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
        _exec(node, sid, "echo committed > /root/kept; sync")
        assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
        assert c.post(f"/sandboxes/{sid}/connect", json={"timeout": 600}).status_code == 201
        vm = next(r for r in node.admin.get("/admin/sandboxes").json() if r["sid"] == sid)["pid"]
        node.proc.kill()  # type: ignore[union-attr]
        node.proc.wait()  # type: ignore[union-attr]
        os.kill(vm, signal.SIGKILL)
        fault_ledger["faults injected"] += 2
        node.start()
        assert c.get(f"/sandboxes/{sid}").json()["state"] == "paused"
        assert "VM was gone" in next(r for r in node.admin.get("/admin/sandboxes").json()
                                     if r["sid"] == sid)["recovered"]
        assert c.post(f"/sandboxes/{sid}/connect", json={"timeout": 600}).status_code == 201
        assert _exec(node, sid, "cat /root/kept") == "committed"
        fault_ledger["bytes verified"] += len("committed")
    finally:
        node.cleanup()
