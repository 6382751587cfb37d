"""Rows: generated requests across the whole documented API with the
attacker's key, at the node and through the gateway (schemathesis, run
last in the matrix: it may create and delete whatever beta may)."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import pytest

from tests.attacks.lab import BETA, Lab
from tests.node_server import ROOT

SECRET = "alpha-secret-file-7d41c"


@pytest.fixture(scope="module")
def alpha_secret(lab: Lab) -> str:
    """A file in alpha's sandbox whose contents no answer to beta may carry."""
    r = lab.alpha.post(f"/sandboxes/{lab.sandbox['sandboxID']}/exec",
                       json={"command": f"echo {SECRET} > /root/secret"})
    assert r.status_code == 200 and r.json()["exitCode"] == 0, r.text
    return SECRET


def bodies(har: Path) -> list[tuple[int, str]]:
    """(status, response text) of every exchange in a HAR report."""
    out = []
    for entry in json.loads(har.read_text())["log"]["entries"]:
        content = entry["response"].get("content", {})
        text = content.get("text") or ""
        if content.get("encoding") == "base64":
            text = base64.b64decode(text).decode("utf-8", "replace")
        out.append((entry["response"]["status"], text))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("where", ["node", "gateway"])
def test_generated_requests_with_the_attackers_key(lab: Lab, alpha_secret: str, tmp_path: Path, where: str) -> None:
    """attacker: team beta.  target: every documented operation of the node,
    directly and through the gateway.  attempt: schemathesis's generated
    requests (examples, then fuzzing) with beta's key.  must: no 5xx, and no
    answer names alpha's sandbox id or carries alpha's file."""
    base = lab.node.url if where == "node" else lab.gateway.url
    har = tmp_path / "run.har"
    result = subprocess.run(
        [str(ROOT / ".venv/bin/schemathesis"), "run", f"{lab.node.url}/openapi.json", "--url", base,
         "-H", f"X-API-Key: {BETA}", "--checks", "not_a_server_error", "--max-examples", "5",
         "--phases", "examples,fuzzing", "--generation-deterministic", "--request-timeout", "120",
         "--report", "har", "--report-har-path", str(har)],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    seen = bodies(har)
    assert len(seen) > 50, len(seen)
    assert not [s for s, _ in seen if s >= 500]
    sid = lab.sandbox["sandboxID"]
    leaks = [text[:300] for _, text in seen if alpha_secret in text or sid in text]
    assert leaks == []
