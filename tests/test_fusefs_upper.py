"""Copy-on-write sandbox disks: isolation, durability, seal under writers."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from fusefs.cache import ChunkCache
from fusefs.fetch import ChunkFetcher
from fusefs.control import check_sid
from fusefs.upper import ChunkReader, UpperLayer, _read_checked
from fusefs.view import LayerView
from layerstore.delta import publish_delta
from layerstore.errors import InvalidInput
from layerstore.exporter import export_image
from layerstore.importer import import_image
from layerstore.store import Store, open_store
from tests.images import MiB, write_image

CS = 64 * 1024


class Env:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.store: Store = open_store(str(tmp / "store"))
        self.content = write_image(tmp / "base.img", "rzrprzrr", chunk=CS, tail=1000)
        res = import_image(self.store, tmp / "base.img", "base:v1", chunk_size=CS)
        self.base_id = res.manifest_id
        self.fetcher = ChunkFetcher(self.store, ChunkCache(tmp / "cache", capacity=64 * MiB))

    def view(self, manifest_id: str) -> LayerView:
        return LayerView.of(self.fetcher, manifest_id)

    def new_upper(self, sid: str) -> UpperLayer:
        return UpperLayer.create(self.tmp / "uppers" / sid, self.view(self.base_id), relower=self.view)

    def reopen(self, sid: str) -> UpperLayer:
        root = self.tmp / "uppers" / sid
        state = UpperLayer.read_state(root)
        return UpperLayer(root, self.view(str(state["base"])), state, relower=self.view)

    def publish(self, upper: UpperLayer, read_chunk: ChunkReader, dirty: list[int], base: str) -> str:
        return publish_delta(self.store, read_chunk, upper.size, parent=base, slots=dirty,
                             read_base=self.fetcher.read).manifest_id


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path)


def run_now(job):  # noqa: ANN001, ANN201 - runs a seal job synchronously
    job()


def test_reads_see_lower_then_writes(env: Env) -> None:
    up = env.new_upper("a")
    assert up.read(0, up.size) == env.content
    up.write(CS - 3, b"XYZWV")  # spans chunks 0 and 1 (a hole)
    expected = bytearray(env.content)
    expected[CS - 3 : CS + 2] = b"XYZWV"
    assert up.read(0, up.size) == bytes(expected)
    assert up.read(up.size - 10, 100) == expected[-10:]  # clamped at the end
    assert up.read(up.size, 10) == b""


def test_sandboxes_over_one_base_are_isolated(env: Env) -> None:
    a, b = env.new_upper("a"), env.new_upper("b")
    a.write(10, b"from-a")
    b.write(10, b"from-b")
    assert a.read(10, 6) == b"from-a" and b.read(10, 6) == b"from-b"
    assert env.view(env.base_id).read(10, 6) == env.content[10:16]


def test_bad_writes_and_ids_refused(env: Env) -> None:
    up = env.new_upper("a")
    with pytest.raises(InvalidInput):
        up.write(up.size - 2, b"toolong")
    for sid in ("", "../x", "a/b", ".hidden", "x" * 65):
        with pytest.raises(InvalidInput):
            check_sid(sid)
    with pytest.raises(InvalidInput):
        env.new_upper("a")


def test_write_ready_never_waits_and_never_writes_half(env: Env) -> None:
    """The event loop's shortcut copies a chunk up only from what needs no
    waiting (a hole, a chunk in memory, a frozen generation), never while a
    seal switches or another writer holds the chunk; a None wrote nothing."""
    assert env.content[CS : 2 * CS] == bytes(CS)  # chunk 1 of "rzrp..." is a hole, chunk 0 random
    up = env.new_upper("a")
    expected = bytearray(env.content)
    assert up.write_ready(10, b"fetch") is None  # chunk 0 is neither cached nor in memory yet
    assert up.current.dirty_indices() == []
    assert up.write_ready(CS + 10, b"hole") == 4  # copied up from zeros
    assert up.write_ready(2 * CS, b"x" * CS) == CS  # a whole chunk: nothing to copy up
    assert up.write_ready(3 * CS + 4096, b"p" * 4096) == 4096  # whole pages: recorded, chunk 3 not fetched
    assert 3 in up.current.pages and not up.current.is_dirty(3)
    up.read(0, 16)  # chunk 0 is now in memory
    assert up.write_ready(10, b"ready") == 5
    assert up.write_ready(up.size - 1, b"past") is None
    up._lock.acquire_exclusive()  # a seal switching generations
    try:
        assert up.write_ready(CS + 20, b"held") is None
    finally:
        up._lock.release_exclusive()
    with up._chunk_lock(4):  # another writer copying chunk 4 up
        assert up.write_ready(4 * CS + 1, b"busy") is None
    expected[CS + 10 : CS + 14] = b"hole"
    expected[10:15] = b"ready"
    expected[2 * CS : 3 * CS] = b"x" * CS
    expected[3 * CS + 4096 : 3 * CS + 8192] = b"p" * 4096
    assert up.read(0, up.size) == bytes(expected)
    assert up.current.dirty_indices() == [0, 1, 2, 3]


def test_a_volatile_layer_orders_without_flushing_the_disk(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """A VM's RAM: fsync still leaves every write (and the dirty map) where
    a restarted daemon finds it, but never waits for the host's disk."""
    flushes: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushes.append(fd), real_fsync(fd)))
    ram = UpperLayer.create(env.tmp / "uppers" / "a.mem", env.view(env.base_id), relower=env.view, volatile=True)
    ram.write(3 * CS + 5, b"in ram")
    ram.fsync()
    jobs: list = []
    ticket = ram.seal(lambda up, path, dirty, base: env.publish(up, path, dirty, base), jobs.append)
    assert flushes == []  # neither the fsync nor the seal's switch (the store's own writes are durable)
    jobs[0]()
    ticket.result()
    again = env.reopen("a.mem")
    assert again.volatile and again.read(3 * CS + 5, 6) == b"in ram"
    disk = env.new_upper("b")
    disk.write(3 * CS + 5, b"on disk")
    disk.fsync()
    assert flushes and not disk.volatile


def test_a_seal_leaves_flushing_to_fsync_and_loses_nothing_fsynced(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seal's switch never flushes the generation it freezes (a second
    under a fast writer); the next fsync does, so a write made before a
    seal and fsynced after it survives a crash before the publication."""
    up = env.new_upper("a")
    up.write(2 * CS + 3, b"before the seal")
    flushed: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(fd), real_fsync(fd)))
    jobs: list = []
    up.seal(env.publish, jobs.append)
    frozen = up.sealing[0]
    assert frozen.fd not in flushed
    up.fsync()
    assert frozen.fd in flushed
    again = env.reopen("a")  # the daemon died before publishing
    assert again.read(2 * CS + 3, 15) == b"before the seal"
    manifest = again.resume_seals(env.publish, run_now)[0].result(5)
    assert env.view(manifest).read(2 * CS + 3, 15) == b"before the seal"


def test_generation_files_a_crash_left_or_lost_read_as_empty(env: Env) -> None:
    """A seal's switch writes nothing durably: after a crash the state may
    name a generation whose files never reached the disk (it is empty), or
    not name one whose stale files did (a new one of that name ignores them)."""
    up = env.new_upper("a")
    stale = up.root / "gen-2.data"
    stale.write_bytes(b"S" * up.size)
    (up.root / "gen-2.dirty").write_bytes(b"\xff" * len(up.current.bitmap))
    up.seal(env.publish, lambda job: None)  # gen 2 is created over the leftovers
    assert up.current.gen == 2 and up.current.dirty_indices() == []
    assert up.read(0, up.size) == env.content
    up.write(5, b"x")
    up.fsync()
    for leftover in ("gen-2.data", "gen-2.dirty"):  # as if the switch's files were lost
        (up.root / leftover).unlink()
    again = env.reopen("a")
    assert again.current.gen == 2 and again.read(0, again.size) == env.content


def test_fsynced_writes_survive_reopen(env: Env) -> None:
    up = env.new_upper("a")
    up.write(3 * CS + 5, b"durable")
    up.fsync()
    up.write(5 * CS, b"maybe")  # not fsynced: may or may not survive
    # simulate a crash: no close(), just load from disk again
    again = env.reopen("a")
    assert again.read(3 * CS + 5, 7) == b"durable"
    assert again.read(0, CS) == env.content[:CS]


def test_page_writes_record_pages_and_a_seal_publishes_whole_chunks(env: Env) -> None:
    """Whole-page writes to a chunk the generation lacks keep just those
    pages: reads merge them with what is below (a frozen generation's pages
    too), an unaligned write completes the chunk around them, fsync keeps
    them across a restart, and a published layer holds whole chunks."""
    up = env.new_upper("a")
    expected = bytearray(env.content)

    def write(offset: int, data: bytes) -> None:
        up.write(offset, data)
        expected[offset : offset + len(data)] = data

    write(4096, b"A" * 4096)
    write(3 * 4096, b"B" * 8192)
    write(7 * CS, b"C" * 1000)  # the disk's last chunk is 1000 bytes: one short page, whole
    assert sorted(up.current.pages) == [0] and up.current.is_dirty(7)
    assert up.read(0, up.size) == bytes(expected)
    jobs: list = []
    first = up.seal(env.publish, jobs.append)  # frozen with a partial chunk 0
    write(2 * 4096, b"D" * 4096)  # partial over partial, one generation up
    assert up.read(0, CS) == bytes(expected[:CS])
    write(CS - 4096 + 7, b"unaligned")  # completes chunk 0 from the frozen pages and the image
    assert up.current.is_dirty(0) and not up.current.pages
    write(5 * CS + 4096, b"E" * 4096)
    up.fsync()
    again = env.reopen("a")
    assert again.current.pages.keys() == {5} and again.read(0, again.size) == bytes(expected)
    jobs[0]()
    sealed = env.view(first.result(5))
    assert sealed.read(0, CS) == env.content[:4096] + b"A" * 4096 + env.content[8192:12288] + b"B" * 8192 + env.content[20480:CS]
    assert up.seal(env.publish, run_now).result(5) and up.read(0, up.size) == bytes(expected)
    env.store.set_ref("sealed:v2", up.base)
    export_image(env.store, "sealed:v2", env.tmp / "sealed.img")
    assert (env.tmp / "sealed.img").read_bytes() == bytes(expected)


def test_seal_publishes_exactly_the_dirty_chunks(env: Env) -> None:
    up = env.new_upper("a")
    up.write(CS + 1, b"one")
    up.write(4 * CS, bytes(CS))  # zeros over a data chunk: a whiteout
    before = up.read(0, up.size)
    ticket = up.seal(env.publish, run_now)
    new_id = ticket.result(5)
    layer = env.store.get_layer(new_id)
    assert layer.parent == env.base_id and set(layer.chunks) == {1, 4} and layer.chunks[4] is None
    assert up.base == new_id and up.layers == [new_id] and up.sealing == []
    assert up.read(0, up.size) == before
    env.store.set_ref("sealed:v1", new_id)
    export_image(env.store, "sealed:v1", env.tmp / "sealed.img")
    assert (env.tmp / "sealed.img").read_bytes() == before
    # nothing dirty: sealing again publishes nothing new
    assert up.seal(env.publish, run_now).result(5) == new_id


def test_seal_while_writing_loses_and_duplicates_nothing(env: Env) -> None:
    up = env.new_upper("a")
    blocks = up.size // 4096
    stop_at = min(blocks, 300)
    sealed_at = threading.Event()
    jobs: list = []

    def writer() -> None:
        for k in range(stop_at):
            up.write(k * 4096, k.to_bytes(4, "little") * 1024)
            if k == stop_at // 2:
                sealed_at.wait(5)

    t = threading.Thread(target=writer)
    t.start()
    while not up.current.dirty_indices():
        pass
    ticket = up.seal(env.publish, jobs.append)  # publish later, writer still running
    sealed_at.set()
    t.join()
    jobs[0]()
    new_id = ticket.result(5)
    final = up.read(0, up.size)
    for k in range(stop_at):
        assert final[k * 4096 : k * 4096 + 4] == k.to_bytes(4, "little"), k
    # the sealed layer holds a prefix of the writes: every block is either written or original
    sealed = env.view(new_id).read(0, up.size)
    written = [sealed[k * 4096 : k * 4096 + 4096] == k.to_bytes(4, "little") * 1024 for k in range(stop_at)]
    cut = written.index(False) if False in written else stop_at
    assert all(written[:cut]) and not any(written[cut:])
    assert ticket.switched_in < 1.0


def test_interrupted_seal_resumes_after_restart(env: Env) -> None:
    up = env.new_upper("a")
    up.write(7, b"sealme")
    jobs: list = []
    up.seal(env.publish, jobs.append)  # switched, never published: the process "dies"
    up.write(100, b"second")
    up.seal(env.publish, jobs.append)
    up.fsync()  # a switch does not flush (the job does, first): the guest's fsync did
    assert len(up.sealing) == 2
    again = env.reopen("a")
    assert again.read(7, 6) == b"sealme" and again.read(100, 6) == b"second"  # through the frozen generations
    tickets = again.resume_seals(env.publish, run_now)
    first, second = (t.result(5) for t in tickets)
    assert env.store.get_layer(first).parent == env.base_id
    assert env.store.get_layer(second).parent == first
    assert again.sealing == [] and again.layers == [first, second]
    assert again.read(7, 6) == b"sealme" and again.read(100, 6) == b"second"


def test_back_to_back_seals_queue_and_publish_in_order(env: Env) -> None:
    up = env.new_upper("a")
    jobs: list = []
    tickets = []
    for i in range(5):
        up.write(i * CS + 1, f"gen{i}".encode())
        tickets.append(up.seal(env.publish, jobs.append))  # no refusal while earlier seals are queued
        up.write(i * CS + 1, f"GEN{i}".encode())  # overwritten after the seal: must not leak into it
    assert len(up.sealing) == 5
    for job in reversed(jobs):  # even run out of order, layers chain oldest first
        job()
    ids = [t.result(5) for t in tickets]
    assert up.layers == ids and up.sealing == []
    for i, manifest_id in enumerate(ids):
        assert env.store.get_layer(manifest_id).parent == (ids[i - 1] if i else env.base_id)
        view = env.view(manifest_id)
        assert view.read(i * CS + 1, 4) == f"gen{i}".encode()
    assert up.read(4 * CS + 1, 4) == b"GEN4"


def test_failed_publication_stays_queued_and_retries(env: Env) -> None:
    up = env.new_upper("a")
    up.write(5, b"keep")

    def broken(*args):  # noqa: ANN002, ANN202
        raise RuntimeError("store down")

    ticket = up.seal(broken, run_now)
    with pytest.raises(RuntimeError):
        ticket.result(5)
    assert len(up.sealing) == 1 and up.read(5, 4) == b"keep"
    retry = up.seal(env.publish, run_now)  # the next seal publishes both, in order
    manifest_id = retry.result(5)
    assert up.sealing == [] and len(up.layers) == 1  # the second generation was empty
    assert env.view(manifest_id).read(5, 4) == b"keep"


def test_a_disk_larger_than_its_image_reads_zeros_past_it_and_seals_whole(env: Env) -> None:
    """The image ends mid-chunk (`tail`): the rest of that chunk and all
    past it read as zeros, are writable, and a seal keeps the larger size."""
    base_size = len(env.content)
    up = UpperLayer.create(env.tmp / "uppers" / "big", env.view(env.base_id), relower=env.view,
                           size=base_size + 5 * CS)
    assert up.size == base_size + 5 * CS
    assert up.read(0, up.size) == env.content + bytes(5 * CS)
    up.write(base_size - 2, b"across-the-old-end")
    up.write(up.size - 4, b"last")
    expected = bytearray(env.content + bytes(5 * CS))
    expected[base_size - 2:base_size + 16] = b"across-the-old-end"
    expected[-4:] = b"last"
    assert up.read(0, up.size) == bytes(expected)
    sealed = up.seal(env.publish, run_now).result(5)
    assert env.store.get_layer(sealed).size == up.size
    env.store.set_ref("big:v1", sealed)
    export_image(env.store, "big:v1", env.tmp / "big.img")
    assert (env.tmp / "big.img").read_bytes() == bytes(expected)
    again = UpperLayer.create(env.tmp / "uppers" / "again", env.view(sealed), relower=env.view)
    assert again.size == up.size and again.read(0, again.size) == bytes(expected)
    for bad in (base_size - 1, 1 << 60):
        with pytest.raises(InvalidInput, match="disk size"):
            UpperLayer.create(env.tmp / "uppers" / f"bad{bad}", env.view(env.base_id), relower=env.view, size=bad)


def test_a_seals_state_record_is_overwritten_in_place_and_checked(env: Env) -> None:
    """A seal's switch records the state in state.next, in place (a rename
    under a fast writer waited up to 117 ms for ext4 to write the file);
    a reopen reads the newer of the two records, and a torn or stale
    state.next is never read."""
    up = env.new_upper("a")
    up.write(5, b"x")
    up.fsync()
    durable = (up.root / "state.json").read_bytes()
    up.seal(env.publish, lambda job: None)
    assert (up.root / "state.json").read_bytes() == durable  # not replaced
    next_inode = (up.root / "state.next").stat().st_ino
    up.write(CS + 1, b"after the seal")
    up.fsync()  # makes the first switch durable: state.json
    durable = (up.root / "state.json").read_bytes()
    up.seal(env.publish, lambda job: None)
    assert (up.root / "state.json").read_bytes() == durable
    assert (up.root / "state.next").stat().st_ino == next_inode  # overwritten, not renamed
    again = env.reopen("a")
    assert again.current.gen == 3 and [g.gen for g in again.sealing] == [1, 2]
    assert again.read(CS + 1, 14) == b"after the seal"
    # torn: the record no longer matches its digest -> the durable state
    record = (up.root / "state.next").read_bytes()
    (up.root / "state.next").write_bytes(record.replace(b'"gen": 3', b'"gen": 4'))
    assert UpperLayer.read_state(up.root)["gen"] == 2
    (up.root / "state.next").write_bytes(record)
    assert UpperLayer.read_state(up.root)["gen"] == 3
    # a durable record supersedes it: the publications are in state.json
    for ticket in again.resume_seals(env.publish, run_now):
        ticket.result(5)
    state = UpperLayer.read_state(up.root)
    assert state == json.loads((up.root / "state.json").read_text()) and state["sealing"] == []
    stale = _read_checked(up.root / "state.next")
    assert stale is not None and stale["seq"] < state["seq"]  # type: ignore[operator]


def test_read_ready_never_waits_and_reads_what_read_reads(env: Env) -> None:
    """The event loop's read shortcut: a generation's own pages, over a hole
    or a chunk already in memory; None where a fetch or a seal's switch
    would be waited for, across chunks, or where the generations' own pages
    are read past its byte bound."""
    assert env.content[CS : 2 * CS] == bytes(CS)  # chunk 1 is a hole
    up = env.new_upper("a")
    assert up.read_ready(10, 16) is None  # chunk 0 is neither cached nor in memory yet
    assert up.read_ready(CS + 5, 100) == bytes(100)
    up.write(3 * CS + 4096, b"p" * 4096)  # whole pages: recorded, chunk 3 not fetched
    assert up.read_ready(3 * CS + 4096, 4096) == b"p" * 4096
    assert up.read_ready(3 * CS, 8192) is None  # its first page is below, not fetched
    up.read(0, 16)
    up.read(3 * CS, 16)
    up.read(up.size - 5, 5)  # chunks 0, 3 and the last are now in memory
    up.write(20, b"over")
    for offset, length in ((10, 16), (3 * CS, 8192), (3 * CS + 4000, 200), (CS - 8, 8), (up.size - 5, 50)):
        assert up.read_ready(offset, length) == up.read(offset, length)
    assert up.read_ready(CS - 8, 16) is None  # across two chunks
    assert up.read_ready(0, 8192, max_disk_read=4096) is None  # its own pages: a disk read past the bound
    up.read(2 * CS, 16)  # a chunk with no pages of its own, in memory: served whole past the bound
    assert env.content[2 * CS : 3 * CS] != bytes(CS)
    assert up.read_ready(2 * CS, CS, max_disk_read=4096) == env.content[2 * CS : 3 * CS]
    up._lock.acquire_exclusive()  # a seal switching generations
    try:
        assert up.read_ready(10, 16) is None
    finally:
        up._lock.release_exclusive()
