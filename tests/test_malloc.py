"""layerstore/malloc.py: freed chunk-sized buffers stay in the heap."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = textwrap.dedent("""
    import resource, sys
    sys.path.insert(0, sys.argv[1])
    from layerstore.malloc import keep_freed_memory
    data = bytes(range(256)) * 4096  # 1 MiB

    def faults_per_copy():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(100):
            copy = bytes(bytearray(data))
            del copy
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 100

    faults_per_copy()
    print(keep_freed_memory(), faults_per_copy())
""")


def test_after_keep_freed_memory_a_1_mib_buffer_is_reused_not_faulted_in_again() -> None:
    # two 1 MiB buffers per copy: 512 pages that fault in again each time under
    # glibc's defaults (measured: 480), a handful once they stay in the heap
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT)], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    assert applied == "True"
    assert float(faults) < 32, out.stdout


KEEP = textwrap.dedent("""
    import resource, sys, threading
    sys.path.insert(0, sys.argv[1])
    from layerstore.malloc import keep_freed_memory, warm_heap
    data = bytes(range(256)) * 4096  # 1 MiB
    if sys.argv[2] == "warm":
        assert keep_freed_memory()
        warm_heap(64 << 20)
    out = []

    def fetcher():  # a prefetch thread keeping 32 chunks, as the fetcher's memory does
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        kept = [bytes(bytearray(data)) for _ in range(32)]
        out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    thread = threading.Thread(target=fetcher)
    thread.start()
    thread.join()
    print(out[0])
""")


def test_a_warm_heap_holds_another_threads_chunks_without_faulting_them_in() -> None:
    """A fresh daemon's first cold restore faulted in every chunk it kept
    (~23,000 faults); with one arena warmed at start, its threads reuse it."""
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", KEEP, str(ROOT), mode], capture_output=True, text=True, check=True)
        return int(out.stdout)

    cold, warm = faults("cold"), faults("warm")
    assert cold > 32 * 200, cold  # 256 pages a MiB, faulted in
    assert warm < 32 * 20, (cold, warm)
