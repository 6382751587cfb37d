"""The Firecracker backend.

Real VMs (skipped unless this host has the `firecracker` binary and a usable
KVM; the skip reason names what is missing): boot from a FUSE-served disk and
run commands through the agent, pause/resume, save_state + restore with a
memory file while a counter runs, and the same through `Sandboxes`. These are
the only tests that say whether Firecracker really boots our guest.

Everywhere: boot args; the missing-binary and no-KVM refusals; and the backend
driving `fake firecracker` (`fake_firecracker_main` below), a stand-in process
that serves Firecracker's API on --api-sock and answers the agent protocol on
its stdin/stdout as the guest's ttyS0 would. The fake enforces the
preconditions we rely on (ELF kernel, drive path resolving from its cwd,
Paused before snapshot/create, a fresh process for snapshot/load, memory file
opened read-only) and records every request, so these tests check the wire
format and the process plumbing we own (FIFOs, locks, kill, attach, error
mapping). They do not show Firecracker accepts it: the skipped tests do.
"""

from __future__ import annotations

import base64
import gzip
import http.server
import json
import os
import shutil
import socketserver
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import guest_spec
from tests.test_vmm_kernel import bzimage, tiny_elf, with_size
from vmm.accel import Accel, detect
from vmm.backend import DEFAULT_CMDLINE, VmmError, VmSpec
from vmm.firecracker import FirecrackerBackend, firecracker_boot_args

ROOT = Path(__file__).resolve().parent.parent
FAKE_KVM = Accel("kvm", "fake firecracker in a test: no KVM used")


def _missing_for_real_vms() -> list[str]:
    missing = []
    if shutil.which("firecracker") is None:
        missing.append("firecracker binary not on PATH (https://github.com/firecracker-microvm/firecracker/releases)")
    accel = detect()
    if accel.name != "kvm":
        missing.append(f"no usable KVM (/dev/kvm missing or PVM, see vmm/accel.py): {accel.reason}")
    return missing


MISSING = _missing_for_real_vms()
needs_firecracker = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING))


# --- a Firecracker-shaped API server (used in-thread and as the fake binary) ---


class FakeFirecracker:
    """What the stand-in knows: the VM state machine of the calls we use
    (swagger InstanceInfo.state), the requests seen, and a fake "guest"
    whose id travels through snapshot files."""

    def __init__(self, *, record: Path | None = None, fail: str | None = None, log: Path | None = None) -> None:
        self.state = "Not started"
        self.requests: list[tuple[str, str, Any]] = []
        self.config: dict[str, Any] = {}
        self.guest_id = ""
        self.record = record
        self.fail = fail
        self.log = log
        self.changed = threading.Condition()

    def _note(self, entry: dict[str, Any]) -> None:
        if self.record is not None:
            with open(self.record, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def _fault(self, message: str) -> tuple[int, dict[str, Any]]:
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"[anonymous-instance:fc_api] ERROR {message}\n")
        return 400, {"fault_message": message}

    def _set(self, state: str) -> None:
        with self.changed:
            self.state = state
            self.changed.notify_all()

    def handle(self, method: str, path: str, body: Any, headers: dict[str, str]) -> tuple[int, dict[str, Any] | None]:
        self.requests.append((method, path, body))
        self._note({"method": method, "path": path, "body": body, "content_type": headers.get("content-type")})
        if self.fail == f"{method} {path}":
            return self._fault(f"fake failure of {method} {path}")
        if (method, path) == ("GET", "/"):
            return 200, {"app_name": "Firecracker", "id": "anonymous-instance", "state": self.state,
                         "vmm_version": "0.0.0-fake"}
        if method == "PUT" and (path in ("/machine-config", "/boot-source") or path.startswith("/drives/")):
            if self.state != "Not started":
                return self._fault("The requested operation is not supported after starting the microVM.")
            self.config[path] = body
            return 204, None
        if (method, path) == ("PUT", "/actions") and body == {"action_type": "InstanceStart"}:
            return self._instance_start()
        if (method, path) == ("PATCH", "/vm") and body.get("state") in ("Paused", "Resumed"):
            if self.state == "Not started":
                return self._fault("The requested operation is not supported before starting the microVM.")
            self._set("Paused" if body["state"] == "Paused" else "Running")
            return 204, None
        if (method, path) == ("PUT", "/snapshot/create"):
            if self.state != "Paused":
                return self._fault("Create snapshot error: the microVM is not paused")
            drives = {k: v["path_on_host"] for k, v in self.config.items() if k.startswith("/drives/")}
            Path(body["snapshot_path"]).write_text(json.dumps({"guest_id": self.guest_id, "drives": drives}))
            Path(body["mem_file_path"]).write_bytes(f"memory of {self.guest_id}".encode())
            return 204, None
        if (method, path) == ("PUT", "/snapshot/load"):
            return self._load(body)
        return self._fault(f"Invalid request method and/or path: {method} {path}")

    def _instance_start(self) -> tuple[int, dict[str, Any] | None]:
        if self.state != "Not started":
            return self._fault("The requested operation is not supported after starting the microVM.")
        boot = self.config.get("/boot-source") or {}
        try:
            with open(boot["kernel_image_path"], "rb") as f:
                if f.read(4) != b"\x7fELF":
                    return self._fault("Cannot load kernel: Kernel Loader: failed to load ELF kernel image")
            Path(boot["initrd_path"]).stat()
            for key, drive in self.config.items():
                if key.startswith("/drives/"):
                    open(drive["path_on_host"], "r+b").close()  # relative paths resolve from our cwd
        except (KeyError, OSError) as exc:
            return self._fault(f"Start microvm error: {exc}")
        self.guest_id = uuid.uuid4().hex[:12]
        self._set("Running")
        if os.environ.get("FAKE_FC_EXIT_ON_START"):  # like a guest that panics and reboots (reboot=k)
            threading.Timer(0.2, os._exit, (0,)).start()
        return 204, None

    def _load(self, body: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
        if self.state != "Not started" or self.config:
            return self._fault("Loading a microVM snapshot not allowed after configuring boot-specific resources.")
        try:
            state = json.loads(Path(body["snapshot_path"]).read_text())
            mem = body["mem_backend"]
            assert mem["backend_type"] == "File"
            with open(mem["backend_path"], "rb") as f:  # read-only, as Firecracker's File::open
                memory = f.read()
        except (KeyError, OSError, ValueError, AssertionError) as exc:
            return self._fault(f"Load snapshot error: {exc!r}")
        if memory != f"memory of {state['guest_id']}".encode():
            return self._fault("Load snapshot error: memory file does not match the state file")
        self._note({"event": "load", "drives": {k: os.path.realpath(p) for k, p in state["drives"].items()}})
        self.guest_id = state["guest_id"]
        self._set("Running" if body.get("resume_vm") else "Paused")
        return 204, None

    def guest(self, rfd: int, wfd: int) -> None:
        """The guest agent on the serial port: answers only while Running."""
        buf = b""
        while True:
            data = os.read(rfd, 4096)
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                with self.changed:
                    self.changed.wait_for(lambda: self.state == "Running")
                if os.environ.get("FAKE_FC_SILENT") or os.environ.get("FAKE_FC_EXIT_ON_START"):
                    continue
                try:
                    req = json.loads(line)
                except ValueError:
                    continue  # a partial line from an earlier host
                rid = req.get("id")
                if req.get("op") == "hello":
                    reply = json.dumps({"id": rid, "end": True, "boot": self.guest_id}) + "\n"
                elif req.get("op") == "start":
                    out = f"guest {self.guest_id} ran: {req['args'][-1]}\n"
                    reply = "".join(json.dumps(r) + "\r\n" for r in (
                        {"id": rid, "pid": 1},
                        {"id": rid, "fd": 1, "off": 0, "data": base64.b64encode(out.encode()).decode()},
                        {"id": rid, "end": True, "exit": {"code": 0, "status": "exit status 0"}}))
                else:
                    reply = json.dumps({"id": rid, "end": True, "code": "invalid", "error": "unknown op"}) + "\n"
                os.write(wfd, reply.encode())


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeFirecracker

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        status, answer = self.fake.handle(self.command, self.path, body,
                                          {k.lower(): v for k, v in self.headers.items()})
        payload = json.dumps(answer).encode() if answer is not None else b""
        self.send_response(status)
        if payload:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_PUT = do_PATCH = _serve

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass  # (and client_address is '' on AF_UNIX, which the default would index)


def serve(fake: FakeFirecracker, path: Path) -> socketserver.UnixStreamServer:
    handler = type("Handler", (_Handler,), {"fake": fake})
    return socketserver.UnixStreamServer(str(path), handler)


def fake_firecracker_main(argv: list[str]) -> None:
    """Entry point of the `fake firecracker` executable the tests write."""
    args = dict(zip(argv[::2], argv[1::2]))
    sock = Path(args["--api-sock"])
    record = sock.parent / "fake-requests.jsonl"
    with open(record, "a") as f:
        f.write(json.dumps({"argv": argv, "cwd": os.getcwd()}) + "\n")
    fake = FakeFirecracker(record=record, fail=os.environ.get("FAKE_FC_FAIL"), log=Path(args["--log-path"]))
    with open(args["--log-path"], "a") as f:
        f.write("[anonymous-instance:main] Running Firecracker v0.0.0-fake\n")
    threading.Thread(target=fake.guest, args=(0, 1), daemon=True).start()
    serve(fake, sock).serve_forever()


# --- fixtures ---------------------------------------------------------------


@pytest.fixture
def fake_binary(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "firecracker"
    path.parent.mkdir()
    path.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                    "from tests.test_vmm_firecracker import fake_firecracker_main\n"
                    "fake_firecracker_main(sys.argv[1:])\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    kernel, initrd, disk = tmp_path / "vmlinux", tmp_path / "initrd", tmp_path / "disk.img"
    kernel.write_bytes(tiny_elf())
    initrd.write_bytes(b"070701 fake cpio")
    disk.write_bytes(bytes(4096))
    return {"kernel": kernel, "initrd": initrd, "disk": disk}


def requests(work: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (work / "fake-requests.jsonl").read_text().splitlines()]


def calls(work: Path) -> list[tuple[str, str, Any]]:
    """The state-changing requests (GET / polls left out), in order."""
    return [(r["method"], r["path"], r["body"]) for r in requests(work) if "method" in r and r["method"] != "GET"]


def processes_under(path: Path) -> list[int]:
    """Live processes whose command line mentions `path` (pgrep -f, without needing procps)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if str(path).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


# --- boot args, refusals ----------------------------------------------------------


def test_boot_args_give_ttys0_to_the_agent() -> None:
    assert firecracker_boot_args(DEFAULT_CMDLINE, pci=True) == (
        "quiet panic=-1 tsc=reliable nowatchdog sysctl.vm.compaction_proactiveness=0 sysctl.vm.stat_interval=10 "
        "strata.agent=/dev/ttyS0 8250.nr_uarts=1 reboot=k i8042.noaux i8042.nomux i8042.dumbkbd")
    assert firecracker_boot_args("console=ttyS0,115200 strata.agent=/dev/ttyS1 reboot=t", pci=False) == (
        "reboot=t strata.agent=/dev/ttyS0 8250.nr_uarts=1 i8042.noaux i8042.nomux i8042.dumbkbd pci=off")


def test_missing_binary_is_named_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        files: dict[str, Path]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    for backend in (FirecrackerBackend(accel=FAKE_KVM), FirecrackerBackend(binary="/nonexistent/firecracker")):
        with pytest.raises(VmmError, match=r"firecracker.*github\.com/firecracker-microvm/firecracker/releases"):
            backend.start(VmSpec(**files, workdir=tmp_path / "vm"))
    assert not (tmp_path / "vm").exists()  # nothing prepared, nothing started
    assert processes_under(tmp_path) == []


def test_no_usable_kvm_is_refused_before_starting(tmp_path: Path, fake_binary: Path, files: dict[str, Path]) -> None:
    backend = FirecrackerBackend(binary=str(fake_binary), accel=Accel("tcg", "KVM here is PVM (kvm_pvm loaded)"))
    with pytest.raises(VmmError, match="needs a usable KVM.*PVM"):
        backend.start(VmSpec(**files, workdir=tmp_path / "vm"))
    assert not (tmp_path / "vm").exists()


# --- the backend against fake firecracker --------------------------------------------


def test_boot_pause_snapshot_restore_wire_format(tmp_path: Path, fake_binary: Path, files: dict[str, Path]) -> None:
    backend = FirecrackerBackend(binary=str(fake_binary), accel=FAKE_KVM, kernel_cache=tmp_path / "kcache")
    work = tmp_path / "vm"
    vm = backend.start(VmSpec(**files, workdir=work, memory_mib=128, cpus=2, memory_file=work / "ram"),
                       ready_timeout=30)
    state = tmp_path / "state"
    try:
        first = vm.agent.run("echo hello")  # over the serial FIFOs, CRLF and all
        assert first.exit_code == 0 and first.output.endswith("ran: echo hello\n"), first
        assert vm.status() == "running"
        vm.pause()
        assert vm.status() == "paused"
        vm.save_state(state)
        vm.resume()
        assert vm.status() == "running"
    finally:
        vm.kill()
    assert not vm.alive() and vm.status() == "exited"
    vm.kill()  # twice is fine
    assert not (work / "firecracker.sock").exists() and not (work / "serial.in").exists()

    launch = requests(work)[0]
    assert launch["argv"] == ["--api-sock", "firecracker.sock", "--log-path", str(work / "firecracker.log"),
                              "--show-level", "--enable-pci"]
    assert launch["cwd"] == str(work)
    assert {r["content_type"] for r in requests(work) if r.get("body") is not None} == {"application/json"}
    assert calls(work) == [
        ("PUT", "/machine-config", {"vcpu_count": 2, "mem_size_mib": 128, "track_dirty_pages": False}),
        ("PUT", "/boot-source", {"kernel_image_path": str(files["kernel"]), "initrd_path": str(files["initrd"]),
                                 "boot_args": firecracker_boot_args(DEFAULT_CMDLINE, pci=True)}),
        ("PUT", "/drives/rootfs", {"drive_id": "rootfs", "path_on_host": "disk", "is_root_device": False,
                                   "is_read_only": False, "cache_type": "Unsafe"}),
        ("PUT", "/actions", {"action_type": "InstanceStart"}),
        ("PATCH", "/vm", {"state": "Paused"}),
        ("PUT", "/snapshot/create", {"snapshot_type": "Full", "snapshot_path": str(state),
                                     "mem_file_path": str(work / "ram")}),
        ("PATCH", "/vm", {"state": "Resumed"}),
    ]

    # restore: a fresh process, its own disk, the memory file read-only; no kernel needed
    memory = tmp_path / "snapshot-memory"
    shutil.copy(work / "ram", memory)
    memory.chmod(0o444)
    disk2 = tmp_path / "disk2.img"
    shutil.copy(files["disk"], disk2)
    work2 = tmp_path / "vm2"
    restored = backend.start(VmSpec(kernel=tmp_path / "no-kernel", initrd=tmp_path / "no-initrd", disk=disk2,
                                    workdir=work2, incoming=state, memory_file=memory, memory_shared=False),
                             ready_timeout=30)
    try:
        guest_id = first.output.split()[1]
        assert restored.agent.run("true").output.startswith(f"guest {guest_id} ")  # the snapshotted guest
        restored.pause()
        restored.save_state(tmp_path / "state2")  # RAM of a restored VM goes to its workdir, never the source
    finally:
        restored.kill()
    assert calls(work2) == [
        ("PUT", "/snapshot/load", {"snapshot_path": str(state),
                                   "mem_backend": {"backend_type": "File", "backend_path": str(memory)},
                                   "track_dirty_pages": False, "resume_vm": True}),
        ("PATCH", "/vm", {"state": "Paused"}),
        ("PUT", "/snapshot/create", {"snapshot_type": "Full", "snapshot_path": str(tmp_path / "state2"),
                                     "mem_file_path": str(work2 / "ram")}),
    ]
    # the drive path recorded in the snapshot ("disk", relative) resolved to the new VM's disk
    load = next(r for r in requests(work2) if r.get("event") == "load")
    assert load["drives"] == {"/drives/rootfs": str(disk2.resolve())}


def test_bzimage_kernel_is_converted_for_boot(tmp_path: Path, fake_binary: Path, files: dict[str, Path]) -> None:
    elf = tiny_elf()
    files["kernel"].write_bytes(bzimage(with_size(gzip.compress(elf), elf)))
    backend = FirecrackerBackend(binary=str(fake_binary), accel=FAKE_KVM, pci=False, kernel_cache=tmp_path / "kcache")
    vm = backend.start(VmSpec(**files, workdir=tmp_path / "vm"), ready_timeout=30)
    vm.kill()
    boot = next(body for _m, path, body in calls(tmp_path / "vm") if path == "/boot-source")
    assert Path(boot["kernel_image_path"]).parent == tmp_path / "kcache"
    assert Path(boot["kernel_image_path"]).read_bytes() == elf
    assert boot["boot_args"].endswith(" pci=off")
    assert "--enable-pci" not in requests(tmp_path / "vm")[0]["argv"]


def test_attach_busy_stale_output_and_destroy(tmp_path: Path, fake_binary: Path, files: dict[str, Path]) -> None:
    backend = FirecrackerBackend(binary=str(fake_binary), accel=FAKE_KVM)
    work = tmp_path / "vm"
    vm = backend.start(VmSpec(**files, workdir=work, memory_file=work / "ram"), ready_timeout=30)
    try:
        with pytest.raises(VmmError, match="in use by another process"):
            backend.attach(work)  # the first handle holds the agent
        vm.agent.close()
        # replies left in the port by an earlier host, with the ids a new Agent uses first
        fd = os.open(work / "serial.out", os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"PONG p1\nEXIT r2 99\n")
        os.close(fd)
        other = backend.attach(work)
        assert other.pid == vm.pid and other.alive() and backend.is_running(work)
        assert other.agent.run("echo hi").exit_code == 0  # the stale lines were discarded
        other.pause()
        assert vm.status() == "paused"  # the same VM
        other.resume()
        other.agent.close()
        destroyer = FirecrackerBackend(binary="/nonexistent")  # destroy needs no binary, API or agent
        destroyer.destroy(work)
        assert not other.alive() and not backend.is_running(work)
        vm.proc.wait(timeout=10)  # (the parent's view may lag the kill by an instant)
        with pytest.raises(VmmError, match="no longer running"):
            backend.attach(work)
    finally:
        vm.kill()
    assert processes_under(tmp_path) == []


@pytest.mark.parametrize("env,error", [
    ({"FAKE_FC_FAIL": "PUT /drives/rootfs"},
     r"refused PUT /drives/rootfs \(400\): fake failure of PUT /drives/rootfs"
     r" \(firecracker: .*ERROR fake failure of PUT /drives/rootfs\); VM killed"),
    ({"FAKE_FC_SILENT": "1"}, r"did not answer within 2 s.*; VM killed"),
    ({"FAKE_FC_EXIT_ON_START": "1"}, r"exited \(status 0\) before its agent answered.*; VM killed"),
])
def test_start_failures_kill_and_explain(tmp_path: Path, fake_binary: Path, files: dict[str, Path],
                                         monkeypatch: pytest.MonkeyPatch, env: dict[str, str], error: str) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    backend = FirecrackerBackend(binary=str(fake_binary), accel=FAKE_KVM)
    with pytest.raises(VmmError, match=error):
        backend.start(VmSpec(**files, workdir=tmp_path / "vm"), ready_timeout=2)
    assert processes_under(tmp_path) == []  # no firecracker left behind
    assert not (tmp_path / "vm" / "firecracker.sock").exists()
    assert not (tmp_path / "vm" / "serial.out").exists()


def test_missing_restore_inputs_are_refused(tmp_path: Path, fake_binary: Path, files: dict[str, Path]) -> None:
    backend = FirecrackerBackend(binary=str(fake_binary), accel=FAKE_KVM)
    state = tmp_path / "state"
    state.write_text("{}")
    with pytest.raises(VmmError, match=r"memory file .*state\.mem does not exist"):
        backend.start(VmSpec(**files, workdir=tmp_path / "vm", incoming=state))
    with pytest.raises(VmmError, match="VM state .* does not exist"):
        backend.start(VmSpec(**files, workdir=tmp_path / "vm", incoming=tmp_path / "nope", memory_file=state))
    assert processes_under(tmp_path) == []


# --- real Firecracker (skipped without the binary and a usable KVM) -----------------


@needs_firecracker
def test_real_boot_from_fuse_disk_run_pause_resume(served_disk: tuple[Any, Path], guest: Path, tmp_path: Path) -> None:
    mount, disk = served_disk
    backend = FirecrackerBackend(kernel_cache=tmp_path / "kcache")
    vm = backend.start(guest_spec(guest, disk, tmp_path / "vm"), ready_timeout=120)
    try:
        r = vm.agent.run("echo hello from $(uname -r); cat /proc/mounts | grep ' / '; cat /proc/cmdline")
        assert r.exit_code == 0 and "hello from" in r.output and "/dev/vda" in r.output, r.output
        assert "strata.agent=/dev/ttyS0" in r.output and "console=ttyS0" not in r.output
        assert vm.agent.run("exit 3").exit_code == 3
        vm.pause()
        assert vm.status() == "paused"
        vm.resume()
        assert vm.status() == "running"
        assert vm.agent.run("echo again").output.strip() == "again"
        assert vm.agent.run("echo persisted > /root/note && sync").exit_code == 0
    finally:
        vm.kill()
    assert not vm.alive()
    assert mount.stats()["backend_fetches"] > 0  # the boot read chunks lazily through the mount


@needs_firecracker
def test_real_save_and_restore_with_memory_file(served_disk: tuple[Any, Path], guest: Path, tmp_path: Path) -> None:
    _mount, disk = served_disk
    backend = FirecrackerBackend(kernel_cache=tmp_path / "kcache")
    work = tmp_path / "vm"
    vm = backend.start(guest_spec(guest, disk, work, memory_file=work / "ram"), ready_timeout=120)
    state = tmp_path / "vm.state"
    try:
        vm.agent.run("(i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done) >/dev/null 2>&1 &")
        time.sleep(1)
        vm.pause()
        vm.save_state(state)
    finally:
        vm.kill()
    memory = tmp_path / "memory"
    shutil.move(work / "ram", memory)
    memory.chmod(0o444)
    assert state.stat().st_size > 0 and memory.stat().st_size == 256 << 20
    restored = backend.start(guest_spec(guest, disk, tmp_path / "vm2", incoming=state, memory_file=memory,
                                       memory_shared=False), ready_timeout=120)
    try:
        first = int(restored.agent.run("cat /tmp/counter").output)
        time.sleep(0.5)
        second = int(restored.agent.run("cat /tmp/counter").output)
        assert first > 0 and second > first  # the in-memory process kept running after restore
    finally:
        restored.kill()


@needs_firecracker
def test_real_sandbox_snapshot_kill_restore(tmp_path: Path, guest: Path) -> None:
    """Sandboxes on Firecracker: boot, write a file and start a counter,
    snapshot, kill, restore: the file and the process survive."""
    from layerstore.store import open_store
    from tests.test_fusefs_mount import Mount
    from vmm.sandbox import Sandboxes

    m = Mount(tmp_path, cache_size="512M")
    m.strata("image", "import", str(guest / "rootfs.ext4"), "guest:v1")
    m.start()
    store = open_store(str(tmp_path / "store"))
    boxes = Sandboxes(store, m.client, FirecrackerBackend(kernel_cache=tmp_path / "kcache"), guest_dir=guest,
                      work_root=tmp_path / "work")
    try:
        sb = boxes.boot("guest:v1", sid="src")
        assert sb.vm.agent.run("echo kept-on-disk > /root/file && sync").exit_code == 0
        sb.vm.agent.run("(i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done) >/dev/null 2>&1 &")
        time.sleep(1)
        snapshot_id = boxes.snapshot("src", resume=False)
        boxes.kill("src")
        restored = boxes.restore(snapshot_id, sid="copy")
        assert restored.vm.agent.run("cat /root/file").output.strip() == "kept-on-disk"
        first = int(restored.vm.agent.run("cat /tmp/counter").output)
        time.sleep(0.5)
        assert int(restored.vm.agent.run("cat /tmp/counter").output) > first > 0
        boxes.kill("copy")
    finally:
        for row in boxes.list():
            boxes.kill(str(row["sid"]))
        m.stop()
        store.close()
