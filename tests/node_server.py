"""A real `strata serve` process on loopback, with its own store, state,
mount and guest image: what the API tests and bench/api_load.py run against."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "test-api-key-0001"
ADMIN_KEY = "test-admin-key-0001"


class NodeServer:
    def __init__(self, tmp: Path, guest: Path, *, host: str = "127.0.0.1", prefix: tuple[str, ...] = (),
                 **env: str) -> None:
        """`host`/`prefix` run the service inside a test's network namespace (tests/netns.py)."""
        self.tmp = tmp
        self.host = host
        self.prefix = prefix
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        (tmp / "run").mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "STRATA_STORE": str(tmp / "store"), "STRATA_STATE_DIR": str(tmp / "state"),
                    "STRATA_RUN_DIR": str(tmp / "run"), "STRATA_GUEST_DIR": str(guest),
                    "STRATA_API_KEYS": API_KEY, "STRATA_ADMIN_KEYS": ADMIN_KEY,
                    "STRATA_CONFIG": str(tmp / "none.toml"), "STRATA_CACHE_SIZE": "1G", **env}
        (tmp / "none.toml").write_text("")
        self.proc: subprocess.Popen | None = None
        self.log = tmp / "serve.log"
        self.client = httpx.Client(base_url=self.url, headers={"X-API-Key": API_KEY}, timeout=300)
        self.admin = httpx.Client(base_url=self.url, headers={"X-API-Key": ADMIN_KEY}, timeout=300)

    def strata(self, *args: str) -> subprocess.CompletedProcess:
        r = subprocess.run([*self.prefix, str(ROOT / ".venv/bin/strata"), *args], env=self.env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, (args, r.stderr)
        return r

    def start(self, *args: str) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*self.prefix, str(ROOT / ".venv/bin/strata"), "serve", "--host", self.host,
                                          "--port", str(self.port), *args],
                                         env=self.env, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"strata serve exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"strata serve did not answer: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the service, as a crash or a lost machine would: no goodbye, its record simply lapses
        (its VMs and mount outlive it, as they do a restart)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        """Stop the service, every VM it left and the mount."""
        self.stop()
        subprocess.run([*self.prefix, str(ROOT / ".venv/bin/strata"), "sandbox", "kill", "--all"], env=self.env,
                       capture_output=True, timeout=300)
        subprocess.run([*self.prefix, str(ROOT / ".venv/bin/strata"), "umount", str(self.tmp / "state" / "mnt")], env=self.env,
                       capture_output=True, timeout=60)
        subprocess.run(["fusermount3", "-u", "-z", str(self.tmp / "state" / "mnt")], capture_output=True)
        self.client.close()
        self.admin.close()


