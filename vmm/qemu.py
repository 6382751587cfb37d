"""The QEMU backend: `qemu-system-x86_64` driven over QMP.

KVM when `vmm.accel.detect` says it can run a stock guest, else TCG with one
warning line. Never `-cpu host` (fails on MSR 0x10a on the PVM hosts).
The command line (see vmm/guest/README.md for why each piece):

    qemu-system-x86_64 -M pc,accel=tcg,memory-backend=ram -m 256 -smp 1
      -object memory-backend-file,id=ram,size=256M,mem-path=BASE,share=off
      -nodefaults -no-user-config
      -display none -no-reboot -sandbox on,obsolete=deny,elevateprivileges=deny,resourcecontrol=deny
      -chardev file,id=console,path=console.log,append=on -serial chardev:console
      -kernel vmlinuz -initrd initramfs.cpio.gz -append 'console=ttyS0 quiet panic=-1 ...'   a boot only
      -device virtio-serial-pci -chardev socket,id=agent,path=agent.sock,server=on,wait=off
      -device virtserialport,chardev=agent,name=strata.agent
      [-chardev socket,id=volumes,path=volumes.sock,server=on,wait=off
       -device virtserialport,chardev=volumes,name=strata.volumes]   the volume port
      -qmp unix:qmp.sock,server=on,wait=off -pidfile WORKDIR/qemu.pid
      -drive file=DISK,format=raw,if=virtio,cache=none
      [-incoming defer -global migration.send-configuration=off, then QMP
       getfd + migrate-incoming fd:NAME]   a restore

A restored guest's RAM is mapped copy-on-write from BASE, the read-only
memory layer on the mount that its RAM upper layer sits on: VMs restored
from one snapshot share the pages none of them wrote, and a snapshot writes
the pages the guest wrote into the RAM upper layer (vmm/cowmemory.py). A
booted guest's RAM is its RAM file, mapped shared (`mem-path=RAMFILE,share=on`).
Either way a snapshot saves device state alone (QMP
`xen-save-devices-state`; vmm/guest/README.md has the details). A VM
without a RAM file saves a migration stream, handed to QEMU as an open file
(QMP `getfd`, `fd:` URI; QEMU 7.2 has no `file:` URI); restoring a stream
(snapshots stored before device state alone) keeps `-kernel` and `-initrd`,
whose ROM contents the stream holds, and its configuration section.

The disk is opened with cache=none (O_DIRECT), the path the FUSE mount is
fastest on. QEMU runs in the work directory and binds its sockets there by
relative name (a deep work directory outgrows a socket address).

QMP serves one client at a time and VMs outlive the process that started
them, so a `QemuVm` holds no QMP connection between calls: each call
connects, runs its commands and disconnects. A handle therefore stays valid
while other processes control the same VM in between (`vmm.sandbox` makes
them take turns with the sandbox's lock); a call made while another client
is connected waits for it (up to the QMP timeout).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from layerstore.errors import StrataError

from .accel import Accel, detect
from .agent import Agent
from .backend import VmmError, VmSpec
from .cowmemory import CowRam
from .durable import write_durably
from .network import GUEST_MAC, guest_cmdline
from .process import kill_group, owns, rotate_log, wait_gone
from .qmp import QMP

log = logging.getLogger("strata.vmm")
QEMU_BINARY = "qemu-system-x86_64"


def _owns(pid: int, workdir: Path) -> bool:
    """True if `pid` is still the QEMU of `workdir`: its argv names the pid
    file there (or, for a VM started before sockets were bound by relative
    name, the QMP socket)."""
    work = os.path.abspath(workdir)
    return owns(pid, os.path.join(work, "qemu.pid")) or owns(pid, os.path.join(work, "qmp.sock"))


def _absolute(spec: VmSpec) -> VmSpec:
    """`spec` with absolute paths: QEMU runs in the work directory (it binds
    its sockets by relative name, see layerstore/unixsock.py), so a relative path
    would name the wrong file."""
    def absolute(path: Path | None) -> Path | None:
        return None if path is None else Path(os.path.abspath(path))

    return dataclasses.replace(spec, kernel=absolute(spec.kernel), initrd=absolute(spec.initrd),
                               disk=absolute(spec.disk), workdir=absolute(spec.workdir),
                               incoming=absolute(spec.incoming), memory_file=absolute(spec.memory_file),
                               memory_base=absolute(spec.memory_base))


# QEMU's seccomp filter: obsolete, set*uid/gid and resource-control syscalls
# are denied. Spawning stays allowed: snapshots stream through `exec:cat`.
# QEMU still runs as the node's user (root): `-runas` would need the disk
# reopened by fd (the block layer reopens it by path when a migration ends)
# and the state stream passed as an fd, and restoring from an fd-passed
# stream failed in our tests (vmm/README.md, "VMM confinement").
SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=allow,resourcecontrol=deny"


def _cow_ram(spec: VmSpec) -> CowRam | None:
    if spec.memory_base is None or spec.memory_file is None:
        return None
    return CowRam(spec.memory_base, spec.memory_file, spec.memory_mib << 20)


class QemuVm:
    """A QEMU process we started, or re-attached to from its workdir (then
    `proc` is None: another process of ours started it and may have exited).
    Every call opens its own QMP connection (see the module docstring)."""

    def __init__(self, pid: int, workdir: Path, agent: Agent, *, ram_in_file: bool, devices_only: bool = False,
                 cow: CowRam | None = None, proc: subprocess.Popen | None = None, qmp_timeout: float = 30.0) -> None:
        self.proc = proc
        self.pid = pid
        self.workdir = workdir
        self.ram_in_file = ram_in_file
        # its RAM reaches its file (mapped shared, or written back from a
        # copy-on-write mapping): state is saved as device state alone
        self.devices_only = devices_only
        self.cow = cow
        self.agent = agent
        self.qmp_timeout = qmp_timeout

    @contextmanager
    def _qmp(self) -> Iterator[QMP]:
        """A QMP connection for one call, closed after it (QEMU then serves the next client)."""
        if not self.alive():  # a dead QEMU's socket file refuses connections until the timeout
            raise VmmError(f"the VM (pid {self.pid}) is no longer running")
        qmp = QMP(self.workdir / "qmp.sock", timeout=self.qmp_timeout)
        try:
            yield qmp
        finally:
            qmp.close()

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return _owns(self.pid, self.workdir)

    def status(self) -> str:
        with self._qmp() as qmp:
            return str(qmp.execute("query-status")["status"])

    def pause(self) -> None:
        with self._qmp() as qmp:
            qmp.execute("stop")

    def resume(self) -> None:
        with self._qmp() as qmp:
            if qmp.execute("query-migrate").get("status") in _MIGRATING:
                # a state save whose caller died midway: its snapshot was never published
                qmp.execute("migrate_cancel")
                _wait_migration_over(qmp, timeout=30)
            qmp.execute("cont")
        if self.cow is not None:
            self.cow.forget()  # a pre-copy whose capture never came

    def save_state(self, path: Path) -> None:
        """Device state to `path`. RAM that reaches its file: the device state
        alone (QMP `xen-save-devices-state`, which despite its name is any
        QEMU's), then, if RAM is mapped copy-on-write, the changed pages
        written back. Otherwise a migration stream, RAM and all."""
        with self._qmp() as qmp:
            if qmp.execute("query-status")["status"] not in ("paused", "postmigrate"):
                raise VmmError("save_state needs a paused VM")
            if self.devices_only:
                qmp.execute("xen-save-devices-state", {"filename": os.path.abspath(path), "live": False})
                if self.cow is not None:
                    self._write_back(precopy=False)
                return
            qmp.execute("migrate-set-parameters", {"max-bandwidth": 8 << 30})
            if self.ram_in_file:  # a RAM file mapped privately: only the capability must match the restore's
                qmp.execute("migrate-set-capabilities",
                            {"capabilities": [{"capability": "x-ignore-shared", "state": True}]})
            qmp.execute("migrate", {"uri": _state_fd(qmp, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)})
            _wait_migrated(qmp, timeout=300)

    def sync_memory(self) -> None:
        """A pre-copy of the guest's changed RAM pages into its RAM file
        (vmm/cowmemory.py), if it maps its RAM copy-on-write; shared RAM is
        in the file already."""
        if self.cow is not None:
            self._write_back(precopy=True)

    def _write_back(self, *, precopy: bool) -> None:
        assert self.cow is not None
        done = self.cow.write_back(self.pid, precopy=precopy)
        log.debug("VM %s: %d changed RAM pages, %d written back in %.1f ms", self.pid, done.changed, done.written,
                  done.seconds * 1000)

    def kill(self) -> None:
        if self.alive():
            try:
                with self._qmp() as qmp:
                    qmp.execute("quit", timeout=5)
            except (StrataError, OSError):  # QMPError, or VmmError if it died meanwhile
                pass
            if not wait_gone(self.pid, 5, proc=self.proc):
                kill_group(self.pid, proc=self.proc)
        self.agent.close()


STATE_FD = "strata-state"  # the name a state file's descriptor gets in QEMU (QMP getfd)


def _state_fd(qmp: QMP, path: Path, flags: int) -> str:
    """Hand QEMU the state file open (`getfd`); the migration URI naming it.

    Rather than `exec:cat > FILE`: QEMU forking a shell cost 25-500 ms with
    a big TCG process, and an open file costs nothing."""
    fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
    try:
        qmp.execute("getfd", {"fdname": STATE_FD}, fd=fd)
    finally:
        os.close(fd)
    return f"fd:{STATE_FD}"


_MIGRATING = ("setup", "active", "device", "pre-switchover", "cancelling")


def _wait_migration_over(qmp: QMP, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while qmp.execute("query-migrate").get("status") in _MIGRATING:
        if time.monotonic() > deadline:
            raise VmmError(f"cancelling a VM state save did not finish within {timeout:.0f} s")
        time.sleep(0.01)


def _wait_migrated(qmp: QMP, *, timeout: float) -> None:
    """Poll query-migrate until the outgoing migration (a state save) completes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = qmp.execute("query-migrate")
        state = info.get("status")
        if state == "completed":
            return
        if state in ("failed", "cancelled"):
            raise VmmError(f"saving VM state failed: {info.get('error-desc', state)}")
        time.sleep(0.002)
    raise VmmError(f"saving VM state did not finish within {timeout:.0f} s")


class QemuBackend:
    name = "qemu"
    volume_port = True
    cow_memory = True

    def __init__(self, *, binary: str | None = None, accel: Accel | None = None) -> None:
        self.binary = binary or shutil.which(QEMU_BINARY) or QEMU_BINARY
        self.accel = accel or detect()
        self._warned = False

    def argv(self, spec: VmSpec) -> list[str]:
        """The command line, to be run in `spec.workdir` (sockets are bound by
        relative name: the work directory may be deeper than a socket address)."""
        spec = _absolute(spec)
        w = spec.workdir
        machine = self.accel.qemu_machine
        memory: list[str] = []
        if spec.memory_file is not None:
            machine += ",memory-backend=ram"
            # shared: guest RAM writes land in the file; private: the file (or
            # the base) is mapped copy-on-write and never written, so it can be
            # a snapshot's memory on the FUSE mount, paged in lazily. (QEMU
            # 7.2's readonly=on would make guest RAM read-only too, hanging the guest.)
            path = spec.memory_base or spec.memory_file
            mode = "share=on" if spec.memory_shared and spec.memory_base is None else "share=off"
            memory = ["-object", f"memory-backend-file,id=ram,size={spec.memory_mib}M,mem-path={path},{mode}"]
        # Device state alone (xen-save-devices-state) has no configuration
        # section to expect, and no ROM or RAM for the boot files to match:
        # a restore from it leaves them out, and with them the kernel image
        # QEMU would otherwise hold in memory (14 MiB) for the VM's life.
        devices = spec.incoming is not None and spec.incoming_devices_only
        boot = [] if devices else ["-kernel", str(spec.kernel), "-initrd", str(spec.initrd), "-append", spec.cmdline]
        argv = [
            self.binary, "-M", machine, "-m", str(spec.memory_mib), "-smp", str(spec.cpus), *memory,
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-sandbox", SECCOMP,
            # append: the console log can be emptied under QEMU (rotate_logs)
            "-chardev", f"file,id=console,path={w / 'console.log'},append=on", "-serial", "chardev:console",
            *boot, "-device", "virtio-serial-pci",
            "-chardev", "socket,id=agent,path=agent.sock,server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=strata.agent",
            "-qmp", "unix:qmp.sock,server=on,wait=off", "-pidfile", str(w / "qemu.pid"),
            "-drive", f"file={spec.disk},format=raw,if=virtio,cache=none",
        ]
        if spec.volume_port:
            i = argv.index("-qmp")
            argv[i:i] = ["-chardev", "socket,id=volumes,path=volumes.sock,server=on,wait=off",
                         "-device", "virtserialport,chardev=volumes,name=strata.volumes"]
        if spec.netns is not None:
            if spec.incoming is None:
                i = argv.index("-append") + 1
                argv[i] = f"{argv[i]} {guest_cmdline()}"
            argv = ["ip", "netns", "exec", spec.netns, *argv,
                    "-netdev", "tap,id=net0,ifname=tap0,script=no,downscript=no",
                    "-device", f"virtio-net-pci,netdev=net0,mac={GUEST_MAC}"]
        if spec.incoming is not None:
            # with a RAM file the x-ignore-shared capability must be set before
            # the stream is read, so the incoming side waits for QMP
            incoming = "defer" if spec.memory_file is not None else f"exec:cat {shlex.quote(str(spec.incoming))}"
            argv += ["-incoming", incoming, *(["-global", "migration.send-configuration=off"] if devices else [])]
        return argv + list(spec.extra)

    def start(self, spec: VmSpec, *, ready_timeout: float = 120.0) -> QemuVm:
        spec = _absolute(spec)
        if shutil.which(self.binary) is None and not os.path.exists(self.binary):
            raise VmmError(f"VMM binary {self.binary} not found (apt-get install qemu-system-x86)")
        for path, what in ((spec.kernel, "kernel"), (spec.initrd, "initrd"), (spec.disk, "disk")):
            if not Path(path).exists():
                raise VmmError(f"{what} {path} does not exist")
        if spec.incoming is not None and not spec.incoming.exists():
            raise VmmError(f"VM state {spec.incoming} does not exist")
        if spec.memory_file is not None and not spec.memory_shared and not spec.memory_file.exists():
            raise VmmError(f"memory file {spec.memory_file} does not exist")
        if spec.memory_base is not None and not spec.memory_base.exists():
            raise VmmError(f"memory base {spec.memory_base} does not exist")
        if self.accel.name == "tcg" and not self._warned:  # once, and only when a VM is started
            log.warning("%s", self.accel.reason)
            self._warned = True
        spec.workdir.mkdir(parents=True, exist_ok=True)
        for name in ("agent.sock", "volumes.sock", "qmp.sock", "qemu.pid"):
            (spec.workdir / name).unlink(missing_ok=True)
        with open(spec.workdir / "qemu.log", "ab") as qlog:
            proc = subprocess.Popen(self.argv(spec), stdin=subprocess.DEVNULL, stdout=qlog, stderr=qlog,
                                    cwd=spec.workdir, start_new_session=True)
        qmp = agent = None
        try:
            qmp = QMP(spec.workdir / "qmp.sock", timeout=30)
            if spec.incoming is not None and spec.memory_file is not None:
                if not spec.incoming_devices_only:  # a migration stream's RAM section must match the source's
                    qmp.execute("migrate-set-capabilities",
                                {"capabilities": [{"capability": "x-ignore-shared", "state": True}]})
                qmp.execute("migrate-incoming", {"uri": _state_fd(qmp, spec.incoming, os.O_RDONLY)})
            if spec.incoming is not None:
                deadline = time.monotonic() + ready_timeout
                while qmp.execute("query-status")["status"] == "inmigrate":
                    if time.monotonic() > deadline:
                        raise VmmError("restoring VM state did not finish in time")
                    time.sleep(0.002)
                qmp.execute("cont")
            agent = Agent(spec.workdir / "agent.sock")
            try:
                agent.wait_ready(ready_timeout)
            except StrataError:
                try:
                    proc.wait(timeout=2)  # a guest that died takes QEMU down with it (-no-reboot)
                except subprocess.TimeoutExpired:
                    pass
                if proc.poll() is not None:
                    raise VmmError(f"the VM exited (status {proc.returncode}) before its agent answered") from None
                raise
            cow = _cow_ram(spec)
            in_file = spec.memory_file is not None
            devices = in_file and (spec.memory_shared or cow is not None)
            info = {"pid": proc.pid, "ram_in_file": in_file, "devices_only": devices,
                    **({"cow": {"base": str(cow.base), "file": str(cow.file), "size": cow.size}} if cow else {})}
            write_durably(spec.workdir / "vm.json", json.dumps(info).encode())
            qmp.close()  # the VM's handle connects per call
            return QemuVm(proc.pid, spec.workdir, agent, ram_in_file=in_file, devices_only=devices, cow=cow, proc=proc)
        except BaseException as exc:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            if qmp is not None:
                qmp.close()
            if agent is not None:
                agent.close()
            tail = (spec.workdir / "qemu.log").read_text(errors="replace").strip().splitlines()[-1:]
            detail = f" (qemu: {tail[0]})" if tail else ""
            console = spec.workdir / "console.log"
            last = console.read_text(errors="replace").strip().splitlines()[-2:] if console.exists() else []
            if last:  # a guest that died says why on its console (a panic, a missing root disk)
                detail += f" (guest console: {' | '.join(line.strip() for line in last)})"
            if isinstance(exc, StrataError):
                raise VmmError(f"{exc}{detail}; VM killed") from None
            raise

    def attach(self, workdir: Path, *, timeout: float = 5.0) -> QemuVm:
        """Take control of a VM started earlier (maybe by another process).

        Nothing is connected here (QMP connects per call, the agent on first
        use), so a VM another process controls at the moment can still be
        attached; its calls then wait their turn, each up to
        max(`timeout`, 30 s) for QMP.
        """
        try:
            info = json.loads((workdir / "vm.json").read_text())
        except (OSError, ValueError):
            raise VmmError(f"no VM recorded in {workdir}") from None
        pid = int(info["pid"])
        if not _owns(pid, workdir):
            raise VmmError(f"the VM (pid {pid}) is no longer running")
        cow = info.get("cow")
        ram = CowRam(Path(cow["base"]), Path(cow["file"]), int(cow["size"])) if cow else None
        return QemuVm(pid, workdir, Agent(workdir / "agent.sock"), ram_in_file=bool(info["ram_in_file"]),
                      devices_only=bool(info.get("devices_only")), cow=ram, qmp_timeout=max(timeout, 30.0))

    def _recorded_pid(self, workdir: Path) -> int | None:
        try:
            return int(json.loads((workdir / "vm.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None

    def is_running(self, workdir: Path) -> bool:
        pid = self._recorded_pid(workdir)
        return pid is not None and _owns(pid, workdir)

    def destroy(self, workdir: Path) -> None:
        pid = self._recorded_pid(workdir)
        if pid is not None and _owns(pid, workdir):
            kill_group(pid)

    def rotate_logs(self, workdir: Path, *, limit: int) -> None:
        for name in ("console.log", "qemu.log"):  # both opened O_APPEND
            rotate_log(workdir / name, limit=limit)
