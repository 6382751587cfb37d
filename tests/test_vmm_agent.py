"""vmm/agent.py with the real guest agent (vmm/guest/agent, the Go binary
the initramfs carries) on a pseudo-terminal, as Firecracker's serial port
would carry it: processes, streams, re-attach, files, watches. And the host
against a scripted hostile guest on a unix socket: what malformed or
flooding replies do (a clear AgentError, a bounded buffer, never a crash).

The real guest is exercised in a VM by test_vmm_qemu and the API tests;
here it runs on the host (as the test's user, under tmp_path) so each
protocol property is checked in milliseconds.
"""

from __future__ import annotations

import base64
import json
import os
import pty
import select
import socket
import subprocess
import threading
import time
import tracemalloc
import tty
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from vmm.agent import (MAX_IN_FLIGHT, MAX_LINE, Agent, AgentBusy, AgentError, AgentGone, AgentTimeout, Exit,
                       GuestRefused, Interrupted, Output, output_events, truncation_marker)


class _PtyChannel:
    """The host end of a pty, with the socket API vmm.agent uses."""

    def __init__(self, fd: int) -> None:
        self.fd, self.timeout = fd, None

    def settimeout(self, timeout: float | None) -> None:
        self.timeout = timeout

    def recv(self, size: int) -> bytes:
        if not select.select([self.fd], [], [], self.timeout)[0]:
            raise TimeoutError("no output")
        try:
            return os.read(self.fd, size)
        except OSError:
            return b""

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def close(self) -> None:
        os.close(self.fd)


class PtyAgent(Agent):
    def __init__(self, master: int) -> None:
        super().__init__("pty")
        self.master = master

    def _open(self, deadline: float) -> Any:
        return _PtyChannel(os.dup(self.master))


@contextmanager
def agent_on_pty(binary: Path) -> Iterator[PtyAgent]:
    """The agent binary serving a pty, and a ready host Agent on it (bench/envd.py uses it too)."""
    master, slave = pty.openpty()
    tty.setraw(master)
    proc = subprocess.Popen([str(binary), "--port", os.ttyname(slave)],
                            stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    agent = PtyAgent(master)
    try:
        agent.wait_ready(10)
        yield agent
    finally:
        agent.close()
        proc.kill()
        proc.wait()
        os.close(master)
        os.close(slave)


@pytest.fixture
def guest_agent(guest: Path) -> Iterator[PtyAgent]:
    """The real agent binary serving a pty; yields a host Agent on it."""
    with agent_on_pty(guest / "strata-agent") as agent:
        yield agent


def collect(stream: Any, timeout: float = 20) -> tuple[dict[int, bytes], Exit]:
    out: dict[int, bytes] = {}
    for ev in output_events(stream, time.monotonic() + timeout):
        if isinstance(ev, Exit):
            return out, ev
        out[ev.fd] = out.get(ev.fd, b"") + ev.data
    raise AssertionError("no exit")


# --- the real agent -------------------------------------------------------------


def test_run_keeps_order_exit_code_and_env(guest_agent: PtyAgent) -> None:
    r = guest_agent.run("echo one; echo two >&2; echo $GREETING; exit 3", env={"GREETING": "hi"}, timeout=10)
    assert (r.exit_code, r.output) == (3, "one\ntwo\nhi\n")


def test_stdout_and_stderr_stream_apart_with_cwd_and_stdin(guest_agent: PtyAgent, tmp_path: Path) -> None:
    pid, stream = guest_agent.start("/bin/sh", ["-c", "read x; echo out $x $(pwd); echo err >&2"],
                                    cwd=str(tmp_path), stdin=True)
    guest_agent.send_input(pid, b"typed\n")
    out, ex = collect(stream)
    assert out == {1: f"out typed {tmp_path}\n".encode(), 2: b"err\n"}
    assert (ex.code, ex.status) == (0, "exit status 0")


def test_close_stdin_ends_a_reader(guest_agent: PtyAgent) -> None:
    pid, stream = guest_agent.start("/bin/sh", ["-c", "cat; echo eof"], stdin=True)
    guest_agent.send_input(pid, b"abc")
    guest_agent.close_stdin(pid)
    out, ex = collect(stream)
    assert out[1] == b"abceof\n" and ex.code == 0


def test_a_signal_reaches_the_whole_process_group(guest_agent: PtyAgent) -> None:
    pid, stream = guest_agent.start("/bin/sh", ["-c", "sleep 300 & sleep 300; echo never"])
    assert pid in [p.pid for p in guest_agent.processes()]
    guest_agent.signal(pid, 9)
    out, ex = collect(stream)
    assert ex.signal == 9 and ex.status == "signal: killed" and 1 not in out
    assert pid not in [p.pid for p in guest_agent.processes()]
    with pytest.raises(GuestRefused) as err:
        guest_agent.signal(pid, 9)
    assert err.value.code == "not_found"


def test_many_requests_at_once_each_get_their_own_replies(guest_agent: PtyAgent) -> None:
    results: dict[int, Any] = {}

    def work(i: int) -> None:
        results[i] = guest_agent.run(f"sleep 0.{i % 3}; echo {i}-" + "x" * i * 1000, timeout=30).output

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"{i}-" + "x" * i * 1000 + "\n" for i in range(16)}


def test_a_host_that_reconnects_reattaches_without_loss_or_repeats(guest_agent: PtyAgent) -> None:
    """What happens across a pause/restore: the host's connection ends, the
    process goes on, a new connection attaches from the last offset seen."""
    pid, stream = guest_agent.start("/bin/sh", ["-c", "i=0; while [ $i -lt 60 ]; do echo line$i; i=$((i+1)); "
                                                      "sleep 0.02; done"])
    seen, offset = b"", 0
    for ev in output_events(stream, time.monotonic() + 20):
        assert isinstance(ev, Output)
        seen += ev.data
        offset = ev.offset + len(ev.data)
        if seen.count(b"\n") >= 10:
            break
    guest_agent.close()  # the connection ends (the VM paused, say)
    time.sleep(0.3)  # output goes on meanwhile, into the guest's ring
    again = guest_agent.attach(pid, offset=offset)
    rest, ex = collect(again)
    assert ex.code == 0
    assert (seen + rest[1]).decode() == "".join(f"line{i}\n" for i in range(60))


def test_output_past_the_ring_is_reported_lost(guest_agent: PtyAgent) -> None:
    pid, stream = guest_agent.start("/bin/sh", ["-c", "head -c 6000000 /dev/zero; sleep 0.5"])
    stream.cancel()  # nobody reads while 6 MB pass through a 4 MiB ring
    time.sleep(2)
    first = next(output_events(guest_agent.attach(pid, offset=0), time.monotonic() + 10))
    assert isinstance(first, Output) and first.lost > 0 and first.offset == first.lost


def test_a_terminal_process(guest_agent: PtyAgent) -> None:
    pid, stream = guest_agent.start("/bin/sh", ["-c", "stty size; tty"], pty=(100, 30))
    out, ex = collect(stream)
    text = out[3].decode()
    assert "30 100" in text and "/dev/pts/" in text and ex.code == 0


def test_files_round_trip_and_metadata(guest_agent: PtyAgent, tmp_path: Path) -> None:
    data = os.urandom(5 << 20) + b"tail"
    entry = guest_agent.write_file(str(tmp_path / "deep/er/f.bin"), [data[:1000], data[1000:]])
    assert (entry.type, entry.size, entry.name) == ("file", len(data), "f.bin")
    assert (tmp_path / "deep/er/f.bin").read_bytes() == data
    assert b"".join(guest_agent.read_file(str(tmp_path / "deep/er/f.bin"))) == data
    assert [e.path for e in guest_agent.list_dir(str(tmp_path / "deep"), depth=2)] == [
        str(tmp_path / "deep/er"), str(tmp_path / "deep/er/f.bin")]
    assert guest_agent.make_dir(str(tmp_path / "new")).type == "dir"
    with pytest.raises(GuestRefused) as err:
        guest_agent.make_dir(str(tmp_path / "new"))
    assert err.value.code == "exists"
    moved = guest_agent.move(str(tmp_path / "deep/er/f.bin"), str(tmp_path / "other/g.bin"))
    assert moved.path == str(tmp_path / "other/g.bin") and (tmp_path / "other/g.bin").exists()
    (tmp_path / "link").symlink_to(tmp_path / "other")
    assert guest_agent.stat(str(tmp_path / "link")).symlink == str(tmp_path / "other")
    guest_agent.remove(str(tmp_path / "other"))
    assert not (tmp_path / "other").exists()
    for call in (lambda: guest_agent.stat(str(tmp_path / "nope")),
                 lambda: list(guest_agent.read_file(str(tmp_path / "nope"))),
                 lambda: guest_agent.remove(str(tmp_path / "nope"))):
        with pytest.raises(GuestRefused) as err:
            call()
        assert err.value.code == "not_found"
    with pytest.raises(GuestRefused) as err:
        guest_agent.read_file(str(tmp_path))
    assert err.value.code == "is_dir"


def test_watching_a_directory(guest_agent: PtyAgent, tmp_path: Path) -> None:
    stream = guest_agent.watch(str(tmp_path), recursive=True)
    (tmp_path / "sub").mkdir()
    time.sleep(0.2)
    (tmp_path / "sub" / "f").write_text("x")
    events = set()
    while ("sub/f", "create") not in events:
        ev = stream.next(10)["event"]
        events.add((ev["name"], ev["type"]))
    stream.cancel()
    assert ("sub", "create") in events


def test_an_unknown_user_or_cwd_is_refused(guest_agent: PtyAgent) -> None:
    with pytest.raises(GuestRefused, match="does not exist"):
        guest_agent.start("/bin/true", [], user="no-such-user")
    with pytest.raises(GuestRefused, match="working directory"):
        guest_agent.start("/bin/true", [], cwd="/no/such/dir")


def test_bad_requests_get_errors_and_the_agent_stays_up(guest_agent: PtyAgent) -> None:
    conn = guest_agent._connection(time.monotonic() + 5)
    conn.sock.sendall(b"{not json\n" + b"[1,2]\n" + b"x" * (9 << 20) + b"\n")
    with pytest.raises(GuestRefused) as err:
        guest_agent.call("no-such-op", timeout=10)
    assert err.value.code == "invalid"
    assert guest_agent.run("echo alive", timeout=10).output == "alive\n"


def test_reseed_is_refused_short_and_an_agent_too_old_for_it_is_an_error(guest_agent: PtyAgent,
                                                                          tmp_path: Path) -> None:
    assert guest_agent.version >= 3
    with pytest.raises(GuestRefused, match="32 to 4096 bytes"):  # asked with an id, the refusal comes back
        guest_agent.call("reseed", data=base64.b64encode(b"short").decode(), timeout=10)
    assert guest_agent.run("echo alive", timeout=10).output == "alive\n"
    scripted_guest(tmp_path / "old.sock", lambda req: [])  # its hello says no version
    old = Agent(tmp_path / "old.sock")
    try:
        with pytest.raises(AgentError, match="predates reseed"):
            old.reseed(os.urandom(64), timeout=5)
    finally:
        old.close()


# --- the host against a hostile guest ---------------------------------------------


def scripted_guest(path: Path, reply: Callable[[dict[str, Any]], list[bytes]]) -> None:
    """A guest answering hello, and anything else with whatever `reply` says."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            buf = b""
            while data := conn.recv(1 << 16):
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    req = json.loads(line)
                    if req["op"] == "hello":
                        conn.sendall(json.dumps({"id": req["id"], "end": True}).encode() + b"\n")
                    else:
                        try:
                            for part in reply(req):
                                conn.sendall(part)
                        except OSError:
                            return
        server.close()

    threading.Thread(target=serve, daemon=True).start()


def line(**fields: Any) -> bytes:
    return json.dumps(fields).encode() + b"\n"


def test_a_malformed_reply_is_a_clear_error(tmp_path: Path) -> None:
    scripted_guest(tmp_path / "a.sock", lambda r: [line(id=r["id"], pid=1),
                                                   line(id=r["id"], fd=1, off=0, data="!!not base64!!")])
    with pytest.raises(AgentError, match="malformed data"):
        Agent(tmp_path / "a.sock").run("x", timeout=10)


def test_garbage_and_overlong_lines_are_skipped(tmp_path: Path) -> None:
    def reply(r: dict[str, Any]) -> list[bytes]:
        return [b"garbage\n", b"[]\n", b"{\"id\": \"x\"}\n", b"y" * (MAX_LINE + 10) + b"\n", line(id=r["id"], pid=7),
                line(id=r["id"], end=True, exit={"code": 4, "status": "exit status 4"})]

    scripted_guest(tmp_path / "a.sock", reply)
    agent = Agent(tmp_path / "a.sock")
    assert agent.run("x", timeout=10).exit_code == 4
    assert agent._conn is not None and agent._conn.dropped_lines == 3


def test_a_guest_flooding_output_costs_the_host_a_bounded_buffer(tmp_path: Path) -> None:
    """~50 MB of output against a 64 KiB cap: the head is kept with a marker
    saying how much was dropped, and the host never held the flood."""
    block = base64.b64encode(b"y\n" * (1 << 17)).decode()

    def reply(r: dict[str, Any]) -> Iterator[bytes]:
        yield line(id=r["id"], pid=1)
        for i in range(200):
            yield line(id=r["id"], fd=1, off=i << 18, data=block)
        yield line(id=r["id"], end=True, exit={"code": 0, "status": ""})

    scripted_guest(tmp_path / "a.sock", reply)  # type: ignore[arg-type]
    agent = Agent(tmp_path / "a.sock")
    tracemalloc.start()
    try:
        result = agent.run("yes", timeout=60, max_output=64 << 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        agent.close()
    assert result.output.startswith("y\ny\n")
    assert result.output.endswith(truncation_marker(result.dropped, 64 << 10))
    assert result.dropped == 200 * (1 << 18) - (64 << 10)
    assert peak < 16 << 20, f"the host buffered {peak} bytes of a guest's flood"


def test_a_line_that_never_ends_is_cut_and_the_call_times_out(tmp_path: Path) -> None:
    def reply(r: dict[str, Any]) -> Iterator[bytes]:
        yield line(id=r["id"], pid=1)
        for _ in range(40):
            yield b"z" * (1 << 20)

    scripted_guest(tmp_path / "a.sock", reply)  # type: ignore[arg-type]
    agent = Agent(tmp_path / "a.sock")
    tracemalloc.start()
    try:
        with pytest.raises(AgentTimeout, match="timed out"):
            agent.run("flood", timeout=3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        agent.close()
    assert peak < 3 * MAX_LINE, f"the host buffered {peak} bytes of a guest's flood"


def test_a_silent_guest_times_out_and_the_vm_going_away_is_agent_gone(tmp_path: Path) -> None:
    scripted_guest(tmp_path / "a.sock", lambda r: [])
    agent = Agent(tmp_path / "a.sock")
    with pytest.raises(AgentTimeout):
        agent.call("stat", timeout=1, path="/")
    stream = agent.open_stream("stat", path="/")
    assert agent._conn is not None
    agent._conn.sock.shutdown(socket.SHUT_RDWR)
    with pytest.raises(AgentGone):
        stream.next(10)


def test_interrupt_wakes_a_reader_waiting_on_another_thread(tmp_path: Path) -> None:
    """A stream whose client left is interrupted from the event loop while
    its reader waits on a worker thread: the wait ends now with Interrupted
    (not AgentGone, which a process stream answers by re-attaching), every
    later wait too, and the stream still counts as open until cancelled."""
    scripted_guest(tmp_path / "a.sock", lambda r: [])
    agent = Agent(tmp_path / "a.sock")
    stream = agent.open_stream("stat", path="/")
    caught: list[BaseException] = []

    def read() -> None:
        try:
            stream.next(600)
        except AgentError as exc:
            caught.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.2)
    stream.interrupt()
    reader.join(30)
    assert not reader.is_alive() and len(caught) == 1 and type(caught[0]) is Interrupted
    with pytest.raises(Interrupted):
        stream.next(600)
    assert not stream.done
    stream.cancel()
    assert stream.done and agent._conn is not None and stream.id not in agent._conn.open
    watched = agent.open_stream("stat", path="/")  # a polling watcher's: removed by one thread, read by another
    reader = threading.Thread(target=lambda: caught.append(pytest.raises(AgentError, watched.next, 600).value))
    reader.start()
    time.sleep(0.2)
    watched.cancel()
    reader.join(30)
    assert not reader.is_alive() and len(caught) == 2


def test_requests_in_flight_are_capped(tmp_path: Path) -> None:
    scripted_guest(tmp_path / "a.sock", lambda r: [])
    agent = Agent(tmp_path / "a.sock")
    streams = [agent.open_stream("stat", path="/") for _ in range(MAX_IN_FLIGHT)]
    with pytest.raises(AgentBusy, match="already open"):
        agent.open_stream("stat", path="/")
    streams[0].cancel()
    agent.open_stream("stat", path="/")


def test_signalling_a_process_that_just_died_is_not_found_never_an_internal_error(guest_agent: PtyAgent) -> None:
    """Between a process's death and the agent recording its exit (it waits
    up to 250 ms for output a leftover child still holds open) a signal finds
    no process: not_found."""
    pid, stream = guest_agent.start("/bin/sh", ["-c", "setsid sleep 3 & exec sleep 300"])
    time.sleep(0.5)  # the setsid child is out of the process group by now
    guest_agent.signal(pid, 9)
    time.sleep(0.05)  # dead, its exit not yet recorded: the setsid child keeps stdout open
    with pytest.raises(GuestRefused) as err:
        guest_agent.signal(pid, 9)
    assert err.value.code == "not_found"
    stream.cancel()


def test_generated_replies_are_an_exit_or_an_agent_error_never_a_crash(tmp_path: Path) -> None:
    """A hostile guest's agent (hypothesis writes its replies to one command): lines of every
    JSON shape, with the request's id or another, data that is or is not base64, offsets out of
    order, exits of the wrong types, garbage. The node's side answers with the exit, or an
    AgentError naming what was wrong, within the command's timeout; nothing else escapes."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    values = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 65), max_value=1 << 65),
                       st.floats(allow_nan=False), st.text(max_size=12),
                       st.sampled_from([base64.b64encode(b"out\n").decode(), "!!", ""]))
    reply = st.one_of(
        st.fixed_dictionaries({"id": st.sampled_from(["ID", "other", 7, None])},
                              optional={"pid": values, "fd": st.one_of(st.sampled_from([1, 2, 3, -1]), values),
                                        "off": values, "data": values, "end": values, "error": values,
                                        "exit": st.one_of(values, st.fixed_dictionaries(
                                            {"code": values, "status": values}))}),
        st.binary(max_size=40).filter(lambda b: b"\n" not in b))
    counter = iter(range(1 << 30))

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(reply, max_size=8), st.sampled_from([True, True, True, False]))  # most end: time is short
    def run(replies: list, finish: bool) -> None:
        def answer(r: dict[str, Any]) -> list[bytes]:
            lines = [json.dumps({**x, "id": r["id"] if x["id"] == "ID" else x["id"]}).encode() + b"\n"
                     if isinstance(x, dict) else x + b"\n" for x in replies]
            return lines + ([line(id=r["id"], end=True, exit={"code": 0, "status": ""})] if finish else [])

        sock = tmp_path / f"g{next(counter)}.sock"
        scripted_guest(sock, answer)
        agent = Agent(sock)
        try:
            assert isinstance(agent.run("x", timeout=0.5).exit_code, int)
        except AgentError:
            pass
        finally:
            agent.close()

    run()
