"""The Firecracker backend: `firecracker --api-sock SOCK` driven over its REST API.

For production hosts with a real KVM (Firecracker has no emulation fallback;
`vmm.accel.detect` must say "kvm"). Each VM gets its work directory:

    firecracker.sock  the API socket (HTTP/1.1 over AF_UNIX)
    firecracker.log   Firecracker's log (--log-path) and stderr
    serial.in         FIFO: Firecracker's stdin, i.e. host -> guest ttyS0
    serial.out        FIFO: Firecracker's stdout, i.e. guest ttyS0 -> host
    agent.lock        flock()ed by the one process that talks to the agent
    disk              symlink to the VM's disk (see "Restore" below)
    vm.json           pid and paths, so another process can `attach`

API use (field names checked against firecracker-microvm/firecracker
src/firecracker/swagger/firecracker.yaml at 81b38b9d (1.17.0-dev; the fields
used here are unchanged since v1.16.1) and docs/snapshotting/snapshot-support.md):

    boot     PUT /machine-config {vcpu_count, mem_size_mib, track_dirty_pages}
             PUT /boot-source    {kernel_image_path, initrd_path, boot_args}
             PUT /network-interfaces/eth0 {iface_id, host_dev_name: tap0, guest_mac}
                                 (with a sandbox network; the process runs in its namespace)
             PUT /drives/rootfs  {drive_id, path_on_host, is_root_device,
                                  is_read_only, cache_type}
             PUT /actions        {action_type: InstanceStart}
    pause    PATCH /vm {state: Paused}      resume  PATCH /vm {state: Resumed}
    save     PUT /snapshot/create {snapshot_type: Full, snapshot_path, mem_file_path}
    restore  PUT /snapshot/load {snapshot_path, mem_backend: {backend_type: File,
             backend_path}, track_dirty_pages, resume_vm: true}   (fresh process)
    status   GET / -> InstanceInfo.state: "Not started" | "Running" | "Paused"
    errors   non-2xx with body {"fault_message": "..."} (swagger `Error`)

Guest memory: a booted VM's RAM is Firecracker's own anonymous memory (it
has no file-backed RAM at boot). `save_state` writes a Full snapshot: device
state to the given path and all of guest memory to the VM's memory file,
which for a `Sandboxes` sandbox (spec.memory_file, memory_shared) is its RAM
upper layer on the mount, `sandboxes/<sid>.mem/disk.img`. Every chunk of
that file is then written, so the seal that follows hashes all of them and
the content-addressed store keeps only those whose bytes changed (QEMU,
mapping the file shared, dirties only the chunks the guest wrote).
Firecracker's Diff snapshots (dirty pages only, merged onto a base with
snapshot-editor) are not used: the upper layer already merges.
Restore loads the state and maps the memory file MAP_PRIVATE
(snapshot-support.md, "Snapshot files management"; persist.rs opens it
read-only): for a sandbox that is its new RAM upper layer over the
snapshot's memory layer, paged in lazily from the mount; guest writes stay
in the process's private pages until the next `save_state` writes them back
into that same file. A VM restored from a memory file it must not write
(memory_shared=False, not used by `Sandboxes`) saves its memory to
workdir/ram instead.

Restore: snapshot-support.md says the disk files "need to be accessible at the
same relative paths to the new Firecracker process". Firecracker runs with
cwd = workdir and its drive is the relative path `disk`, a symlink to
`spec.disk`; a restored VM (new workdir, new copy-on-write disk) gets its own
`disk` symlink, so the path recorded in the snapshot resolves to its own disk.

Guest agent: Firecracker has one UART (ttyS0) wired to its stdin/stdout and no
virtio-serial. Boot args therefore drop `console=ttyS0` (kernel messages go to
tty0 and are discarded; otherwise printk lines would interleave with agent
lines) and add `strata.agent=/dev/ttyS0`; the host end is two FIFOs in the
workdir (vmm/serial.py).

Kernel: released Firecracker (<= 1.16) boots only an uncompressed ELF vmlinux
on x86_64; vmm/kernel.py derives one from a bzImage (our guest's vmlinuz).
Devices: with `pci=True` (the default, needs Firecracker >= 1.13,
`--enable-pci`) the disk is virtio-pci, which our initramfs already loads;
with `pci=False` it is virtio-mmio described in ACPI, which needs
virtio_mmio.ko in the initramfs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

from layerstore.errors import StrataError

from .accel import Accel, detect
from .agent import Agent, AgentError
from .backend import VmmError, VmSpec
from .durable import write_durably
from .kernel import default_kernel_cache, ensure_vmlinux
from .network import GUEST_MAC, guest_cmdline
from .process import kill_group, owns, wait_gone
from .serial import AGENT_LOCK, SERIAL_IN, SERIAL_OUT, SerialAgent, make_serial
from .unixhttp import FirecrackerApi

FIRECRACKER_BINARY = "firecracker"
RELEASES_URL = "https://github.com/firecracker-microvm/firecracker/releases"
API_SOCK = "firecracker.sock"
LOG_FILE = "firecracker.log"
DISK_LINK = "disk"
VM_JSON = "vm.json"
RAM_FILE = "ram"  # save_state's memory output for a VM whose memory file is read-only (memory_shared=False)
DRIVE_ID = "rootfs"
STATES = MappingProxyType({"Running": "running", "Paused": "paused", "Not started": "not-started"})


def firecracker_boot_args(cmdline: str, *, pci: bool) -> str:
    """`cmdline` adapted to Firecracker's one UART being the agent's port.

    `console=ttyS*` is dropped so only agent lines cross ttyS0 (the agent
    tolerates CRLF but not printk text in the middle of a line); added:
    `strata.agent=/dev/ttyS0`, `8250.nr_uarts=1` (the one UART Firecracker
    emulates), `reboot=k` (a guest reboot or panic with panic=-1 ends the
    Firecracker process, like QEMU's -no-reboot), the i8042 options of
    Firecracker's default command line (skip probing for a mouse and a mux),
    and `pci=off` without the PCI transport (skips useless probing).
    """
    words = [w for w in cmdline.split() if not w.startswith(("console=ttyS", "strata.agent="))]
    keys = {w.split("=", 1)[0] for w in words}
    extra = ["strata.agent=/dev/ttyS0", "8250.nr_uarts=1", "reboot=k", "i8042.noaux", "i8042.nomux",
             "i8042.dumbkbd"] + ([] if pci else ["pci=off"])
    return " ".join(words + [w for w in extra if w.split("=", 1)[0] not in keys])


def _owned(pid: int, api_sock: str | os.PathLike[str]) -> bool:
    """True if `pid` is still the Firecracker whose API socket is `api_sock`:
    its argv names the log file beside it (absolute; the socket is relative)."""
    return owns(pid, str(Path(api_sock).parent / LOG_FILE))


# --- VMs and the backend ---------------------------------------------------------


def _cleanup(workdir: Path) -> None:
    for name in (API_SOCK, SERIAL_IN, SERIAL_OUT, DISK_LINK, AGENT_LOCK):
        try:
            (workdir / name).unlink()
        except FileNotFoundError:
            pass


def _log_tail(workdir: Path, lines: int = 2) -> str:
    try:
        text = (workdir / LOG_FILE).read_text(errors="replace")
    except OSError:
        return ""
    tail = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return f" (firecracker: {' | '.join(tail)[-600:]})" if tail else ""


class FirecrackerVm:
    """A Firecracker VM we started, or attached to from its workdir (then
    `proc` is None: another process started it and may have exited)."""

    def __init__(self, pid: int, workdir: Path, api: FirecrackerApi, agent: SerialAgent, *,
                 memory_out: Path | None, proc: subprocess.Popen | None = None,
                 snapshot_timeout: float = 300.0, kill_grace: float = 0.5) -> None:
        self.pid = pid
        self.workdir = workdir
        self.api = api
        self.agent: Agent = agent
        self.memory_out = memory_out
        self.proc = proc
        self.snapshot_timeout = snapshot_timeout
        self.kill_grace = kill_grace

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return _owned(self.pid, self.api.socket_path)

    def status(self) -> str:
        """"running", "paused" or "not-started" (Firecracker's GET /), "exited" once gone."""
        if not self.alive():
            return "exited"
        state = str(self.api.get("/").get("state"))
        return STATES.get(state, state.lower())

    def pause(self) -> None:
        self.api.patch("/vm", {"state": "Paused"})

    def resume(self) -> None:
        self.api.patch("/vm", {"state": "Resumed"})

    def save_state(self, path: Path) -> None:
        """Device state to `path`, guest memory to the VM's memory file: its
        `spec.memory_file` if that is its own (memory_shared), workdir/ram for
        a VM restored from a read-only memory file, `<path>.mem` without one.
        Paths are made absolute: Firecracker's cwd is the workdir."""
        if self.status() != "paused":
            raise VmmError("save_state needs a paused VM")
        path = Path(path)
        memory = self.memory_out or path.with_name(path.name + ".mem")
        self.api.put("/snapshot/create", {"snapshot_type": "Full", "snapshot_path": os.path.abspath(path),
                                          "mem_file_path": os.path.abspath(memory)},
                     timeout=self.snapshot_timeout)

    devices_only = False  # save_state writes guest memory too

    def sync_memory(self) -> None:
        """Nothing: guest memory reaches its file only through `save_state`."""

    def kill(self) -> None:
        """SIGTERM, a short grace, then SIGKILL to the process group.

        No API call: SendCtrlAltDel needs the guest's i8042 handling to do
        anything, and Firecracker holds no guest data worth a clean exit (the
        block device writes straight through to the disk file). Twice is fine.
        """
        if self.alive():
            for sig, wait in ((signal.SIGTERM, self.kill_grace), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.pid, sig)
                except ProcessLookupError:
                    break
                if wait_gone(self.pid, wait, proc=self.proc):
                    break
        elif self.proc is not None:
            self.proc.poll()  # reap
        self.agent.close()
        _cleanup(self.workdir)


class FirecrackerBackend:
    """Starts Firecracker VMs; see the module docstring for the files and calls.

    `pci` selects the virtio transport (True: `--enable-pci`, Firecracker >=
    1.13, works with our initramfs as is). `kernel_cache` holds vmlinux files
    extracted from bzImages. `accel` overrides KVM detection (tests).
    """

    name = "firecracker"
    volume_port = False  # no virtio-serial: volume mounts would need the port over vsock
    cow_memory = False  # save_state writes all of guest memory to the memory file

    def __init__(self, *, binary: str | None = None, accel: Accel | None = None, pci: bool = True,
                 kernel_cache: Path | None = None, track_dirty_pages: bool = False,
                 api_timeout: float = 10.0, snapshot_timeout: float = 300.0, kill_grace: float = 0.5) -> None:
        self.binary = binary or FIRECRACKER_BINARY
        self.accel = accel
        self.pci = pci
        self.kernel_cache = kernel_cache or default_kernel_cache()
        self.track_dirty_pages = track_dirty_pages
        self.api_timeout = api_timeout
        self.snapshot_timeout = snapshot_timeout
        self.kill_grace = kill_grace

    def _binary(self) -> str:
        found = shutil.which(self.binary)
        if found is None:
            raise VmmError(f"VMM binary {self.binary} not found: install `firecracker` from {RELEASES_URL} "
                           "(the release tarball's firecracker-vX.Y.Z-x86_64) onto PATH")
        return found

    def argv(self, spec: VmSpec) -> list[str]:
        """The command line; `spec.extra` is appended (e.g. `--level Debug`)."""
        work = Path(os.path.abspath(spec.workdir))
        # run in the work directory: the socket is bound by relative name (a
        # deep work directory outgrows a socket address, layerstore/unixsock.py)
        argv = [self.binary, "--api-sock", API_SOCK, "--log-path", str(work / LOG_FILE),
                "--show-level"]
        if self.pci:
            argv.append("--enable-pci")
        if spec.netns is not None:  # the VMM opens tap0 in the sandbox's namespace
            argv = ["ip", "netns", "exec", spec.netns, *argv]
        return argv + list(spec.extra)

    @staticmethod
    def _memory_out(spec: VmSpec) -> Path | None:
        if spec.memory_file is None:
            return None
        return Path(os.path.abspath(spec.memory_file if spec.memory_shared else spec.workdir / RAM_FILE))

    def _requests(self, spec: VmSpec, kernel: Path | None) -> list[tuple[str, dict[str, Any]]]:
        """The PUTs that configure and start (or restore) the VM, in order."""
        if spec.incoming is not None:
            memory = spec.memory_file or spec.incoming.with_name(spec.incoming.name + ".mem")
            return [("/snapshot/load", {
                "snapshot_path": os.path.abspath(spec.incoming),
                "mem_backend": {"backend_type": "File", "backend_path": os.path.abspath(memory)},
                "track_dirty_pages": self.track_dirty_pages,  # not saved in snapshots
                "resume_vm": True,
            })]
        assert kernel is not None
        cmdline = spec.cmdline if spec.netns is None else f"{spec.cmdline} {guest_cmdline()}"
        nic = [] if spec.netns is None else [("/network-interfaces/eth0", {
            "iface_id": "eth0", "host_dev_name": "tap0", "guest_mac": GUEST_MAC})]
        return [
            ("/machine-config", {"vcpu_count": spec.cpus, "mem_size_mib": spec.memory_mib,
                                 "track_dirty_pages": self.track_dirty_pages}),
            ("/boot-source", {"kernel_image_path": os.path.abspath(kernel),
                              "initrd_path": os.path.abspath(spec.initrd),
                              "boot_args": firecracker_boot_args(cmdline, pci=self.pci)}),
            *nic,
            # is_root_device false: the initramfs mounts /dev/vda itself and
            # switch_roots (true would only add an unused root=/dev/vda rw).
            # Unsafe (Firecracker's default) = no virtio flush: every write
            # already reaches the FUSE mount (no host writeback cache), which
            # is all a seal needs.
            (f"/drives/{DRIVE_ID}", {"drive_id": DRIVE_ID, "path_on_host": DISK_LINK, "is_root_device": False,
                                     "is_read_only": False, "cache_type": "Unsafe"}),
            ("/actions", {"action_type": "InstanceStart"}),
        ]

    def _check(self, spec: VmSpec) -> None:
        accel = self.accel or detect()
        if accel.name != "kvm":
            raise VmmError(f"Firecracker needs a usable KVM, and here: {accel.reason}")
        if spec.incoming is not None:
            memory = spec.memory_file or spec.incoming.with_name(spec.incoming.name + ".mem")
            for path, what in ((spec.incoming, "VM state"), (memory, "memory file")):
                if not Path(path).exists():
                    raise VmmError(f"{what} {path} does not exist")
        else:
            for path, what in ((spec.kernel, "kernel"), (spec.initrd, "initrd")):
                if not Path(path).exists():
                    raise VmmError(f"{what} {path} does not exist")
        if not Path(spec.disk).exists():
            raise VmmError(f"disk {spec.disk} does not exist")

    def _prepare(self, spec: VmSpec) -> tuple[int, int]:
        """Fresh FIFOs, disk symlink and log in the workdir; returns the fds
        Firecracker gets as stdin and stdout (vmm/serial.py)."""
        work = spec.workdir
        work.mkdir(parents=True, exist_ok=True)
        _cleanup(work)
        os.symlink(os.path.abspath(spec.disk), work / DISK_LINK)
        (work / LOG_FILE).touch()  # releases before open_file_nonblock's O_CREAT needed it to exist
        return make_serial(work)

    def _wait_api(self, proc: subprocess.Popen, api: FirecrackerApi) -> None:
        deadline = time.monotonic() + self.api_timeout
        while True:
            if proc.poll() is not None:
                raise VmmError(f"firecracker exited (status {proc.returncode}) before its API socket answered")
            if api.socket_path.exists():
                try:
                    api.get("/", timeout=2)
                    return
                except VmmError:
                    pass
            if time.monotonic() > deadline:
                raise VmmError(f"firecracker API socket {api.socket_path} did not answer within "
                               f"{self.api_timeout:.0f} s")
            time.sleep(0.01)

    def start(self, spec: VmSpec, *, ready_timeout: float = 120.0) -> FirecrackerVm:
        """Boot (or restore, with `spec.incoming`) and return once the agent
        answers; on any failure the process group is killed before raising."""
        self._binary()
        self._check(spec)
        kernel = None if spec.incoming is not None else ensure_vmlinux(spec.kernel, self.kernel_cache)
        work = spec.workdir
        stdin, stdout = self._prepare(spec)
        try:
            with open(work / LOG_FILE, "ab") as logf:
                proc = subprocess.Popen(self.argv(spec), stdin=stdin, stdout=stdout, stderr=logf, cwd=work,
                                        start_new_session=True)
        except OSError as exc:
            _cleanup(work)
            raise VmmError(f"cannot run {self.binary}: {exc}") from None
        finally:
            os.close(stdin)
            os.close(stdout)
        api = FirecrackerApi(Path(os.path.abspath(work)) / API_SOCK, timeout=30.0)
        memory_out = self._memory_out(spec)
        write_durably(work / VM_JSON, json.dumps({"pid": proc.pid, "api_sock": str(api.socket_path),
                                                  "memory_out": memory_out and str(memory_out),
                                                  "pci": self.pci}).encode())
        agent = None
        try:
            self._wait_api(proc, api)
            for path, body in self._requests(spec, kernel):
                api.put(path, body, timeout=self.snapshot_timeout)
            agent = SerialAgent(work)
            try:
                agent.wait_ready(ready_timeout)
            except StrataError:
                try:
                    proc.wait(timeout=2)  # a guest that panics reboots, which ends Firecracker (reboot=k)
                except subprocess.TimeoutExpired:
                    pass
                if proc.poll() is not None:
                    raise VmmError(f"the VM exited (status {proc.returncode}) before its agent answered") from None
                raise
            return FirecrackerVm(proc.pid, work, api, agent, memory_out=memory_out, proc=proc,
                                 snapshot_timeout=self.snapshot_timeout, kill_grace=self.kill_grace)
        except BaseException as exc:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=10)
            if agent is not None:
                agent.close()
            _cleanup(work)
            if isinstance(exc, StrataError):
                raise VmmError(f"{exc}{_log_tail(work)}; VM killed") from None
            raise

    @staticmethod
    def _recorded(workdir: Path) -> tuple[int, str, dict[str, Any]] | None:
        """(pid, API socket path, the whole note) from workdir/vm.json, if any."""
        try:
            info = json.loads((workdir / VM_JSON).read_text())
            return int(info["pid"]), str(info["api_sock"]), info
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def rotate_logs(self, workdir: Path, *, limit: int) -> None:
        """The guest's serial port carries only agent lines here (no console),
        so no log of this VM grows at a guest's will: nothing to rotate."""

    def is_running(self, workdir: Path) -> bool:
        """Whether the VM recorded in `workdir` still runs (no API or agent needed)."""
        recorded = self._recorded(workdir)
        return recorded is not None and _owned(recorded[0], recorded[1])

    def attach(self, workdir: Path, *, timeout: float = 5.0) -> FirecrackerVm:
        """Take control of a VM started earlier, maybe by another process.

        The API is connected per request, so it never stands in another
        process's way. The agent's serial port serves one process (its
        agent.lock): a VM whose agent another live process holds is reported
        as busy rather than shared. (Lifecycle operations of `Sandboxes`
        take turns through the sandbox's lock, vmm/registry.py.)
        """
        recorded = self._recorded(workdir)
        if recorded is None:
            raise VmmError(f"no VM recorded in {workdir}")
        pid, sock, info = recorded
        if not _owned(pid, sock):
            raise VmmError(f"the VM (pid {pid}) is no longer running")
        api = FirecrackerApi(Path(sock), timeout=max(timeout, 30.0))
        api.get("/", timeout=timeout)
        agent = SerialAgent(workdir)
        try:
            agent.connect()
        except AgentError as exc:
            raise VmmError(f"cannot control the VM (pid {pid}): {exc}; is another process (strata serve?) "
                           "controlling it?") from None
        memory_out = info.get("memory_out")
        return FirecrackerVm(pid, workdir, api, agent, memory_out=Path(memory_out) if memory_out else None,
                             snapshot_timeout=self.snapshot_timeout, kill_grace=self.kill_grace)

    def destroy(self, workdir: Path) -> None:
        """SIGKILL the VM recorded in `workdir` (no API or agent needed)."""
        recorded = self._recorded(workdir)
        if recorded is not None and _owned(recorded[0], recorded[1]):
            kill_group(recorded[0])
        _cleanup(workdir)
