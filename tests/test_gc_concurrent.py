"""GC against writers that run at the same time, on a real SeaweedFS: import
processes and threads publishing images that share most of their chunks,
a process deleting refs (so GC has shared chunks to delete), and GC
processes with no grace period at all, every process SIGKILLed at random
points and started again. Safety then rests on the conditional-write lock,
the writers' leases and the recheck before deleting (layerstore/lease.py,
gc.py). Afterwards every ref still in the store reads back byte for byte
and no manifest names a missing chunk. Leases and the lock get short ttls
here, so killed holders expire within the run."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from layerstore.exporter import export_image
from layerstore.importer import import_image
from layerstore.lease import GcLock, Lease
from layerstore.store import open_store
from layerstore.verify import verify_store
from tests.conftest import ROOT, seaweed_env
from tests.images import write_image
from tests.seaweedfs_server import SeaweedFS

RUN_SECONDS = 25.0
TTL = 4.0  # leases and the GC lock: a killed holder's expires within the run
IMAGES = 6

# A worker: imports (or GCs, or deletes refs) in a loop until killed; one line per thing done.
WORKER = r"""
import os, random, sys, time
from layerstore import gc
from layerstore.errors import StrataError
from layerstore.importer import import_image
from layerstore.lease import GcLock, Lease
from layerstore.store import open_store
GcLock.__init__.__kwdefaults__["ttl"] = float(os.environ["TTL"])
Lease.__init__.__kwdefaults__["ttl"] = float(os.environ["TTL"])
role, seed, images = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rng = random.Random(seed)
store = open_store(os.environ["STRATA_STORE"], s3_endpoint=os.environ["STRATA_S3_ENDPOINT"],
                   state_dir=os.path.abspath(f"state-{role}-{seed}"))
while True:
    try:
        if role == "import":
            path = rng.choice(images)
            name = f"{os.path.basename(path).split('.')[0]}:w{seed}-{rng.randrange(1000)}"
            import_image(store, path, name)
            print("published", name, flush=True)
            time.sleep(rng.uniform(0, 2))  # GC deletes only while no import holds a lease: leave it windows
        elif role == "gc":
            report = gc.collect(store, grace=0)
            print("gc deleted", report.deleted, flush=True)
        else:
            refs = [str(r) for r, _m, _u in store.list_refs()]
            if len(refs) > 3:
                victim = rng.choice(refs)
                store.delete_ref(victim)
                print("deleted", victim, flush=True)
            time.sleep(0.2)
    except StrataError as exc:  # a lease that lapsed, a lock held elsewhere: try again
        print("refused", type(exc).__name__, exc, flush=True)
        time.sleep(0.1)
"""


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.s3
def test_gc_never_loses_what_concurrent_writers_publish(seaweed: SeaweedFS, tmp_path: Path,
                                                         rng: random.Random,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = f"gc-race-{rng.randrange(1 << 30)}"
    env = {**os.environ, **seaweed_env(seaweed), "STRATA_STORE": f"s3://strata-tests/{prefix}", "TTL": str(TTL),
           "PYTHONPATH": str(ROOT)}
    images = []
    for i in range(IMAGES):  # the same base with a different tail: most chunks are shared between images
        path = tmp_path / f"img{i}.img"
        write_image(path, "rrrr" + "rzp"[i % 3] + "r" * (i % 2), seed=7)
        with open(path, "r+b") as f:
            f.seek(0, os.SEEK_END)
            f.write(random.Random(i).randbytes(256 << 10))
        images.append(path)
    expected = {p.stem: sha(p) for p in images}

    def spawn(role: str, seed: int) -> subprocess.Popen:
        log = open(tmp_path / f"{role}-{seed}.log", "ab")
        return subprocess.Popen([sys.executable, "-c", WORKER, role, str(seed), *map(str, images)], env=env,
                                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)

    roles = ["import", "import", "gc", "gc", "delete"]
    procs = {i: spawn(role, i) for i, role in enumerate(roles)}
    kills = 0

    # threads in this process import too (the API service's way)
    monkeypatch.setitem(Lease.__init__.__kwdefaults__, "ttl", TTL)
    monkeypatch.setitem(GcLock.__init__.__kwdefaults__, "ttl", TTL)
    for key, value in seaweed_env(seaweed).items():
        monkeypatch.setenv(key, value)
    store = open_store(env["STRATA_STORE"], s3_endpoint=seaweed.endpoint, state_dir=tmp_path / "state-threads")
    stop = threading.Event()
    thread_errors: list[BaseException] = []

    def importer(seed: int) -> None:
        local = random.Random(seed)
        while not stop.is_set():
            path = local.choice(images)
            try:
                import_image(store, path, f"{path.stem}:t{seed}-{local.randrange(1000)}")
            except Exception as exc:  # noqa: BLE001 - a lapsed lease is fine; anything else fails the test
                if "lease" not in str(exc):
                    thread_errors.append(exc)
            stop.wait(local.uniform(0, 2))

    threads = [threading.Thread(target=importer, args=(100 + i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + RUN_SECONDS
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.5, 2.5))
            victim = rng.choice(list(procs))
            procs[victim].send_signal(signal.SIGKILL)  # at whatever point it is
            procs[victim].wait()
            kills += 1
            procs[victim] = spawn(roles[victim], victim + 10 * kills)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        for p in procs.values():
            p.kill()
            p.wait()
    assert not thread_errors, thread_errors

    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    published = logs.count("published ")
    collected = sum(int(line.split()[-1]) for line in logs.splitlines() if line.startswith("gc deleted "))
    print(f"{kills} kills, {published} imports published by processes, {collected} objects collected")
    assert kills >= 5 and published >= 3 and logs.count("deleted img") >= 1
    assert collected > 0, "GC never deleted anything while the writers ran: the run proved nothing"
    assert "Traceback" not in logs, logs[logs.index("Traceback"):][:3000]  # a worker died of a bug, not a kill

    # let every killed holder's lease and lock lapse, collect once more with nothing running
    time.sleep(TTL + 1)
    from layerstore import gc

    gc.collect(store, grace=0)
    report = verify_store(store)
    assert not report.errors, report.errors[:5]
    refs = [str(r) for r, _m, _u in store.list_refs()]
    assert refs, "every ref was deleted: the run proved nothing"
    for ref in refs:
        out = tmp_path / "check.img"
        export_image(store, ref, out)  # every chunk fetched and its hash checked
        assert sha(out) == expected[ref.split(":")[0]], ref
    store.close()
