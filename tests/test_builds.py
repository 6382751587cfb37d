"""api/builds.py's upload space on its own: links signed per team with an
expiry, tars checked before they are kept, and unused tars reaped. The
routes around them run in tests/attacks/test_builds.py against a real node."""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path

import pytest

from api.builds import (BUILD_KEEP, MAX_LOG_BYTES, MAX_LOGS, MAX_TEAM_BUILDS, UPLOAD_KEEP, UPLOAD_TTL, Build, Builds,
                        check_tar)
from api.teams import Caller, QuotaExceeded
from layerstore.errors import InvalidInput, NotFound

HASH = "ab" * 32


def builds(tmp_path: Path) -> Builds:
    return Builds(None, None, None, None, tmp_path / "files")  # type: ignore[arg-type]  # the upload space needs no node


def test_a_link_is_good_for_its_team_template_and_hash_until_it_expires(tmp_path: Path) -> None:
    b = builds(tmp_path)
    grant = b.upload_grant(Caller("alpha"), "tpl", HASH)
    assert b.check_grant("tpl", HASH, **grant) == b.upload_path("alpha", HASH)
    for changed in ({"team": "beta"}, {"expires": str(int(grant["expires"]) + 1)}, {"token": "0" * 64}):
        with pytest.raises(NotFound):
            b.check_grant("tpl", HASH, **{**grant, **changed})
    with pytest.raises(NotFound):
        b.check_grant("other", HASH, **grant)
    old = b.upload_grant(Caller("alpha"), "tpl", HASH, now=time.time() - UPLOAD_TTL - 5)
    with pytest.raises(NotFound, match="expired"):
        b.check_grant("tpl", HASH, **old)
    with pytest.raises(InvalidInput):
        b.upload_grant(Caller("alpha"), "tpl", "../" + HASH[3:])
    assert b.upload_path("alpha", HASH) != b.upload_path("beta", HASH)
    assert b.upload_path("../..", HASH).parent.parent == b.files  # a team name is never a path


def tar_with(tmp_path: Path, name: str, kind: bytes = tarfile.REGTYPE) -> Path:
    path = tmp_path / f"t{len(list(tmp_path.iterdir()))}.tar"
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.size = 3 if kind == tarfile.REGTYPE else 0
        tar.addfile(info, io.BytesIO(b"abc") if kind == tarfile.REGTYPE else None)
    return path


def test_only_a_tar_of_files_directories_and_links_with_plain_names_is_kept(tmp_path: Path) -> None:
    check_tar(tar_with(tmp_path, "app/main.py"))
    check_tar(tar_with(tmp_path, "./app", tarfile.DIRTYPE))
    check_tar(tar_with(tmp_path, "link", tarfile.SYMTYPE))
    for bad in (tar_with(tmp_path, "../x"), tar_with(tmp_path, "a/../../x"), tar_with(tmp_path, "/etc/x"),
                tar_with(tmp_path, "fifo", tarfile.FIFOTYPE), tar_with(tmp_path, "dev", tarfile.BLKTYPE)):
        with pytest.raises(InvalidInput):
            check_tar(bad)
    junk = tmp_path / "junk"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(InvalidInput, match="not a tar"):
        check_tar(junk)
    b = builds(tmp_path)
    dest = b.upload_path("alpha", HASH)
    with pytest.raises(InvalidInput):
        b.keep_upload(tar_with(tmp_path, "../x"), dest)
    assert not dest.exists()
    good = tar_with(tmp_path, "ok")
    b.keep_upload(good, dest)
    assert dest.read_bytes() == good.read_bytes() and good.exists()


def test_tars_no_build_used_for_a_week_are_reaped(tmp_path: Path) -> None:
    b = builds(tmp_path)
    fresh, stale = b.upload_path("alpha", HASH), b.upload_path("beta", HASH)
    for path in (fresh, stale):
        b.keep_upload(tar_with(tmp_path, "f"), path)
    half_made, in_flight = fresh.with_name(f".{fresh.name}.1234"), fresh.with_name(f".{fresh.name}.5678")
    half_made.write_bytes(b"x")
    in_flight.write_bytes(b"x")
    now = time.time()
    os.utime(stale, (now - UPLOAD_KEEP - 60, now - UPLOAD_KEEP - 60))
    os.utime(half_made, (now - UPLOAD_TTL - 60, now - UPLOAD_TTL - 60))
    assert b.reap_uploads(now) == 2
    assert fresh.exists() and in_flight.exists() and not stale.exists() and not half_made.exists()
    assert builds(tmp_path / "none").reap_uploads(now) == 0  # no upload space yet


class FreeNames:
    """The one thing a build request asks of the catalog: here every name is free."""

    def check_template_free(self, caller: Caller, name: str) -> None:
        pass


def test_a_teams_builds_are_capped_and_stale_ones_forgotten(tmp_path: Path) -> None:
    builds = Builds(None, FreeNames(), None, None, tmp_path / "files")  # type: ignore[arg-type]
    alpha, beta = Caller("alpha"), Caller("beta")
    held = [builds.request(alpha, "app") for _ in range(MAX_TEAM_BUILDS)]
    with pytest.raises(QuotaExceeded, match="alpha has 256 builds"):
        builds.request(alpha, "app")
    assert builds.request(beta, "app").team == "beta"  # another team's place is its own
    held[0].created -= UPLOAD_TTL + 1  # asked for and never started: forgotten
    held[1].end("ready")
    held[2].end("error")
    held[2].ended -= BUILD_KEEP + 1  # ended a day ago: forgotten
    builds.request(alpha, "app")
    builds.request(alpha, "app")
    with pytest.raises(QuotaExceeded):
        builds.request(alpha, "app")
    for gone in (held[0], held[2]):
        with pytest.raises(NotFound):
            builds.get(alpha, "app", gone.build_id)
    assert builds.get(alpha, "app", held[1].build_id).status == "ready"  # a finished build stays to be read


def test_a_builds_log_is_capped_in_lines_and_characters() -> None:
    build = Build("app", "b1", "alpha")
    for _ in range(MAX_LOG_BYTES // 4000 + 10):
        build.log("x" * 5000)
    assert sum(len(e.message) for e in build.logs) <= MAX_LOG_BYTES + 100
    assert "past its cap" in build.logs[-1].message and build.logs[-1].level == "warn"
    build.log("later")
    assert "past its cap" in build.logs[-1].message
    many = Build("app", "b2", "alpha")
    for n in range(MAX_LOGS + 50):
        many.log(str(n))
    assert len(many.logs) == MAX_LOGS and "past its cap" in many.logs[-1].message
    assert many.logs[-2].message == str(MAX_LOGS - 2)


def test_a_teams_uploaded_files_are_capped_on_the_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from api import builds as module

    b = builds(tmp_path)
    monkeypatch.setattr(module, "MAX_TEAM_FILES", 3000)
    assert b.files_room("alpha") == 3000
    tar = b.upload_path("alpha", HASH)
    tar.parent.mkdir(parents=True)
    tar.write_bytes(b"t" * 2000)
    assert b.files_room("alpha") == 1000 and b.files_room("beta") == 3000  # another team's room is its own
    b.upload_path("alpha", "cd" * 32).write_bytes(b"t" * 1000)
    with pytest.raises(QuotaExceeded, match="alpha keeps 3000 bytes"):
        b.files_room("alpha")
