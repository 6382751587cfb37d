"""The node's end of the volume port (vmm/volumeport.py, vmm/volumefs.py)
driven over a real unix socket by a stand-in for the guest's FUSE client
(the wire format of vmm/guest/README.md, "Volume port"); the guest's own
end runs in tests/test_api_volumes.py's VM tests."""

from __future__ import annotations

import errno
import json
import select
import socket
import threading
from pathlib import Path

import pytest

from layerstore.errors import StrataError
from layerstore.store import open_store
from layerstore.unixsock import bind_unix
from layerstore.volumes import Volumes, read_bytes
from vmm.volumefs import VolumeFiles
from vmm.volumeport import MAX_LINE, Replies, VolumePort


class Guest:
    """The guest's side: a listening socket (QEMU's chardev) the port connects to."""

    def __init__(self, path: Path) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bind_unix(self.server, path)  # as QEMU binds it: relative to the VM's directory, whatever its length
        self.server.listen(1)
        self.conn: socket.socket | None = None
        self.stream = None
        self.next_id = 0

    def accept(self) -> None:
        self.conn, _ = self.server.accept()
        self.conn.settimeout(20)
        self.stream = self.conn.makefile("rb")

    def send(self, op: str, vol: str, raw: bytes = b"", rid: int | None = None, **fields: object) -> int:
        if rid is None:
            self.next_id += 1
            rid = self.next_id
        message = {"id": rid, "op": op, "vol": vol, **fields, **({"raw": len(raw)} if raw else {})}
        self.conn.sendall(json.dumps(message).encode() + b"\n" + raw)
        return rid

    def reply(self) -> tuple[dict, bytes]:
        line = self.stream.readline()
        assert line, "the port hung up"
        reply = json.loads(line)
        return reply, self.stream.read(reply.get("raw", 0)) if reply.get("raw") else b""

    def call(self, op: str, vol: str, raw: bytes = b"", **fields: object) -> tuple[dict, bytes]:
        rid = self.send(op, vol, raw, **fields)
        reply, data = self.reply()
        assert reply["id"] == rid
        return reply, data

    def ok(self, op: str, vol: str, raw: bytes = b"", **fields: object) -> dict | bytes:
        reply, data = self.call(op, vol, raw, **fields)
        assert reply["errno"] == 0, (op, fields, reply)
        return data if "raw" in reply else reply

    def close(self) -> None:
        for s in (self.conn, self.server):
            if s is not None:
                s.close()


@pytest.fixture
def served(tmp_path: Path):
    store = open_store(str(tmp_path / "store"))
    volumes = Volumes(store.backend)
    vol = volumes.create("data", "alpha")
    other = volumes.create("other", "beta")
    stored: list[int] = []

    def quota(size: int) -> None:
        stored.append(size)
        if size > 3 << 20:
            raise StrataError("team alpha would store more than team_max_stored")

    files = VolumeFiles(store, vol.id, tmp_path / "staging", max_staged=8 << 20, check_stored=quota,
                        index_ttl=0.0)
    guest = Guest(tmp_path / "volumes.sock")
    acceptor = threading.Thread(target=guest.accept)
    acceptor.start()
    port = VolumePort(tmp_path / "volumes.sock", {vol.id: files}, Replies(), name="sbtest").start()
    acceptor.join()
    yield store, volumes, vol.id, other.id, guest, port
    port.close()
    guest.close()
    store.close()


def test_files_written_in_the_guest_are_the_volumes_and_the_volumes_are_the_guests(served):
    store, volumes, vid, _, guest, _ = served
    assert guest.ok("mkdir", vid, path="logs", mode=0o750, uid=1000, gid=1000)["attr"]["type"] == "directory"
    guest.ok("create", vid, path="logs/a.txt", mode=0o640, uid=1000, gid=1000, fh=7)
    data = bytes(range(256)) * 8192  # 2 MiB, two chunks
    for off in range(0, len(data), 1 << 20):
        assert guest.ok("write", vid, data[off:off + (1 << 20)], fh=7, path="logs/a.txt", off=off)["size"] == 1 << 20
    # before the flush: the guest reads its own writes, the volume does not have them yet
    assert guest.ok("read", vid, path="logs/a.txt", off=100, len=50) == data[100:150]
    assert volumes.get(vid).entry("logs/a.txt").size == 0
    guest.ok("release", vid, fh=7, path="logs/a.txt")
    entry = volumes.get(vid).entry("logs/a.txt")
    assert (entry.size, entry.mode, entry.uid) == (len(data), 0o640, 1000)
    assert b"".join(read_bytes(store, entry)) == data
    # reads of the published file, across the chunk boundary
    assert guest.ok("read", vid, path="logs/a.txt", off=(1 << 20) - 10, len=20) == data[(1 << 20) - 10:(1 << 20) + 10]
    assert guest.ok("read", vid, path="logs/a.txt", off=len(data) - 5, len=100) == data[-5:]
    names = [e["name"] for e in guest.ok("list", vid, path="logs")["entries"]]
    assert names == ["a.txt"]
    # a file the volume API writes is what the guest reads next
    volumes.change(vid, lambda v: v)  # (no-op edit: the CAS path)
    stat = guest.ok("stat", vid, path="logs/a.txt")["attr"]
    assert stat["size"] == len(data) and stat["mode"] == 0o640


def test_rename_unlink_rmdir_follow_posix_and_refuse_with_the_right_errno(served):
    _, volumes, vid, _, guest, _ = served
    guest.ok("mkdir", vid, path="d", mode=0o755)
    guest.ok("create", vid, path="d/f", mode=0o644, fh=1)
    guest.ok("release", vid, fh=1, path="d/f")
    assert guest.call("rmdir", vid, path="d")[0]["errno"] == errno.ENOTEMPTY
    assert guest.call("unlink", vid, path="d")[0]["errno"] == errno.EISDIR
    assert guest.call("rmdir", vid, path="d/f")[0]["errno"] == errno.ENOTDIR
    assert guest.call("create", vid, path="d/f", mode=0o644, fh=2)[0]["errno"] == errno.EEXIST
    assert guest.call("create", vid, path="nope/f", mode=0o644, fh=3)[0]["errno"] == errno.ENOENT
    assert guest.call("mkdir", vid, path="d/f/g", mode=0o755)[0]["errno"] == errno.ENOTDIR
    assert guest.call("rename", vid, path="d", to="d/inside")[0]["errno"] == errno.EINVAL
    guest.ok("mkdir", vid, path="e", mode=0o755)
    guest.ok("rename", vid, path="d", to="e")  # an empty directory is replaced
    assert sorted(volumes.get(vid).entries) == ["e", "e/f"]
    guest.ok("symlink", vid, path="link", target="e/f")
    assert guest.ok("stat", vid, path="link")["attr"]["target"] == "e/f"
    assert guest.call("rename", vid, path="link", to="e/f", noreplace=True)[0]["errno"] == errno.EEXIST
    guest.ok("unlink", vid, path="e/f")
    guest.ok("rmdir", vid, path="e")
    assert sorted(volumes.get(vid).entries) == ["link"]
    assert guest.call("stat", vid, path="e")[0]["errno"] == errno.ENOENT


def test_truncate_chmod_and_an_unknown_handle_restaged_from_the_published_file(served):
    store, volumes, vid, _, guest, _ = served
    guest.ok("create", vid, path="f", mode=0o644, fh=1)
    guest.ok("write", vid, b"hello world", fh=1, path="f", off=0)
    guest.ok("flush", vid, fh=1, path="f")
    # fh 99 was opened by a VM this node never served (a fork, a restore, a restart):
    # it is staged again from the published bytes, so the write lands on them
    guest.ok("write", vid, b"W", fh=99, path="f", off=6)
    guest.ok("release", vid, fh=99, path="f")
    assert b"".join(read_bytes(store, volumes.get(vid).entry("f"))) == b"hello World"
    guest.ok("setattr", vid, path="f", size=5, mode=0o600)
    entry = volumes.get(vid).entry("f")
    assert (entry.size, entry.mode) == (5, 0o600)
    assert guest.ok("read", vid, path="f", off=0, len=100) == b"hello"
    guest.ok("open", vid, path="f", fh=5, trunc=True)
    guest.ok("release", vid, fh=5, path="f")
    assert volumes.get(vid).entry("f").size == 0


def test_hostile_requests_get_an_errno_and_change_nothing(served):
    store, volumes, vid, other, guest, port = served
    before = volumes.get(vid).encode()
    assert guest.call("stat", other, path="")[0]["errno"] == errno.EACCES  # another team's, not mounted here
    assert guest.call("stat", "../../etc", path="")[0]["errno"] == errno.EACCES
    assert guest.call("create", vid, path="../x", mode=0o644, fh=1)[0]["errno"] == errno.EINVAL
    assert guest.call("mkdir", vid, path="a\0b", mode=0o755)[0]["errno"] == errno.EINVAL
    assert guest.call("read", vid, path="x", off=0, len=1 << 30)[0]["errno"] == errno.EINVAL
    assert guest.call("chown_everything", vid, path="")[0]["errno"] == errno.ENOSYS
    assert guest.call("write", vid, b"x", fh="1", path="f", off=0)[0]["errno"] == errno.EINVAL
    assert guest.call("rmdir", vid, path="")[0]["errno"] == errno.EBUSY
    assert volumes.get(vid).encode() == before
    assert port.alive()


def test_a_write_past_the_teams_quota_is_edquot_and_a_flood_past_staging_is_enospc(served):
    _, volumes, vid, _, guest, _ = served
    guest.ok("create", vid, path="big", mode=0o644, fh=1)
    for off in range(0, 4 << 20, 1 << 20):
        guest.ok("write", vid, b"q" * (1 << 20), fh=1, path="big", off=off)
    assert guest.call("flush", vid, fh=1, path="big")[0]["errno"] == errno.EDQUOT
    assert volumes.get(vid).entry("big").size == 0  # nothing published
    for off in range(4 << 20, 8 << 20, 1 << 20):
        guest.ok("write", vid, b"q" * (1 << 20), fh=1, path="big", off=off)
    assert guest.call("write", vid, b"q", fh=1, path="big", off=8 << 20)[0]["errno"] == errno.ENOSPC


def test_a_repeated_change_gets_the_first_answer_and_is_not_made_twice(served):
    _, volumes, vid, _, guest, _ = served
    rid = guest.send("mkdir", vid, path="once", mode=0o755)
    first, _ = guest.reply()
    guest.send("mkdir", vid, rid=rid, path="once", mode=0o755)  # the guest heard nothing: it sends it again
    again, _ = guest.reply()
    assert first == again and first["errno"] == 0
    # a new request (new id) for the same change is a new change: EEXIST
    assert guest.call("mkdir", vid, path="once", mode=0o755)[0]["errno"] == errno.EEXIST


def test_a_line_over_the_limit_ends_the_connection_not_the_port(served):
    _, _, vid, _, guest, port = served
    guest.conn.sendall(b"{" + b" " * (MAX_LINE + 10) + b"\n")
    assert guest.stream.readline() == b""  # hung up
    guest.accept()  # and connected again: the guest goes on
    assert guest.ok("stat", vid, path="")["attr"]["type"] == "directory"
    port.close()
    assert not port.alive()


def test_a_writer_of_a_name_removed_or_replaced_publishes_nothing_over_it(served):
    store, volumes, vid, _, guest, _ = served
    guest.ok("create", vid, path="log", mode=0o644, fh=1)
    guest.ok("write", vid, b"old writer", fh=1, path="log", off=0)
    guest.ok("create", vid, path="log.new", mode=0o644, fh=2)
    guest.ok("write", vid, b"new file", fh=2, path="log.new", off=0)
    guest.ok("release", vid, fh=2, path="log.new")
    guest.ok("rename", vid, path="log.new", to="log")  # replaces the file fh 1 still writes
    guest.ok("write", vid, b"!", fh=1, path="log", off=10)  # an unlinked open file takes writes...
    guest.ok("release", vid, fh=1, path="log")  # ...and publishes nothing
    assert b"".join(read_bytes(store, volumes.get(vid).entry("log"))) == b"new file"
    guest.ok("create", vid, path="tmp", mode=0o644, fh=3)
    guest.ok("unlink", vid, path="tmp")
    guest.ok("write", vid, b"scratch", fh=3, path="tmp", off=0)
    guest.ok("release", vid, fh=3, path="tmp")
    assert "tmp" not in volumes.get(vid).entries  # not brought back
    assert guest.call("write", vid, b"late", fh=3, path="tmp", off=0)[0]["errno"] == errno.EBADF


def test_metadata_no_reader_could_hold_is_refused(served):
    _, volumes, vid, _, guest, port = served
    guest.ok("create", vid, path="f", mode=0o644, fh=1)
    before = volumes.get(vid).encode()
    for fields in ({"uid": -1}, {"gid": 1 << 40}, {"mode": 0o100644}, {"mtime": 1e300}, {"mtime": -5}):
        assert guest.call("setattr", vid, path="f", **fields)[0]["errno"] == errno.EINVAL, fields
    guest.conn.sendall(b'{"id": 900, "op": "setattr", "vol": "' + vid.encode() + b'", "path": "f", "mtime": NaN}\n')
    assert guest.reply()[0] == {"id": 900, "errno": errno.EINVAL}
    guest.conn.sendall(b"[" * 60000 + b"\n")  # nesting json cannot parse: not a request, the port goes on
    assert guest.ok("stat", vid, path="f")["attr"]["size"] == 0
    assert volumes.get(vid).encode() == before and port.alive()


def test_a_held_port_runs_nothing_until_released(served):
    _, _, vid, _, guest, port = served
    with port.held(timeout=5):
        rid = guest.send("stat", vid, path="")
        assert select.select([guest.conn], [], [], 0.5)[0] == []  # no answer while held
    reply, _ = guest.reply()
    assert reply["id"] == rid and reply["errno"] == 0


def test_an_mtime_set_after_the_last_write_survives_the_close(served):
    _, volumes, vid, _, guest, _ = served
    guest.ok("create", vid, path="copied", mode=0o644, fh=1)
    guest.ok("write", vid, b"data", fh=1, path="copied", off=0)
    guest.ok("setattr", vid, path="copied", fh=1, mtime=1_000_000_000.5)  # cp -p: futimens before close
    guest.ok("release", vid, fh=1, path="copied")
    assert volumes.get(vid).entry("copied").mtime == 1_000_000_000.5


def test_the_port_is_reached_however_long_its_sockets_path(tmp_path: Path) -> None:
    """A VM's sockets sit under its state directory, whose path may pass sun_path's 108 bytes."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    store = open_store(str(tmp_path / "store"))
    vol = Volumes(store.backend).create("data", "alpha")
    files = VolumeFiles(store, vol.id, tmp_path / "staging", max_staged=1 << 20, index_ttl=0.0)
    guest = Guest(deep / "volumes.sock")
    acceptor = threading.Thread(target=guest.accept)
    acceptor.start()
    port = VolumePort(deep / "volumes.sock", {vol.id: files}, Replies(), name="sblong").start()
    acceptor.join()
    try:
        assert len(str(deep / "volumes.sock")) > 108
        assert guest.ok("stat", vol.id, path="")["attr"]["type"] == "directory"
    finally:
        port.close()
        guest.close()
        store.close()
