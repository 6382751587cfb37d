"""The Go agent's own unit tests (vmm/guest/agent/*_test.go), run with `go test`: the FUSE wire
the guest's kernel hands the volume filesystem, the reply framing the node reads, process
environments. The agent's behaviour in a real guest is tests/test_vmm_agent.py's."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import IN_CI, ROOT

AGENT = ROOT / "vmm" / "guest" / "agent"


def test_go_test_passes(tmp_path: Path) -> None:
    if shutil.which("go") is None:
        if IN_CI:
            pytest.fail("go is needed (deploy/setup.sh installs golang-go)")
        pytest.skip("go not installed (apt-get install golang-go)")
    cache = Path(os.environ.get("STRATA_GO_TEST_CACHE", "/var/tmp/strata-go-test-cache"))
    env = {**os.environ, "GOCACHE": str(cache), "GOFLAGS": "-buildvcs=false", "CGO_ENABLED": "0",
           "GOPATH": str(tmp_path / "gopath")}
    r = subprocess.run(["go", "test", "-count=1", "./..."], cwd=AGENT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "ok  \tstrata/agent" in r.stdout, r.stdout
