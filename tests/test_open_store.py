"""open_store: explicit settings, never the environment, and the read path it assembles."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerstore.errors import InvalidInput
from layerstore.readthrough import ReadThroughBackend
from layerstore.config import NodeConfig
from layerstore.store import open_store


def test_a_local_store_reads_no_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_REMOTE", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("STRATA_PEERS", "http://127.0.0.1:9")
    with open_store(str(tmp_path / "s")) as store:
        assert isinstance(store.read_path, ReadThroughBackend) and store.read_path.fallbacks == ()
        assert store.describe_read_path() == store.describe()


def test_the_read_path_is_peers_then_the_remote(tmp_path: Path) -> None:
    open_store(str(tmp_path / "remote")).close()
    with open_store(str(tmp_path / "s"), remote=str(tmp_path / "remote"), peers=["http://a:1", "http://b:2"],
                    peer_key="k" * 8) as store:
        assert [f.label for f in store.read_path.fallbacks] == ["peer", "peer", "remote"]
        assert store.describe_read_path() == (f"{tmp_path / 's'} -> peer http://a:1 -> peer http://b:2 -> "
                                              f"remote {tmp_path / 'remote'}")
    with open_store(str(tmp_path / "s"), remote=str(tmp_path / "s")) as store:  # itself: no fallback
        assert store.read_path.fallbacks == ()


def test_an_s3_store_needs_a_state_dir(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="state dir"):
        open_store("s3://bucket/prefix", s3_endpoint="http://127.0.0.1:9")


def test_node_config_gives_open_store_its_settings(tmp_path: Path) -> None:
    (tmp_path / "none.toml").write_text("")
    config = NodeConfig.load({"STRATA_S3_ENDPOINT": "http://x:1", "STRATA_S3_PATH_STYLE": "false",
                              "STRATA_REMOTE": "s3://b/p", "STRATA_PEERS": "http://a:1,,http://b:2",
                              "STRATA_PEER_KEY": "secret-key", "STRATA_STATE_DIR": str(tmp_path),
                              "STRATA_CONFIG": str(tmp_path / "none.toml"), "AWS_SECRET_ACCESS_KEY": "not ours"},
                             require_store=False)
    assert config.store_options() == {"s3_endpoint": "http://x:1", "s3_region": "", "s3_path_style": False,
                                      "remote": "s3://b/p", "peers": ("http://a:1", "http://b:2"),
                                      "peer_key": "secret-key", "state_dir": tmp_path}
    assert config.store_options(own=False)["remote"] == "" and config.store_options(own=False)["peers"] == ()


def test_reap_tmp_removes_only_what_crashed_writers_left(tmp_path: Path) -> None:
    import os
    import time

    with open_store(str(tmp_path / "s")) as store:
        tmp = next(p for p in (tmp_path / "s").rglob("tmp") if p.is_dir())  # the local backend's temp dir
        old, fresh = tmp / "old.part", tmp / "fresh.part"
        old.write_bytes(b"x")
        fresh.write_bytes(b"y")
        os.utime(old, (time.time() - 2 * 86400,) * 2)
        assert store.reap_tmp() == 1
        assert not old.exists() and fresh.exists()  # a live writer's file is never touched
