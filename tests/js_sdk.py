"""E2B's JavaScript SDK (`e2b` from npm, run by node) for the tests: a
script from tests/js/ runs beside the installed package and prints one JSON
line of what it saw."""

from __future__ import annotations

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


def run_js(script: str, env: dict[str, str]) -> dict[str, Any]:
    """Run tests/js/`script` with `env` added (E2B_API_URL and the like); what it printed last, parsed."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        if IN_CI:
            pytest.fail("node and npm are needed (deploy/setup.sh installs them)")
        pytest.skip("node/npm not installed (apt-get install nodejs npm)")
    if not (JS_SDK / "node_modules" / "e2b").exists():
        subprocess.run(["npm", "install", "--prefix", str(JS_SDK), "--no-audit", "--no-fund", "e2b@2"],
                       check=True, capture_output=True, timeout=600)
    target = JS_SDK / script  # beside node_modules, so `import 'e2b'` finds it
    shutil.copy(SCRIPTS / script, target)
    full = {**os.environ, **env}
    full.pop("E2B_DEBUG", None)
    r = subprocess.run(["node", str(target)], env=full, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
