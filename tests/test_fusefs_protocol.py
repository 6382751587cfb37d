"""The control protocol (fusefs/protocol.py): messages round-trip, bad lines
are refused with one clear line, every StrataError crosses the wire as its
own class, and a daemon survives whatever a client sends."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from fusefs import protocol as p
from fusefs.control import control_socket
from layerstore.config import default_run_dir
from layerstore import errors
from layerstore.errors import InvalidInput, NotFound, StrataError
from layerstore.refs import parse_ref
from tests.images import MiB, write_image

SEAL = p.SealState("done", manifest="ab" * 32)
DISK = p.DiskInfo(sid="sb1", base="cd" * 32, size=4 * MiB, dirty_chunks=2, layers=["ab" * 32], last_seal=SEAL,
                  path="/mnt/sandboxes/sb1/disk.img")
REQUESTS = [p.Ping(), p.Stats(), p.CreateDisk("sb1", image="base:v1"), p.CreateDisk("sb1", manifest="cd" * 32),
            p.ListDisks(), p.RemoveDisk("sb1"), p.Seal("sb1", wait=True), p.Seal("sb1"), p.AwaitSeal("sb1"),
            p.RecordPrefetch("base:v1"), p.Prefetch("cd" * 32), p.CacheDrop(), p.Pin("base:v1"), p.Unpin("base:v1"),
            p.Shutdown()]
REPLIES = [p.Pong(pid=7, mountpoint="/mnt", store="local:/s", uptime=1.5),
           p.MountStats(cache={"size": 1, "hits": 2}, fetches=3, memory_hits=4, sources={"local": 3}, disks=1,
                        open_files=0),
           DISK, dataclasses.replace(DISK, last_seal=None), p.DiskList([DISK]), p.DiskList([]), p.DiskRemoved("sb1"),
           p.Sealed(sid="sb1", dirty_chunks=2, switch_ms=0.25, manifest=None),
           p.Sealed(sid="sb1", dirty_chunks=2, switch_ms=0.25, manifest="ab" * 32),
           p.PrefetchRecorded(image="base:v1", manifest="cd" * 32, chunks=9), p.PrefetchStarted(manifest="cd" * 32),
           p.CacheDropped(freed=1 << 20),
           p.Pinned(image="base:v1", chunks=4, cached=4), p.Unpinned(image="base:v1"), p.ShuttingDown(pid=7),
           p.SealState("failed", error="store unreachable"), p.SealState("publishing")]


def strata_errors() -> list[type[StrataError]]:
    """Every StrataError class layerstore/errors.py defines, found independently of protocol.py."""
    return [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, StrataError)]


def line(obj: Any) -> bytes:
    return json.dumps(obj).encode() + b"\n"


# messages -----------------------------------------------------------------------------------------
def test_every_request_round_trips() -> None:
    assert {type(r) for r in REQUESTS} == set(p.REQUESTS)
    for request in REQUESTS:
        wire = p.encode_request(request)
        assert wire.endswith(b"\n") and wire.count(b"\n") == 1
        assert json.loads(wire)["v"] == p.PROTOCOL_VERSION
        assert p.decode_request(wire) == request


def test_every_reply_round_trips() -> None:
    assert {type(r) for r in REPLIES} == {c.reply for c in p.REQUESTS} | {p.SealState}
    for reply in REPLIES:
        wire = p.encode_reply(reply)
        assert json.loads(wire)["ok"] is True
        request = next((c for c in p.REQUESTS if c.reply is type(reply)), None)
        if request is not None:
            assert p.decode_reply(wire, request) == reply


def test_op_names_come_from_the_request_classes() -> None:
    assert p.op_name(p.CreateDisk) == "create_disk" and p.op_name(p.RecordPrefetch) == "record_prefetch"
    assert sorted(p.OPS) == sorted(p.op_name(c) for c in p.REQUESTS)


def test_fields_with_defaults_may_be_left_out() -> None:
    assert p.decode_request(line({"v": 1, "op": "seal", "sid": "a"})) == p.Seal("a", wait=False)
    assert p.decode_request(line({"v": 1, "op": "create_disk", "sid": "a", "image": "x:y"})) == p.CreateDisk("a", image="x:y")
    assert p.decode_request(line({"v": 1, "op": "create_disk", "sid": "a", "manifest": "m", "volatile": True})
                            ) == p.CreateDisk("a", manifest="m", volatile=True)


@pytest.mark.parametrize("wire, expected", [
    (b"{not json\n", "not JSON"),
    (b"[1, 2]\n", "not a JSON object"),
    (b"\n", "not JSON"),
    (line({"op": "ping"}), "no version; this daemon speaks version 1"),
    (line({"v": 2, "op": "ping"}), "version 2; this daemon speaks version 1"),
    (line({"v": "1", "op": "ping"}), 'version "1"; this daemon speaks version 1'),
    (line({"v": True, "op": "ping"}), "version true; this daemon speaks version 1"),
    (line({"v": 1}), "unknown operation null"),
    (line({"v": 1, "op": "sandbox_create", "sid": "a"}), 'unknown operation "sandbox_create" (known: await_seal, cache_drop,'),
    (line({"v": 1, "op": 5}), "unknown operation 5"),
    (line({"v": 1, "op": "remove_disk"}), "remove_disk lacks field 'sid'"),
    (line({"v": 1, "op": "ping", "sid": "a"}), "ping has no field 'sid'"),
    (line({"v": 1, "op": "remove_disk", "sid": "a", "wait": True}), "remove_disk has no field 'wait' (fields: sid)"),
    (line({"v": 1, "op": "remove_disk", "sid": 3}), "remove_disk.sid must be a string, got 3"),
    (line({"v": 1, "op": "seal", "sid": "a", "wait": "yes"}), 'seal.wait must be true or false, got "yes"'),
    (line({"v": 1, "op": "seal", "sid": "a", "wait": 1}), "seal.wait must be true or false, got 1"),
    (line({"v": 1, "op": "seal", "sid": None}), "seal.sid must be a string, got null"),
    (line({"v": 1, "op": "create_disk", "sid": "a"}), "give exactly one of image or manifest"),
    (line({"v": 1, "op": "create_disk", "sid": "a", "image": "x:y", "manifest": "m"}), "exactly one of image"),
    (line({"v": 1, "op": "pin", "image": ["x"]}), 'pin.image must be a string, got ["x"]'),
])
def test_malformed_requests_are_invalid_input_in_one_line(wire: bytes, expected: str) -> None:
    with pytest.raises(InvalidInput) as e:
        p.decode_request(wire)
    assert expected in str(e.value) and "\n" not in str(e.value)
    reply = json.loads(p.answer(wire, {}))  # and the daemon's answer says the same, as InvalidInput
    assert reply == {"ok": False, "error": str(e.value), "kind": "InvalidInput"}


def test_version_mismatch_names_both_versions() -> None:
    with pytest.raises(InvalidInput, match=rf"version {p.PROTOCOL_VERSION + 1}; this daemon speaks version "
                                           rf"{p.PROTOCOL_VERSION}"):
        p.decode_request(line({"v": p.PROTOCOL_VERSION + 1, "op": "ping"}))


@pytest.mark.parametrize("body, expected", [
    ({"ok": True, "pid": "7", "mountpoint": "/m", "store": "s", "uptime": 1.0}, "ping.pid must be an integer"),
    ({"ok": True, "pid": 7, "mountpoint": "/m", "store": "s"}, "ping lacks field 'uptime'"),
    ({"ok": True, "pid": 7, "mountpoint": "/m", "store": "s", "uptime": 1, "x": 1}, "ping has no field 'x'"),
    ({"pid": 7}, "no 'ok'"),
])
def test_malformed_replies_are_the_daemons_fault(body: dict, expected: str) -> None:
    with pytest.raises(p.DaemonError, match=expected):
        p.decode_reply(line(body), p.Ping)
    with pytest.raises(p.DaemonError, match="not JSON"):
        p.decode_reply(b"garbage\n", p.Ping)


def test_nested_replies_are_checked_too() -> None:
    wire = p.encode_reply(p.DiskList([DISK])).replace(b'"dirty_chunks":2', b'"dirty_chunks":"2"')
    with pytest.raises(p.DaemonError, match=r"list_disks.disks\[0\].dirty_chunks must be an integer"):
        p.decode_reply(wire, p.ListDisks)


# errors -------------------------------------------------------------------------------------------
def test_every_error_class_is_known_to_the_protocol() -> None:
    assert len(strata_errors()) >= 9
    for cls in [*strata_errors(), p.DaemonError]:
        assert p.ERROR_KINDS[cls.__name__] is cls


def test_errors_decode_to_their_class_and_unknown_kinds_to_daemon_error() -> None:
    for cls in [*strata_errors(), p.DaemonError]:
        with pytest.raises(cls) as e:
            p.decode_reply(p.encode_error(cls("it broke")), p.Ping)
        assert type(e.value) is cls and str(e.value) == "it broke"
    with pytest.raises(p.DaemonError, match="^odd$") as e:
        p.decode_reply(line({"ok": False, "error": "odd", "kind": "SomethingNew"}), p.Ping)
    assert type(e.value) is p.DaemonError


def test_error_subclasses_travel_as_their_nearest_known_class() -> None:
    class Gone(NotFound):
        pass

    assert json.loads(p.encode_error(Gone("x\ny")))["kind"] == "NotFound"
    assert json.loads(p.encode_error(Gone("x\ny")))["error"] == "x y"  # one line, always


# a daemon without FUSE: Daemon.handle, the table, the real handlers --------------------------------
@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Any]:
    from fusefs.cache import ChunkCache
    from fusefs.catalogue import Catalogue
    from fusefs.daemon import Daemon
    from layerstore.store import open_store

    store = open_store(str(tmp_path / "store"))
    write_image(tmp_path / "a.img", "rzr")
    from layerstore.importer import import_image

    import_image(store, tmp_path / "a.img", "base:v1")
    cat = Catalogue(store, ChunkCache(tmp_path / "cache", capacity=64 * MiB), tmp_path / "uppers")
    d = Daemon(tmp_path / "mnt", cat, tmp_path / "run" / "x.sock")
    yield d
    d.fs.shutdown()
    cat.close()
    store.close()


def ask(daemon: Any, request: p.Request[p.R]) -> p.R:
    return p.decode_reply(daemon.handle(p.encode_request(request)), type(request))


def test_every_request_class_has_a_handler(daemon: Any) -> None:
    assert set(daemon.handlers) == set(p.REQUESTS)


def test_handlers_answer_typed_replies(daemon: Any) -> None:
    assert ask(daemon, p.Ping()).pid == os.getpid()
    disk = ask(daemon, p.CreateDisk("sb1", image="base:v1"))
    assert disk.sid == "sb1" and disk.size == 3 * MiB and disk.path.endswith("mnt/sandboxes/sb1/disk.img")
    assert ask(daemon, p.ListDisks()).disks == [disk]
    assert ask(daemon, p.Stats()).disks == 1
    with pytest.raises(NotFound, match="no seal to wait for"):
        ask(daemon, p.AwaitSeal("sb1"))
    started = ask(daemon, p.Seal("sb1"))
    assert started.manifest is None
    assert ask(daemon, p.AwaitSeal("sb1")).manifest is not None
    sealed = ask(daemon, p.Seal("sb1", wait=True))
    assert sealed.dirty_chunks == 0 and sealed.manifest is not None
    assert ask(daemon, p.ListDisks()).disks[0].last_seal == p.SealState("done", manifest=sealed.manifest)
    assert ask(daemon, p.RemoveDisk("sb1")) == p.DiskRemoved("sb1")
    assert ask(daemon, p.ListDisks()).disks == []


def test_prefetch_fetches_a_layers_recorded_set_before_anything_opens_it(daemon: Any) -> None:
    """A VMM names a snapshot's device state before QEMU starts: its set is
    fetched in the background, and only its set."""
    store, cat = daemon.cat.store, daemon.cat
    manifest = store.resolve(parse_ref("base:v1"))
    digests = store.chunk_map(manifest)[1]
    store.put_prefetch(manifest, [2])
    assert ask(daemon, p.Prefetch(manifest)) == p.PrefetchStarted(manifest=manifest)
    deadline = time.monotonic() + 10
    while not cat.cache.contains(digests[2]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cat.cache.contains(digests[2]) and not cat.cache.contains(digests[0])
    with pytest.raises(NotFound):
        ask(daemon, p.Prefetch("ef" * 32))
    with pytest.raises(InvalidInput, match="manifest id"):
        ask(daemon, p.Prefetch("../../etc/passwd"))


def test_domain_errors_keep_their_class_through_the_daemon(daemon: Any) -> None:
    with pytest.raises(NotFound, match="sandbox ghost not found"):
        ask(daemon, p.RemoveDisk("ghost"))
    with pytest.raises(InvalidInput, match="invalid sandbox id"):
        ask(daemon, p.CreateDisk("../evil", image="base:v1"))
    with pytest.raises(NotFound):
        ask(daemon, p.CreateDisk("sb", image="nope:v1"))


@pytest.mark.parametrize("cls", [*strata_errors(), p.DaemonError], ids=lambda c: c.__name__)
def test_every_error_class_round_trips_through_daemon_handle(daemon: Any, cls: type[StrataError],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(_request: p.Ping) -> p.Pong:
        raise cls(f"{cls.__name__} on purpose")

    monkeypatch.setattr(daemon, "ping", fail)
    with pytest.raises(cls, match=f"^{cls.__name__} on purpose$") as e:
        ask(daemon, p.Ping())
    assert type(e.value) is cls


def test_a_bug_in_a_handler_is_a_daemon_error_not_a_crash(daemon: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon, "stats", lambda _r: {}["missing"])
    with pytest.raises(p.DaemonError, match="internal error: KeyError"):
        ask(daemon, p.Stats())
    monkeypatch.setattr(daemon, "stats", lambda _r: p.Pong(1, "/", "s", 0.0))  # the wrong reply class
    with pytest.raises(p.DaemonError, match="internal error: TypeError: stats handler returned Pong"):
        ask(daemon, p.Stats())
    assert ask(daemon, p.Ping()).pid == os.getpid()


def test_oversized_requests_are_refused(daemon: Any) -> None:
    wire = line({"v": 1, "op": "pin", "image": "x" * p.MAX_LINE})
    with pytest.raises(InvalidInput, match="request too large"):
        p.decode_reply(daemon.handle(wire), p.Pin)


# the run dir --------------------------------------------------------------------------------------
def test_run_dir_is_explicit() -> None:
    assert default_run_dir(euid=0, xdg_runtime_dir="/run/user/0") == Path("/run/strata")
    assert default_run_dir(euid=1000, xdg_runtime_dir="/run/user/1000") == Path("/run/user/1000/strata")
    assert default_run_dir(euid=1000, xdg_runtime_dir=None) == Path("/tmp/strata-1000/strata")
    assert control_socket("/a/mnt", Path("/r")).parent == Path("/r")
    assert control_socket("/a/mnt", Path("/r")) != control_socket("/b/mnt", Path("/r"))


def test_protocol_module_stays_cheap_to_import() -> None:
    code = "import sys, fusefs.client, fusefs.protocol; print('pyfuse3' in sys.modules or 'trio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == "False"


# a real mount -------------------------------------------------------------------------------------
def raw(sock: socket.socket, data: bytes) -> dict:
    sock.sendall(data)
    buf = b""
    while not buf.endswith(b"\n"):
        part = sock.recv(1 << 16)
        assert part, "the daemon closed the connection"
        buf += part
    return json.loads(buf)


def test_real_daemon_survives_bad_requests_and_keeps_error_classes(tmp_path: Path) -> None:
    from tests.test_fusefs_mount import Mount

    m = Mount(tmp_path)
    write_image(tmp_path / "a.img", "rr")
    m.strata("image", "import", str(tmp_path / "a.img"), "base:v1")
    m.start()
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(m.client.socket_path))
            for bad in (b"nonsense\n", line({"v": 99, "op": "ping"}), line({"v": 1, "op": "seal", "sid": 1})):
                reply = raw(s, bad)
                assert reply["ok"] is False and reply["kind"] == "InvalidInput", reply
            assert "version 99; this daemon speaks version 1" in raw(s, line({"v": 99, "op": "ping"}))["error"]
            assert raw(s, p.encode_request(p.Ping()))["pid"] == m.pid  # same connection, still answered
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(m.client.socket_path))
            reply = raw(s, b"x" * (p.MAX_LINE + 10))  # no newline in sight: refused, connection dropped
            assert reply["kind"] == "InvalidInput" and "too large" in reply["error"]
        assert m.client.ping().pid == m.pid
        with pytest.raises(NotFound, match="sandbox ghost not found"):
            m.client.remove_disk("ghost")
        with pytest.raises(NotFound):
            m.client.seal("ghost")
        disk = m.client.create_disk("sb1", image="base:v1")
        assert Path(disk.path).stat().st_size == disk.size == 2 * MiB
        assert [d.sid for d in m.client.list_disks()] == ["sb1"] and m.client.disk_layers() == [disk.base]
        with pytest.raises(InvalidInput, match="already exists"):
            m.client.create_disk("sb1", image="base:v1")
        assert m.client.remove_disk("sb1").sid == "sb1"
        assert m.client.pin("base:v1").chunks == 2 and m.client.unpin("base:v1").image == "base:v1"
        assert m.client.stats(timeout=10).cache["size"] > 0
        image = m.mnt / "images" / "base:v1" / "disk.img"
        image.read_bytes()  # both chunks now in the cache and in memory
        assert m.client.cache_drop().freed > 0
        assert m.client.stats().cache["size"] == 0
        fetches = m.client.stats().fetches
        image.read_bytes()  # the drop emptied the kernel's page cache of the file too
        assert m.client.stats().fetches == fetches + 2  # from the store: nothing was left in memory
    finally:
        m.stop()
