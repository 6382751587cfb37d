"""VM lifecycle through Strata's layers: boot, pause/resume, snapshot
(capture / seal / publish split), incremental snapshot, restore on an empty
and on a warm cache, fork of N.

Storage-side time is reported apart from the VMM's own time:
- VMM: "capture" (QEMU writing device state, the guest's dirty RAM written
  back into its upper layer, both layers sealed), "paused" (how long the
  guest was stopped: it resumes before the seals publish), pause, resume, and
  restore on a warm cache (every chunk local: what is left is QEMU starting,
  loading device state and the guest answering);
- storage: "seal" (waiting for both seals to publish their chunks),
  "publish" (state imported as a layer, snapshot manifest written); capture
  + the guest's resume + seal + publish is pause to published
  (`snap2_total_ms`: the median of 7 incremental snapshots, each after a
  small write; `snap2_total_max_ms` the slowest). Before the pause, while
  the guest runs, the snapshot pre-copies (RAM written back, both layers
  sealed and published: `snap2_precopy_ms`); the whole call, pre-copy
  included, is `snap2_call_ms`; and restore on an
  empty cache minus restore on a warm one (chunks fetched, verified, cached):
  `restore_storage_no_set_ms` for the snapshot's first restore anywhere,
  `restore_storage_ms` for a later one on another node (an empty cache
  again), which prefetches the working set the first one recorded; and
  `restore_storage_running_ms`, the same on a mount that keeps running
  after `strata cache drop` (chunk cache, its memory and the kernel's page
  cache of the snapshot's files emptied; no process start, no re-hash).
Cold restores alternate without and with the set (5 each, medians); warm
ones and restore p50/p99 are over 20 restores on a warm cache.
Runs real QEMU (TCG here, KVM where usable) on the guest from
vmm/guest/build.sh, through a real FUSE mount.

    .venv/bin/python bench/vm_snapshot.py [--forks 16] [--memory 256]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from layerstore.store import open_store  # noqa: E402
from tests.test_fusefs_mount import Mount  # noqa: E402  (the same CLI-driven mount the tests use)
from fusefs.catalogue import RECORD_WINDOW  # noqa: E402
from vmm.accel import detect  # noqa: E402
from vmm.qemu import QemuBackend  # noqa: E402
from vmm.sandbox import Sandboxes  # noqa: E402


STEPS = ("capture", "seal", "publish")
SNAP2_ROUNDS = 7


def stored_bytes(store) -> int:  # noqa: ANN001
    """Bytes of chunk objects and packs (a seal's changed pages)."""
    return sum(o.size for prefix in ("chunks/", "packs/") for o in store.backend.list(prefix))


def empty_cache(m: Mount, work: Path) -> None:
    """Restart the mount on an empty chunk cache, as another node would be."""
    m.stop()
    shutil.rmtree(work / "cache")
    m.start()


def cold_restore(m: Mount, boxes: Sandboxes, snapshot: str, work: Path, sid: str) -> float:
    empty_cache(m, work)
    r = boxes.restore(snapshot, sid=sid)
    boxes.kill(sid)
    return r.timings["restore"] * 1e3


def restores(m: Mount, boxes: Sandboxes, store, snapshot: str, work: Path, *, runs: int = 5) -> dict[str, float]:  # noqa: ANN001
    """Cold restores without and with the working set the first one records
    (alternated, `runs` each, medians), then 21 on a warm cache."""
    out: dict[str, float] = {}
    empty_cache(m, work)
    boxes.restore(snapshot, sid="first")
    time.sleep(RECORD_WINDOW + 1)  # its first use records the snapshot's working set
    boxes.kill("first")
    layers = sorted(set(store.get_snapshot(snapshot).layers.values()))
    recorded = {layer: store.get_prefetch(layer) for layer in layers}
    out["recorded_set_chunks"] = sum(len(v or []) for v in recorded.values())
    without, with_set, running = [], [], []
    for i in range(runs):
        for layer in layers:  # as if this were the snapshot's first restore anywhere
            store.backend.delete(f"prefetch/{layer}")
        without.append(cold_restore(m, boxes, snapshot, work, f"cold-a{i}"))
        for layer, indices in recorded.items():
            if indices:
                store.put_prefetch(layer, indices)
        with_set.append(cold_restore(m, boxes, snapshot, work, f"cold-b{i}"))
        m.client.cache_drop()
        r = boxes.restore(snapshot, sid=f"cold-c{i}")
        running.append(r.timings["restore"] * 1e3)
        boxes.kill(f"cold-c{i}")
    times = []
    for i in range(21):
        r = boxes.restore(snapshot, sid=f"warm{i}")
        times.append(r.timings["restore"] * 1e3)
        boxes.kill(f"warm{i}")
    warm = statistics.median(times)
    out["restore_cold_no_set_ms"] = statistics.median(without)
    out["restore_cold_ms"] = statistics.median(with_set)
    out["restore_warm_ms (VMM)"] = warm
    out["restore_storage_no_set_ms"] = out["restore_cold_no_set_ms"] - warm
    out["restore_storage_ms"] = out["restore_cold_ms"] - warm
    out["restore_storage_running_ms"] = statistics.median(running) - warm
    ordered = sorted(times[1:])
    out["restore_p50_ms"] = statistics.median(ordered)
    out["restore_p99_ms"] = ordered[-1]  # of 20: the slowest
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/var/tmp/strata-bench-vm")
    parser.add_argument("--guest", default="/var/tmp/strata-guest")
    parser.add_argument("--memory", type=int, default=256, help="guest MiB")
    parser.add_argument("--forks", type=int, default=16)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    guest = Path(args.guest)
    subprocess.run(["bash", str(ROOT / "vmm/guest/build.sh"), str(guest)], check=True, capture_output=True)
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    m = Mount(work, cache_size="1G")
    out: dict[str, float] = {}
    m.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
    m.start()
    store = open_store(str(work / "store"))
    boxes = Sandboxes(store, m.client, QemuBackend(accel=detect()), guest_dir=guest, work_root=work / "vms",
                      memory_mib=args.memory)
    try:
        sb = boxes.boot("guest:v1", sid="src")
        out["boot_s"] = sb.timings["boot"]
        pauses, resumes = [], []
        for _ in range(20):
            pauses.append(boxes.pause("src").timings["pause"] * 1e3)
            resumes.append(boxes.resume("src").timings["resume"] * 1e3)
        out["pause_p50_ms"] = statistics.median(pauses)
        out["resume_p50_ms"] = statistics.median(resumes)
        sb.vm.agent.run("dd if=/dev/urandom of=/root/data bs=1M count=8 2>/dev/null; sync")
        base = stored_bytes(store)
        boxes.snapshot("src")
        timings = boxes.registry.load("src").timings
        out.update({f"snap1_{k}_ms": timings[k] * 1e3 for k in STEPS})
        out["snap1_paused_ms"] = timings["paused"] * 1e3
        out["snap1_added_mib"] = (stored_bytes(store) - base) / 2**20
        rounds: list[dict[str, float]] = []
        for i in range(SNAP2_ROUNDS):  # one incremental snapshot is too noisy a sample here: medians of 7
            sb.vm.agent.run(f"echo small change {i} > /root/small; sync")
            base = stored_bytes(store)
            called = time.monotonic()
            snap2 = boxes.snapshot("src")
            call_ms = (time.monotonic() - called) * 1e3
            timings = boxes.registry.load("src").timings
            rounds.append({**{k: timings[k] * 1e3 for k in (*STEPS, "paused", "precopy")}, "call": call_ms,
                           # pause to published: the guest is paused (capture, resume), then the seals publish
                           "total": (timings["paused"] + timings["seal"] + timings["publish"]) * 1e3,
                           "added": (stored_bytes(store) - base) / 2**20})
        for key in (*STEPS, "paused", "precopy", "call"):  # the guest resumes before the seals are published
            out[f"snap2_{key}_ms"] = statistics.median(r[key] for r in rounds)
        out["snap2_added_mib"] = statistics.median(r["added"] for r in rounds)
        out["snap2_total_ms"] = statistics.median(r["total"] for r in rounds)
        out["snap2_total_max_ms"] = max(r["total"] for r in rounds)
        base = stored_bytes(store)
        started = time.monotonic()
        forks = boxes.fork("src", args.forks)
        out["fork_total_s"] = time.monotonic() - started
        out["fork_count"] = len(forks)
        out["fork_added_mib"] = (stored_bytes(store) - base) / 2**20
        for sid in [r["sid"] for r in boxes.list()]:  # the restores restart the mount: nothing may run on it
            boxes.kill(sid)
        out.update(restores(m, boxes, store, snap2, work))
    finally:
        for sid in [r["sid"] for r in boxes.list()]:
            boxes.kill(sid)
        m.stop()
        store.close()
    for key, value in out.items():
        print(f"{key:<24} {value:10.1f}")
    print("anchors (AgentENV on KVM): resume p50 44.8 ms, pause < 100 ms, incremental snapshot < 100 ms")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
