"""api/debian.py: Debian roots from mmdebstrap, cached, retried, failing with apt's reason.

The failure case is the one CI met on a fresh machine (`mmdebstrap failed
(exit 25)`): a build run inside a test's network namespace, which has no
route to Debian's mirror. Here it runs in such a namespace on purpose: every
attempt fails within seconds, nothing is left behind, and the error says
what apt said. The builds that succeed are the ones test_envd.py and
test_code_interpreter.py boot.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest

from api.debian import apt_errors, build_root
from layerstore.errors import StrataError
from tests.conftest import IN_CI
from tests.netns import Lab

APT_OUTPUT = """I: running apt-get update...
Err:1 http://deb.debian.org/debian bookworm InRelease
  Temporary failure resolving 'deb.debian.org'
E: Failed to fetch http://deb.debian.org/debian/dists/bookworm/InRelease  Temporary failure resolving 'deb.debian.org'
E: apt-get update --error-on=any -oAPT::Status-Fd=<$fd> -oDpkg::Use-Pty=false failed
E: mmdebstrap failed to run
"""


def test_apt_errors_keeps_the_error_lines() -> None:
    text = apt_errors(APT_OUTPUT)
    assert text.startswith("E: Failed to fetch") and text.endswith("E: mmdebstrap failed to run")
    assert "Err:1" not in text and "I: running" not in text


def test_apt_errors_without_error_lines_gives_the_last_line_and_is_bounded() -> None:
    assert apt_errors("I: one\nsomething broke\n") == "something broke"
    assert apt_errors("") == "no message"
    long = apt_errors("\n".join(f"E: line {i} " + "x" * 100 for i in range(100)), limit=300)
    assert len(long) == 303 and long.startswith("...") and long.endswith("x" * 10)


def test_a_cached_root_is_taken_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "root.tar"
    cache.write_bytes(b"a tar")
    monkeypatch.setenv("PATH", str(tmp_path))  # no mmdebstrap to be found: it must not be needed
    assert build_root(cache, ("python3",)) == cache and cache.read_bytes() == b"a tar"


def test_without_mmdebstrap_the_error_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(StrataError, match=r"apt-get install mmdebstrap"):
        build_root(tmp_path / "root.tar", ("python3",))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif((os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("mmdebstrap") is None)
                    and not IN_CI, reason="needs root, iproute2 and mmdebstrap (a network namespace to build in)")
def test_a_build_without_a_route_to_the_mirror_retries_then_says_why(tmp_path: Path) -> None:
    cache = tmp_path / "root.tar"
    lab = Lab(f"d{os.getpid() % 10000}")
    attempts: list[str] = []

    def status(message: str):
        attempts.append(message)
        return contextlib.nullcontext()

    try:
        with lab.inside("hub"), pytest.raises(StrataError) as failed:
            build_root(cache, ("python3",), attempts=2, pause=0, timeout=120, status=status)
    finally:
        lab.destroy()
    message = str(failed.value)
    assert message.startswith("mmdebstrap failed 2 times; the last: exit ")
    assert "E: " in message and "Debian's mirror" in message, message
    assert [m.split("(mmdebstrap, ")[1][:20] for m in attempts] == ["attempt 1 of 2; cach", "attempt 2 of 2; cach"]
    left = [p.name for p in tmp_path.iterdir()]
    assert left in ([], [".root.tar.lock"]), f"a failed build leaves neither the cache nor a partial tar: {left}"
