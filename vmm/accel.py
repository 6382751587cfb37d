"""Which accelerator can really run a stock guest here: KVM, or TCG emulation.

A /dev/kvm that exists is not enough. These development machines expose a
PVM-flavoured KVM (`/sys/module/kvm_pvm`) on which an unmodified guest kernel
hangs, so the check refuses KVM when that module is loaded, when /dev/kvm
cannot be opened read-write, or when STRATA_ACCEL forces a choice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Accel:
    name: str  # "kvm" or "tcg"
    reason: str  # one line: why this one

    @property
    def qemu_machine(self) -> str:
        return f"pc,accel={self.name}"


def detect(*, forced: str = "", dev: str = "/dev/kvm", sys_module: str = "/sys/module") -> Accel:
    """Pick KVM when it can run a stock guest, else TCG (with the reason);
    `forced` (config `accel`, STRATA_ACCEL) overrides the probe."""
    if forced in ("kvm", "tcg"):
        return Accel(forced, f"forced by config accel={forced}")
    if not os.path.exists(dev):
        return Accel("tcg", f"{dev} is missing: using TCG emulation (slow)")
    if (Path(sys_module) / "kvm_pvm").exists():
        return Accel("tcg", "KVM here is PVM (kvm_pvm loaded), which hangs stock guest kernels: using TCG emulation")
    try:
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
        os.close(fd)
    except OSError as exc:
        return Accel("tcg", f"{dev} cannot be opened ({exc.strerror}): using TCG emulation")
    return Accel("kvm", f"{dev} usable")
