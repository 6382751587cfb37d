"""fusefs/malloc.py: freed chunk-sized buffers stay in the heap."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = textwrap.dedent("""
    import resource, sys
    sys.path.insert(0, sys.argv[1])
    from fusefs.malloc import keep_freed_memory
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
