"""The one interface every VMM backend implements (vmm/qemu.py, vmm/firecracker.py).

The rest of Strata asks a backend to start a VM from a `VmSpec` and then
drives the returned `Vm`: pause, resume, save its state, kill. Storage
(FUSE disks, layers, snapshots) stays outside: a backend only sees paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from layerstore.errors import StrataError

if TYPE_CHECKING:  # the CLI imports this module for BACKENDS: not the agent's client with it
    from .agent import Agent

# After the console: what keeps an idle guest asleep. Each wake-up of an
# emulated (TCG) CPU costs the host far more than a real one, so the
# periodic timers an idle kernel keeps are switched off: the TSC clock
# watchdog (tsc=reliable: TCG's TSC follows the host's monotonic clock), the
# soft-lockup watchdog (nowatchdog: a paused or starved guest is not locked
# up), proactive compaction, and the once-a-second vmstat refresh (every
# 10 s). An idle sandbox went from 0.38% of a host core to 0.08% (bench/README.md).
DEFAULT_CMDLINE = ("console=ttyS0 quiet panic=-1 tsc=reliable nowatchdog sysctl.vm.compaction_proactiveness=0 "
                   "sysctl.vm.stat_interval=10")


class VmmError(StrataError):
    """A VM could not be started, controlled or saved."""


@dataclass(frozen=True)
class VmSpec:
    """What to run. `workdir` holds the VM's sockets and logs (one per VM)."""

    kernel: Path
    initrd: Path
    disk: Path
    workdir: Path
    memory_mib: int = 256
    cpus: int = 1
    cmdline: str = DEFAULT_CMDLINE
    incoming: Path | None = None  # device state to restore instead of booting
    # `incoming` is device state alone (a `Vm.devices_only` save): no RAM, no
    # ROM contents, no boot files to match (vmm/qemu.py)
    incoming_devices_only: bool = False
    # Guest RAM as a file: the sandbox's RAM upper layer on the mount
    # (sandboxes/<sid>.mem/disk.img), so a snapshot seals RAM as a chunked
    # layer (only the chunks dirtied since the last one) and the state stream
    # holds device state only. shared=True maps the file so guest writes
    # reach it; False maps it copy-on-write.
    memory_file: Path | None = None
    memory_shared: bool = True
    # A backend that can (`VmmBackend.cow_memory`) maps this read-only file,
    # the layer `memory_file` sits on, copy-on-write instead, so VMs started
    # from one snapshot hold the pages none of them changed once; its
    # `save_state` and `sync_memory` write the changed pages into
    # `memory_file` (vmm/cowmemory.py). Every restored QEMU sandbox's RAM.
    memory_base: Path | None = None
    # The sandbox's network namespace (vmm/network.py): the VMM runs in it and
    # gives the guest a NIC on its tap0. None = no NIC (a snapshot restores
    # only with the NIC set it was taken with).
    netns: str | None = None
    # The volume port (vmm/guest/README.md, vmm/volumeport.py): a second
    # virtio-serial port the guest's volume mounts ask through. Like the NIC,
    # a snapshot restores only with the port set it was taken with.
    volume_port: bool = False
    extra: tuple[str, ...] = field(default_factory=tuple)


class Vm(Protocol):
    """A running (or paused) VM. Obligations:
    - `agent` talks to the guest agent (any number of processes may, one
      command at a time); `wait_ready` returned before `start` did;
    - `pause`/`resume` stop and continue the vCPUs;
    - `save_state(path)` requires a paused VM and writes its device state to
      `path`; its memory is then in `VmSpec.memory_file`, which the caller
      flushes and seals; `devices_only` says the state is device state
      alone, which a restore must be told (`VmSpec.incoming_devices_only`);
    - `sync_memory()` writes guest memory the VMM holds elsewhere into
      `VmSpec.memory_file` while the guest may run (a pre-copy: the
      `save_state` that follows completes it); a no-op where guest writes
      land in that file as they happen;
    - `alive` is False once the VM process is gone (crashed, killed);
    - `kill` stops the VM and frees its resources; calling it twice is fine.
    """

    pid: int
    agent: Agent
    devices_only: bool

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def save_state(self, path: Path) -> None: ...

    def sync_memory(self) -> None: ...

    def status(self) -> str: ...

    def alive(self) -> bool: ...

    def kill(self) -> None: ...


class VmmBackend(Protocol):
    name: str
    volume_port: bool  # whether its VMs can have the volume port (VmSpec.volume_port)
    cow_memory: bool  # whether it maps guest RAM copy-on-write from VmSpec.memory_base

    def start(self, spec: VmSpec, *, ready_timeout: float = 120.0) -> Vm:
        """Start (or restore) a VM and return once its agent answers; on any
        failure the VM is killed before the error propagates. The VM
        outlives the calling process; `start` leaves in `spec.workdir`
        whatever `attach` needs."""
        ...

    def attach(self, workdir: Path, *, timeout: float = 5.0) -> Vm:
        """Take control of the VM started in `workdir` (maybe by another,
        possibly finished, process); VmmError if it is gone or busy."""
        ...

    def is_running(self, workdir: Path) -> bool:
        """Whether the VM started in `workdir` still runs (no control connection needed)."""
        ...

    def destroy(self, workdir: Path) -> None:
        """Hard-stop whatever VM runs in `workdir` without needing its
        control socket (the way out of a VM nobody can attach to)."""
        ...

    def rotate_logs(self, workdir: Path, *, limit: int) -> None:
        """Keep each log in `workdir` that a guest can fill (its console)
        near `limit` bytes, with one previous file beside it: a guest
        printing without end must not fill the node's disk."""
        ...


BACKENDS = ("qemu", "firecracker")


def open_backend(name: str, *, accel: str = "", state_dir: Path | None = None) -> VmmBackend:
    """The backend called `name` (config `vmm`), imported only when chosen;
    `accel` forces the accelerator (config `accel`; empty: probe);
    Firecracker keeps the vmlinux files it extracts under `state_dir`."""
    from .accel import detect

    if name == "qemu":
        from .qemu import QemuBackend

        return QemuBackend(accel=detect(forced=accel))
    if name == "firecracker":
        from .firecracker import FirecrackerBackend

        return FirecrackerBackend(accel=detect(forced=accel),
                                  kernel_cache=state_dir / "vmlinux" if state_dir is not None else None)
    from layerstore.errors import InvalidInput

    raise InvalidInput(f"unknown VMM backend {name!r}: choose one of {', '.join(BACKENDS)}")
