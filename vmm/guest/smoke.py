#!/usr/bin/env python3
"""Boot the Strata guest under QEMU (TCG) and talk to its agent (stdlib only).

    python3 vmm/guest/smoke.py OUTDIR                 # boot, run, write+sync, quit
    python3 vmm/guest/smoke.py OUTDIR --snapshot      # + stop/cont, migrate to a
                                                      #   file, restore in a 2nd QEMU
    options: --machine pc|q35  --mem MiB  --cpu max  --no-disk  --cache none
             --memfile (with --snapshot: guest RAM in a file, see snapshot())
             --append 'extra kernel args'

OUTDIR is what build.sh produced. Prints timings; exits non-zero on failure.
Every QEMU started here is killed (by pid) before exit.
"""
import argparse
import base64
import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time


def qemu_argv(a, work, tag, incoming=None, share="on"):
    """The QEMU command line. Source and restore must use identical devices."""
    g = a.outdir
    machine = f"{a.machine},accel=tcg"
    argv = []
    if a.memfile:
        # Guest RAM is a plain file: with the x-ignore-shared migration
        # capability the snapshot stream then holds device state only and the
        # file itself is the memory image. share=off on restore = MAP_PRIVATE,
        # i.e. copy-on-write, so the snapshot file is never modified.
        machine += ",memory-backend=ram"
        argv += ["-object", f"memory-backend-file,id=ram,size={a.mem}M,"
                 f"mem-path={work}/ram.img,share={share}"]
    argv = ["qemu-system-x86_64", "-M", machine, "-m", str(a.mem)] + argv + [
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-serial", f"file:{work}/serial-{tag}.log",
            "-kernel", f"{g}/vmlinuz", "-initrd", f"{g}/initramfs.cpio.gz",
            # quiet: every console byte is slow under TCG; panic=-1 + -no-reboot
            # turns a guest panic into a QEMU exit the host can see.
            "-append", "console=ttyS0 quiet panic=-1" + (" " + a.append if a.append else ""),
            "-device", "virtio-serial-pci",
            "-chardev", f"socket,id=agent,path={work}/agent-{tag}.sock,server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=strata.agent",
            "-qmp", f"unix:{work}/qmp-{tag}.sock,server=on,wait=off"]
    if a.cpu:
        argv += ["-cpu", a.cpu]
    if not a.no_disk:
        argv += ["-drive", f"file={work}/rootfs.ext4,format=raw,if=virtio"
                 + (f",cache={a.cache}" if a.cache else "")]
    if incoming:
        argv += ["-incoming", incoming]
    return argv


def connect(path, deadline):
    """QEMU creates its listening sockets a little after exec: retry."""
    while True:
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            return s
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class QMP:
    def __init__(self, path, timeout=30):
        self.s = connect(path, time.monotonic() + timeout)
        self.f = self.s.makefile("rwb", buffering=0)
        json.loads(self.f.readline())  # greeting
        self.cmd("qmp_capabilities")

    def cmd(self, name, **args):
        msg = {"execute": name, **({"arguments": args} if args else {})}
        self.f.write(json.dumps(msg).encode() + b"\n")
        while True:  # skip asynchronous events
            r = json.loads(self.f.readline())
            if "return" in r or "error" in r:
                return r


class Agent:
    """Host end of the line protocol in README.md."""

    def __init__(self, path, timeout=60):
        self.s = connect(path, time.monotonic() + timeout)
        self.buf = b""
        self.n = 0

    def _line(self, deadline):
        while b"\n" not in self.buf:
            self.s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                d = self.s.recv(65536)
            except socket.timeout:
                return None
            if not d:
                raise EOFError("agent socket closed")
            self.buf += d
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def ping(self, timeout=60, every=0.25):
        """Resend PING until a PONG: requests sent before the guest opened the
        port are dropped. Replies with stale ids are ignored."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.n += 1
            want = f"PONG {self.n}"
            self.s.sendall(f"PING {self.n}\n".encode())
            step = min(deadline, time.monotonic() + every)
            while (line := self._line(step)) is not None:
                if line == want:
                    return True
        return False

    def run(self, cmd, timeout=60):
        self.n += 1
        rid = str(self.n)
        self.s.sendall(f"RUN {rid} {base64.b64encode(cmd.encode()).decode()}\n".encode())
        deadline, out = time.monotonic() + timeout, None
        while (line := self._line(deadline)) is not None:
            verb, lid, rest = (line.split(" ", 2) + [""])[:3]
            if lid != rid:
                continue
            if verb == "OUT":
                out = base64.b64decode(rest).decode(errors="replace")
            elif verb == "EXIT":
                return out, int(rest)
            elif verb == "ERR":
                raise RuntimeError(line)
        raise TimeoutError(f"no reply to RUN {rid}")


def start(a, work, tag, procs, incoming=None, share="on"):
    argv = qemu_argv(a, work, tag, incoming, share)
    print("$ " + shlex.join(argv))
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    procs.append(p)
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--machine", default="pc")
    ap.add_argument("--mem", type=int, default=256)
    ap.add_argument("--cpu", default=None)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--append", default="", help="extra kernel arguments")
    ap.add_argument("--no-disk", action="store_true")
    ap.add_argument("--snapshot", action="store_true")
    ap.add_argument("--memfile", action="store_true",
                    help="RAM in a file + x-ignore-shared (with --snapshot)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    a = ap.parse_args()
    a.outdir = os.path.abspath(a.outdir)
    # SIGTERM -> SystemExit so the finally below still kills our QEMUs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = tempfile.mkdtemp(prefix="strata-smoke-", dir="/var/tmp")
    # Work on a copy so the built rootfs.ext4 stays pristine (sparse copy).
    subprocess.run(["cp", "--sparse=always", f"{a.outdir}/rootfs.ext4", work], check=True)
    procs = []
    try:
        t0 = time.monotonic()
        start(a, work, "a", procs)
        qmp = QMP(f"{work}/qmp-a.sock")
        ag = Agent(f"{work}/agent-a.sock")
        assert ag.ping(), "agent never answered"
        ready = time.monotonic() - t0
        up, root = ag.run("cut -d' ' -f1 /proc/uptime; awk '$2==\"/\"{print $1}' /proc/mounts")[0].split()[:2]
        print(f"boot-to-agent-ready: {ready:.2f}s wall (guest uptime {up}s, root={root})")
        t = time.monotonic()
        out, code = ag.run("echo hello; uname -r")
        print(f"RUN 'echo hello; uname -r' -> exit {code} in "
              f"{time.monotonic() - t:.3f}s:\n{out}", end="")
        assert code == 0 and out.startswith("hello\n")
        if not a.no_disk:
            out, code = ag.run("echo written-by-smoke > /root/smoke.txt && sync && cat /root/smoke.txt")
            assert (code, out) == (0, "written-by-smoke\n"), (code, out)
            print("wrote /root/smoke.txt on the rootfs and synced")
        if a.snapshot:
            snapshot(a, work, qmp, ag, procs)
            qmp = None
        if qmp:
            t = time.monotonic()
            qmp.cmd("quit")
            procs[-1].wait(10)
            print(f"QMP quit: QEMU exited in {time.monotonic() - t:.2f}s")
            if not a.no_disk:  # the write reached the image file
                d = subprocess.run(["debugfs", "-R", "cat /root/smoke.txt", f"{work}/rootfs.ext4"],
                                   capture_output=True, text=True).stdout
                print(f"host sees /root/smoke.txt in the image: {d.strip()!r}")
        print("SMOKE OK")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if not a.keep:
            subprocess.run(["rm", "-rf", work])
        else:
            print(f"work dir kept: {work}")


def snapshot(a, work, qmp, ag, procs):
    """pause/resume, then migrate to a file and restore it in a second QEMU."""
    # A background process holding a shell variable in RAM, writing to tmpfs.
    ag.run("(i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.2; done)"
           " >/dev/null 2>&1 & echo $! > /tmp/counter.pid")
    time.sleep(1)
    t = time.monotonic()
    assert qmp.cmd("stop") == {"return": {}}
    print(f"QMP stop: {time.monotonic() - t:.3f}s, status="
          f"{qmp.cmd('query-status')['return']['status']}")
    ag.s.sendall(b"PING paused\n")
    print(f"PING while paused answered: {ag._line(time.monotonic() + 1) is not None}")
    t = time.monotonic()
    qmp.cmd("cont")
    assert ag.ping(10)
    print(f"QMP cont -> PONG: {time.monotonic() - t:.3f}s")
    before, _ = ag.run("cat /tmp/counter.pid /tmp/counter")

    # Snapshot = stop + migrate the (paused) VM state into a file.
    mig = f"{work}/vm.state"
    qmp.cmd("migrate-set-parameters", **{"max-bandwidth": 8 << 30})  # default 32 MiB/s
    if a.memfile:
        caps = [{"capability": "x-ignore-shared", "state": True}]
        assert "error" not in qmp.cmd("migrate-set-capabilities", capabilities=caps)
    t = time.monotonic()
    qmp.cmd("stop")
    r = qmp.cmd("migrate", uri=f"file:{mig}")  # only QEMU >= 8.2 has file:
    print("migrate uri=file:", r.get("error", {}).get("desc", "accepted"))
    if "error" in r:
        r = qmp.cmd("migrate", uri=f"exec:cat > {mig}")
    assert "error" not in r, r
    while (st := qmp.cmd("query-migrate")["return"]).get("status") not in ("completed", "failed"):
        time.sleep(0.02)
    dt = time.monotonic() - t
    assert st["status"] == "completed", st
    if a.memfile:
        du = os.stat(f"{work}/ram.img").st_blocks * 512 / 2**20
        print(f"RAM file ram.img: {a.mem} MiB apparent, {du:.1f} MiB allocated")
    print(f"migrate to file: {dt:.2f}s, {os.path.getsize(mig) / 2**20:.2f} MiB "
          f"(guest RAM {a.mem} MiB), QEMU says total-time {st.get('total-time')} ms")
    qmp.cmd("quit")
    procs[-1].wait(10)
    ag.s.close()

    if a.memfile:
        ram_sum = sha256(f"{work}/ram.img")
    # Restore: same devices, new socket paths, -incoming from the file.
    t0 = time.monotonic()
    if a.memfile:  # the capability must be set before the stream is read
        start(a, work, "b", procs, incoming="defer", share="off")
        qmp = QMP(f"{work}/qmp-b.sock")
        assert "error" not in qmp.cmd("migrate-set-capabilities", capabilities=caps)
        assert "error" not in qmp.cmd("migrate-incoming", uri=f"exec:cat {mig}")
    else:
        start(a, work, "b", procs, incoming=f"exec:cat {mig}")
        qmp = QMP(f"{work}/qmp-b.sock")
    while (s := qmp.cmd("query-status")["return"]["status"]) == "inmigrate":
        time.sleep(0.02)
    t_loaded = time.monotonic() - t0
    # The source was paused, so the restored VM is paused too: resume it.
    print(f"incoming loaded in {t_loaded:.2f}s, status={s}")
    qmp.cmd("cont")
    ag = Agent(f"{work}/agent-b.sock")
    assert ag.ping(30), "restored agent did not answer"
    print(f"restore: QEMU start -> PONG {time.monotonic() - t0:.2f}s")
    pid_b, n_b = before.split()
    time.sleep(0.5)
    out, _ = ag.run("pid=$(cat /tmp/counter.pid); kill -0 $pid && echo alive $pid; "
                    "cat /tmp/counter; cat /root/smoke.txt")
    print(f"before snapshot: counter pid {pid_b} value {n_b}; after restore:\n{out}", end="")
    alive, pid, n = out.split()[:3]
    assert alive == "alive" and pid == pid_b and int(n) > int(n_b), "process state lost"
    print("process state survived the snapshot/restore")
    qmp.cmd("quit")
    procs[-1].wait(10)
    if a.memfile:
        assert sha256(f"{work}/ram.img") == ram_sum, "share=off restore modified ram.img"
        print("ram.img unchanged by the restored VM (MAP_PRIVATE)")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 20):
            h.update(b)
    return h.hexdigest()


if __name__ == "__main__":
    main()
