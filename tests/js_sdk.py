"""E2B's JavaScript SDK (`e2b` from npm, run by node) for the tests: a
script from tests/js/ runs beside the installed package and prints one JSON
line of what it saw."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import IN_CI

JS_SDK = Path(os.environ.get("STRATA_JS_SDK_DIR", "/var/tmp/strata-js-sdk"))  # npm's e2b, installed once
SCRIPTS = Path(__file__).parent / "js"
LOCK = SCRIPTS / "package-lock.json"  # the pinned tree (npm ci): a new npm release changes nothing here


def install_sdk() -> None:
    """npm's e2b in JS_SDK, exactly as LOCK pins it; kept while the lock is the same. Under
    `deploy/setup.sh latest` (STRATA_JS_SDK_UNPINNED) the newest release is there already."""
    if os.environ.get("STRATA_JS_SDK_UNPINNED"):
        return
    JS_SDK.mkdir(parents=True, exist_ok=True)
    with open(JS_SDK.with_name(f".{JS_SDK.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install at a time (pytest-xdist's workers share JS_SDK)
        _install()


def _install() -> None:
    stamp = JS_SDK / ".strata-lock"  # written once npm ci succeeded
    if stamp.is_file() and stamp.read_bytes() == LOCK.read_bytes():
        return
    for name in ("package.json", "package-lock.json"):
        shutil.copy(SCRIPTS / name, JS_SDK / name)
    r = subprocess.run(["npm", "ci", "--prefix", str(JS_SDK), "--no-audit", "--no-fund"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"npm ci of tests/js/package-lock.json failed: {r.stderr[-2000:]}"
    stamp.write_bytes(LOCK.read_bytes())


def run_js(script: str, env: dict[str, str]) -> dict[str, Any]:
    """Run tests/js/`script` with `env` added (E2B_API_URL and the like); what it printed last, parsed."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        if IN_CI:
            pytest.fail("node and npm are needed (deploy/setup.sh installs them)")
        pytest.skip("node/npm not installed (apt-get install nodejs npm)")
    install_sdk()
    target = JS_SDK / script  # beside node_modules, so `import 'e2b'` finds it
    shutil.copy(SCRIPTS / script, target)
    full = {**os.environ, **env}
    full.pop("E2B_DEBUG", None)
    r = subprocess.run(["node", str(target)], env=full, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
