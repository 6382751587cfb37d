"""The Backend contract (layerstore/backend.py), run against every backend."""

from __future__ import annotations

import time

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from layerstore.backend import Backend, RetryingBackend, check_key
from layerstore.errors import BackendUnavailable, InvalidInput, NotFound


def test_put_get_roundtrip(backend: Backend) -> None:
    for size in (1 << 20, (1 << 20) + 123):  # (a local store writing direct: an aligned head, a short tail)
        data = os.urandom(size)
        backend.put("chunks/ab/obj", data)
        assert backend.get("chunks/ab/obj") == data
        assert backend.stat("chunks/ab/obj") == len(data)


def test_empty_object(backend: Backend) -> None:
    backend.put("refs/x/empty", b"")
    assert backend.get("refs/x/empty") == b""
    assert backend.stat("refs/x/empty") == 0


def test_missing_key(backend: Backend) -> None:
    with pytest.raises(NotFound):
        backend.get("chunks/00/nope")
    assert backend.stat("chunks/00/nope") is None


def test_overwrite_replaces_whole_object(backend: Backend) -> None:
    backend.put("refs/a/b", b"first version, longer")
    backend.put("refs/a/b", b"second")
    assert backend.get("refs/a/b") == b"second"


def test_has_many_returns_exactly_present(backend: Backend) -> None:
    present = [f"chunks/{i:02x}/k{i}" for i in range(20)]
    for key in present:
        backend.put(key, key.encode())
    absent = [f"chunks/{i:02x}/missing{i}" for i in range(20)]
    assert backend.has_many(present + absent) == set(present)
    assert backend.has_many([]) == set()


def test_list_prefix_and_sizes(backend: Backend) -> None:
    backend.put("chunks/aa/one", b"1")
    backend.put("chunks/ab/two", b"22")
    backend.put("manifests/m1", b"333")
    backend.put("refs/img/v1", b"4444")
    assert {o.key: o.size for o in backend.list("chunks/")} == {"chunks/aa/one": 1, "chunks/ab/two": 2}
    assert {o.key: o.size for o in backend.list("chunks/aa")} == {"chunks/aa/one": 1}
    assert {o.key: o.size for o in backend.list("refs/")} == {"refs/img/v1": 4}
    everything = {o.key: o.size for o in backend.list("")}
    assert set(everything) == {"chunks/aa/one", "chunks/ab/two", "manifests/m1", "refs/img/v1"}


def test_list_reports_when_each_object_was_put(backend: Backend) -> None:
    """GC's grace period rests on `modified`: it must be the put time, and a re-put moves it."""
    before = time.time()
    backend.put("refs/a/old", b"1")
    info = {o.key: o for o in backend.list("refs/a/")}["refs/a/old"]
    assert before - 5 <= info.modified <= time.time() + 5
    time.sleep(1.1)
    backend.put("refs/a/old", b"2")
    again = {o.key: o for o in backend.list("refs/a/")}["refs/a/old"]
    assert again.modified > info.modified


def test_list_many_keys_each_once(backend: Backend) -> None:
    keys = [f"manifests/k{i:05d}" for i in range(1100)]  # more than one S3 page
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: backend.put(k, b"x"), keys))
    listed = [o.key for o in backend.list("manifests/")]
    assert sorted(listed) == keys


def test_delete_many_removes_present_keys_and_ignores_absent_ones(backend: Backend) -> None:
    keys = [f"chunks/dd/k{i:04d}" for i in range(1203)]  # more than one S3 DeleteObjects batch
    for key in keys[:1200]:
        backend.put(key, b"x")
    backend.put("refs/keep/me", b"y")
    backend.delete_many(keys)
    assert [o.key for o in backend.list("chunks/")] == []
    assert backend.get("refs/keep/me") == b"y"
    backend.delete_many([])


def test_delete_is_idempotent(backend: Backend) -> None:
    backend.put("refs/a/b", b"x")
    backend.delete("refs/a/b")
    backend.delete("refs/a/b")
    assert backend.stat("refs/a/b") is None
    with pytest.raises(NotFound):
        backend.get("refs/a/b")


def test_concurrent_puts_of_same_key_leave_one_whole_value(backend: Backend, request: pytest.FixtureRequest) -> None:
    if "moto" in request.node.callspec.id:
        pytest.skip("moto's in-process S3 model is not thread-safe for concurrent PUTs of one key; local and SeaweedFS cover it")
    values = [bytes([i]) * 65536 for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda v: backend.put("chunks/cc/same", v), values))
    assert backend.get("chunks/cc/same") in values


def test_head_gives_size_store_time_and_a_version_that_changes_with_each_put(backend: Backend) -> None:
    assert backend.head("locks/h") is None
    backend.put("locks/h", b"one")
    first = backend.head("locks/h")
    assert first is not None and first.size == 3 and first.version and abs(first.modified - time.time()) < 300
    backend.put("locks/h", b"other")
    second = backend.head("locks/h")
    assert second is not None and second.size == 5 and second.version != first.version


def test_put_new_only_when_absent(backend: Backend) -> None:
    version = backend.put_new("locks/n", b"mine")
    assert version and backend.get("locks/n") == b"mine"
    assert backend.put_new("locks/n", b"theirs") is None and backend.get("locks/n") == b"mine"
    backend.delete("locks/n")
    assert backend.put_new("locks/n", b"again")


def test_put_if_only_while_unchanged(backend: Backend) -> None:
    backend.put("locks/c", b"v1")
    v1 = backend.head("locks/c").version  # type: ignore[union-attr]
    v2 = backend.put_if("locks/c", b"v2", v1)
    assert v2 and backend.get("locks/c") == b"v2"
    assert backend.put_if("locks/c", b"v3", v1) is None and backend.get("locks/c") == b"v2"  # stale version
    backend.delete("locks/c")
    assert backend.put_if("locks/c", b"v4", v2) is None and backend.head("locks/c") is None  # deleted meanwhile


def test_concurrent_put_new_exactly_one_wins(backend: Backend, request: pytest.FixtureRequest) -> None:
    if "moto" in request.node.callspec.id:
        pytest.skip("moto's in-process S3 model is not thread-safe for concurrent PUTs of one key; local and "
                    "SeaweedFS cover it")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        won = [v for v in pool.map(lambda i: backend.put_new("locks/race", str(i).encode()), range(16)) if v]
    assert len(won) == 1


@pytest.mark.parametrize("key", ["", "../etc/passwd", "a/../b", "/abs", "a//b", "a/./b", "sp ace", "nul\0x", "a\\b"])
def test_bad_keys_refused_before_io(backend: Backend, key: str) -> None:
    with pytest.raises(InvalidInput):
        backend.put(key, b"x")
    with pytest.raises(InvalidInput):
        backend.get(key)


def test_check_key_accepts_layout_keys() -> None:
    assert check_key("chunks/ab/" + "ab" * 32) == "chunks/ab/" + "ab" * 32
    assert check_key("refs/my-image/v1.2_3") == "refs/my-image/v1.2_3"


class FlakyBackend:
    """Fails the first `failures` calls transiently, then delegates."""

    def __init__(self, inner: Backend, failures: int) -> None:
        self.inner, self.failures, self.calls = inner, failures, 0

    def __getattr__(self, name: str):  # noqa: ANN204 - pass-through
        target = getattr(self.inner, name)

        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.calls += 1
            if self.calls <= self.failures:
                raise BackendUnavailable("transient")
            return target(*args, **kwargs)

        return call


def test_retry_wrapper_retries_transient_then_succeeds(tmp_path) -> None:
    from layerstore.localdir import LocalDirBackend

    inner = LocalDirBackend(tmp_path / "s")
    flaky = FlakyBackend(inner, failures=2)
    delays: list[float] = []
    retrying = RetryingBackend(flaky, attempts=3, base_delay=0.01, sleep=delays.append)  # type: ignore[arg-type]
    retrying.put("refs/a/b", b"ok")
    assert inner.get("refs/a/b") == b"ok"
    assert len(delays) == 2 and delays[1] > delays[0] * 0.9


def test_retry_wrapper_gives_up_after_attempts(tmp_path) -> None:
    from layerstore.localdir import LocalDirBackend

    flaky = FlakyBackend(LocalDirBackend(tmp_path / "s"), failures=100)
    retrying = RetryingBackend(flaky, attempts=3, base_delay=0.0, sleep=lambda s: None)  # type: ignore[arg-type]
    with pytest.raises(BackendUnavailable):
        retrying.get("refs/a/b")
    assert flaky.calls == 3


def test_retry_wrapper_does_not_retry_not_found(tmp_path) -> None:
    from layerstore.localdir import LocalDirBackend

    flaky = FlakyBackend(LocalDirBackend(tmp_path / "s"), failures=0)
    retrying = RetryingBackend(flaky, attempts=5, base_delay=0.0, sleep=lambda s: None)  # type: ignore[arg-type]
    with pytest.raises(NotFound):
        retrying.get("refs/a/b")
    assert flaky.calls == 1


# wrappers beyond the contract ---------------------------------------------------
def _chunk(data: bytes) -> tuple[str, bytes]:
    from layerstore.chunk import chunk_key, encode_chunk
    from layerstore.digest import digest_bytes

    return chunk_key(digest_bytes(data)), encode_chunk(data)


class Unreachable:
    """A source that is down."""

    def get(self, key: str) -> bytes:
        raise BackendUnavailable("connection refused (injected)")

    def has_many(self, keys) -> set[str]:  # noqa: ANN001
        raise BackendUnavailable("connection refused (injected)")

    def describe(self) -> str:
        return "down"

    def close(self) -> None:
        pass


def test_read_through_asks_fallbacks_in_order_and_skips_what_fails_verification(tmp_path) -> None:
    from layerstore.localdir import LocalDirBackend
    from layerstore.readthrough import Fallback
    from layerstore.store import chunk_read_path

    key, blob = _chunk(b"wanted" * 1000)
    other_key, other_blob = _chunk(b"something else")
    liar, honest, primary = (LocalDirBackend(tmp_path / n) for n in ("liar", "honest", "primary"))
    liar.put(key, other_blob)  # the wrong object under the asked key
    honest.put(key, blob)
    failures: list[str] = []
    rt = chunk_read_path(primary, [Fallback("peer", liar, best_effort=True, on_failure=failures.append),
                                   Fallback("remote", honest)])
    assert rt.get(key) == blob
    assert rt.counts == {"peer_rejected": 1, "remote": 1} and "fails verification" in failures[0]
    assert primary.stat(key) is None and rt.stat(key) is None  # nothing written back; existence is the primary's
    assert rt.has_many([key]) == set() and rt.readable_many([key, other_key]) == {key}
    honest.put("refs/a/b", b"x")
    with pytest.raises(NotFound):
        rt.get("refs/a/b")  # only chunks read through
    primary.put(key, blob)
    assert rt.get(key) == blob and rt.counts["local"] == 1


def test_read_through_errors_name_the_stores_and_tell_missing_from_unreachable(tmp_path) -> None:
    from layerstore.errors import CorruptObject
    from layerstore.localdir import LocalDirBackend
    from layerstore.readthrough import Fallback
    from layerstore.store import chunk_read_path

    key, blob = _chunk(b"wanted")
    _, other_blob = _chunk(b"other")
    primary, empty, broken = (LocalDirBackend(tmp_path / n) for n in ("primary", "empty", "broken"))
    broken.put(key, other_blob)
    with pytest.raises(NotFound, match="empty"):  # a dead peer is a miss: the chunk is missing
        chunk_read_path(primary, [Fallback("peer", Unreachable(), best_effort=True),
                                  Fallback("remote", empty)]).get(key)
    with pytest.raises(BackendUnavailable):  # a dead remote may hold it: not "missing"
        chunk_read_path(primary, [Fallback("remote", Unreachable())]).get(key)
    with pytest.raises(CorruptObject):
        chunk_read_path(primary, [Fallback("remote", broken)]).get(key)


def test_dry_run_backend_records_writes_and_passes_reads(tmp_path) -> None:
    from layerstore.backend import DryRunBackend
    from layerstore.localdir import LocalDirBackend

    inner = LocalDirBackend(tmp_path / "s")
    inner.put("refs/a/b", b"x")
    dry = DryRunBackend(inner)
    dry.put("refs/a/c", b"y")
    dry.delete("refs/a/b")
    dry.delete_many(["refs/a/b", "chunks/00/x"])
    assert dry.written == ["refs/a/c"] and dry.deleted == ["refs/a/b", "refs/a/b", "chunks/00/x"]
    assert dry.get("refs/a/b") == b"x" and dry.stat("refs/a/c") is None
    assert [o.key for o in dry.list("refs/")] == ["refs/a/b"] and dry.has_many(["refs/a/b"]) == {"refs/a/b"}
    with pytest.raises(InvalidInput):
        dry.delete("../x")
