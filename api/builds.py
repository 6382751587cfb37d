"""E2B-style template builds: boot the base, run the steps, start the start
command, wait for the ready command, snapshot the running VM. A sandbox
created from the template then restores that snapshot instead of booting.

    POST /v3/templates                      -> a build, waiting for its steps
    GET  /templates/{name}/files/{hash}     -> where to PUT a COPY step's tar
    PUT  /templates/{name}/files/{hash}?team=..&expires=..&token=..   (the tar, from the SDK)
    POST /v2/templates/{name}/builds/{id}   -> steps; the build runs (thread)
    GET  /templates/{name}/builds/{id}/status?logsOffset=N  -> status, logs

Steps are E2B's: RUN [cmd, user?], ENV [k, v, ...], WORKDIR [dir],
USER [name], COPY [src, dest, user?, mode?] + filesHash. The base is
`fromTemplate` (a template of this node) or `fromImage`: an image NAME:TAG
in this node's store, or a registry image HOST[:PORT]/REPO[:TAG] (its first
component a host), pulled on the build's thread, within PULL_TIMEOUT, with
`fromImageRegistry`'s username and password if given, and kept as the
team's image NAME:TAG (layerstore/registry.py). A node fetches only from
the registries its config names (`registries`): a caller must not make it
fetch an address of their choosing, so any other is 400 before anything is
asked of the network. ENV, WORKDIR and
USER become the template's process defaults, so sandboxes from it start
their processes the same way. Builds live in the node's memory (a restart
forgets unfinished ones); their logs also go to the build sandbox's event
log.

Uploaded tars are the caller's team's own: kept under
STATE/template-files/TEAM-DIR/HASH.tar, where TEAM-DIR is a digest of the
team name, and a build reads only its own team's. The SDK PUTs a tar
without an API key, so the link it gets is signed for (team, template,
hash, expiry) and valid for UPLOAD_TTL seconds; a tar is checked before it
is kept (a readable tar of files, directories and links, no absolute or
`..` names), and one no build has used for UPLOAD_KEEP seconds is removed.

    STATE/template-files/
      3f1c...e2/                     team alpha's (blake2b of the team name)
        9a0b...64.tar                one COPY step's files, by the SDK's hash
      77d0...1a/                     team beta's: the same hash is another file
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import shlex
import shutil
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from layerstore.errors import Conflict, InvalidInput, NotFound, StrataError
from layerstore.refs import parse_ref
from layerstore.rootfs import DEFAULT_MAX_BYTES
from layerstore.registry import Credentials, Reference, is_registry_ref, parse_reference, pull_image
from layerstore.tarsafe import HostileTar, TarRefused
from layerstore.templates import check_template_name, new_template
from vmm.agent import Agent, Exit, output_events
from vmm.registry import new_sid

from .exceptions import Capacity
from .sources import Source
from .teams import Caller, QuotaExceeded, same_secret
from .uploads import RESERVE

if TYPE_CHECKING:
    from layerstore.store import Store
    from vmm.registry import SandboxRecord
    from vmm.sandbox import Sandboxes

    from .catalog import Catalog

log = logging.getLogger("strata.api")
BUILD = "build"  # the record kind of a build's sandbox (never listed)
LEGACY_BUILD_KEY = "strata.build"  # how records written before kinds marked one (in their metadata)
READY_TIMEOUT = 300.0  # seconds the ready command may take to succeed
STEP_TIMEOUT = 3600.0
MAX_LOGS = 10_000  # log entries a build keeps
MAX_LOG_BYTES = 1 << 20  # characters of log a build keeps (then one entry says the rest was dropped)
BUILD_KEEP = 86400.0  # seconds a finished build's status and logs stay to be read
MAX_TEAM_BUILDS = 256  # builds a team has on the node at once (waiting, running and kept)
UPLOAD_TTL = 3600.0  # seconds an upload link stays valid
UPLOAD_KEEP = 7 * 86400.0  # seconds an uploaded tar no build has used is kept
PULL_TIMEOUT = 1800.0  # seconds a build's pull from a registry may take
MAX_TAR_MEMBERS = 100_000
MAX_TEAM_FILES = 32 << 30  # bytes of uploaded tars a team keeps on a node
MAX_TAR_BYTES = 16 << 30  # bytes the files of one uploaded tar unpack to (a gzip bomb reads no further)
FILES_HASH = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class LogEntry:
    t: float
    level: str
    message: str


@dataclass
class Build:
    name: str
    build_id: str
    team: str
    status: str = "waiting"  # waiting -> building -> ready | error
    logs: list[LogEntry] = field(default_factory=list)
    reason: str = ""
    step: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    ended: float | None = None  # when it became ready or error
    log_chars: int = 0

    def log(self, message: str, level: str = "info") -> None:
        """Keep a log line, within MAX_LOGS entries and MAX_LOG_BYTES in all:
        past them one last entry says so and the rest is dropped."""
        message = message[:4000]
        if len(self.logs) >= MAX_LOGS or self.log_chars < 0:
            return
        if len(self.logs) == MAX_LOGS - 1 or self.log_chars + len(message) > MAX_LOG_BYTES:
            level, message, self.log_chars = "warn", "the build's log is past its cap: later lines are dropped", -1
        else:
            self.log_chars += len(message)
        self.logs.append(LogEntry(time.time(), level, message))

    def end(self, status: str) -> None:
        self.status, self.ended = status, time.time()

    def stale(self, now: float) -> bool:
        """Whether the node may forget it: ended BUILD_KEEP ago, or asked for
        and never started within an upload link's life."""
        if self.ended is not None:
            return now - self.ended > BUILD_KEEP
        return self.status == "waiting" and now - self.created > UPLOAD_TTL


@dataclass(frozen=True)
class Pull:
    """A build's base still in a registry: pulled on the build's thread."""

    ref: Reference
    name: str  # the team's image NAME:TAG it is kept as
    credentials: Credentials | None


class Starter(Protocol):
    """What a build asks of the node's sandbox lifecycle."""

    def source(self, template_id: str, caller: Caller) -> Source: ...

    def start_build_sandbox(self, source: Source, *, sid: str, build_id: str, team: str) -> "SandboxRecord": ...


class Builds:
    """The node's template builds, by (name, build id)."""

    def __init__(self, starter: Starter, catalog: "Catalog", boxes: "Sandboxes", store: "Store",
                 files: Path) -> None:
        self._starter, self._catalog, self._boxes, self._store = starter, catalog, boxes, store
        self.files = files
        self._secret = secrets.token_bytes(32)  # signs upload URLs (the SDK PUTs without an API key)
        self._lock = threading.Lock()
        self._builds: dict[tuple[str, str], Build] = {}

    # requests ------------------------------------------------------------------------
    def request(self, caller: "Caller", name: str) -> Build:
        """A new build of template `name` (a new name, or one of the caller's: rebuilt)."""
        base = name.split(":", 1)[0]
        check_template_name(base)
        self._catalog.check_template_free(caller, base)
        build = Build(base, secrets.token_hex(8), caller.team)
        with self._lock:
            self._forget(time.time())
            held = sum(1 for b in self._builds.values() if b.team == caller.team)
            if held >= MAX_TEAM_BUILDS:
                raise QuotaExceeded(f"team {caller.team} has {held} builds on this node, the most it may hold: "
                                    "start or let them finish first")
            self._builds[(base, build.build_id)] = build
        return build

    def _forget(self, now: float) -> None:
        for key in [key for key, b in self._builds.items() if b.stale(now)]:
            del self._builds[key]

    def get(self, caller: "Caller", name: str, build_id: str) -> Build:
        with self._lock:
            build = self._builds.get((name, build_id))
        if build is None or not caller.sees(build.team):
            raise NotFound(f"build {build_id} of template {name} not found")
        return build

    def upload_grant(self, caller: "Caller", name: str, files_hash: str, *, now: float | None = None) -> dict[str, str]:
        """The query parameters of an upload link for the caller's team: its
        team, an expiry, and a signature over both with the template and hash."""
        _check_hash(files_hash)
        expires = str(int((time.time() if now is None else now) + UPLOAD_TTL))
        return {"team": caller.team, "expires": expires, "token": self._sign(caller.team, name, files_hash, expires)}

    def _sign(self, team: str, name: str, files_hash: str, expires: str) -> str:
        message = "\0".join((team, name, files_hash, expires)).encode("utf-8", "surrogateescape")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def check_grant(self, name: str, files_hash: str, *, team: str, expires: str, token: str) -> Path:
        """Where an upload link's tar goes, if the link is one this node signed
        and has not expired (NotFound otherwise, whatever is wrong with it)."""
        _check_hash(files_hash)
        good = self._sign(team, name, files_hash, expires)
        if not (expires.isdigit() and same_secret(token, good) and int(expires) >= time.time()):
            raise NotFound("no such upload (or its link expired: ask for a new one)")
        return self.upload_path(team, files_hash)

    def files_room(self, team: str) -> int:
        """Bytes team `team` may still upload (its tars on this node stay under MAX_TEAM_FILES
        until unused ones expire); QuotaExceeded at none."""
        held = self.upload_path(team, "0" * 64).parent
        used = sum(p.stat().st_size for p in held.glob("*.tar")) if held.is_dir() else 0
        if used >= MAX_TEAM_FILES:
            raise QuotaExceeded(f"team {team} keeps {used} bytes of uploaded files on this node, the most it may: "
                                "tars no build uses go after a week")
        return MAX_TEAM_FILES - used

    def upload_path(self, team: str, files_hash: str) -> Path:
        """The team's tar of `files_hash` (which need not exist)."""
        _check_hash(files_hash)
        return self.files / hashlib.blake2b(team.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest() \
            / f"{files_hash}.tar"

    def keep_upload(self, staged: Path, dest: Path) -> None:
        """Check the uploaded tar at `staged`, then make it `dest` (atomically:
        a build never reads half a tar). InvalidInput and nothing kept if the
        tar is not one a COPY step can use."""
        check_tar(staged)
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}")
        os.link(staged, part)
        os.replace(part, dest)

    def reap_uploads(self, now: float) -> int:
        """Remove tars no build has used for UPLOAD_KEEP seconds (a build
        touches the tars it reads), and links a crash left half made.
        Returns how many."""
        removed = 0
        for path in self.files.glob("*/*") if self.files.is_dir() else ():
            try:
                age = now - path.stat().st_mtime
                if age > UPLOAD_KEEP or (path.name.startswith(".") and age > UPLOAD_TTL):
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    def start(self, caller: "Caller", name: str, build_id: str, spec: dict[str, Any]) -> Build:
        build = self.get(caller, name, build_id)
        if build.status != "waiting":
            raise Conflict(f"build {build_id} already started")
        steps = spec.get("steps") or []
        if not isinstance(steps, list) or not all(isinstance(s, dict) and isinstance(s.get("type"), str)
                                                   for s in steps):
            raise InvalidInput("steps must be a list of {type, args}")
        base = self._base(caller, spec)
        for s in steps:
            if s["type"] == "COPY":
                tar = self.upload_path(build.team, str(s.get("filesHash") or ""))
                if not tar.exists():
                    raise InvalidInput(f"COPY {s.get('args')}: its files were not uploaded")
                os.utime(tar)  # in use: not reaped
        build.status = "building"
        threading.Thread(target=self._run, args=(build, base, steps, spec), daemon=True,
                         name=f"strata-build-{name}").start()
        return build

    def _base(self, caller: "Caller", spec: dict[str, Any]) -> Source | Pull:
        if spec.get("fromTemplate"):
            return self._starter.source(str(spec["fromTemplate"]), caller)
        image = spec.get("fromImage")
        if not isinstance(image, str) or not image:
            raise InvalidInput("give fromTemplate or fromImage")
        if is_registry_ref(image):
            return self._pull_base(caller, image, spec.get("fromImageRegistry"))
        try:
            return self._starter.source(str(parse_ref(image)), caller)
        except NotFound:
            raise InvalidInput(f"image {image} is not in this node's store: import it with `strata image import`, "
                               "or name a registry image, HOST[:PORT]/REPO:TAG") from None

    def _pull_base(self, caller: "Caller", image: str, auth: Any) -> Pull:
        """A registry image as a build's base, checked before the request
        returns (nothing is fetched yet): a type of credentials this node
        uses, a registry the node's config allows, a name the team may write."""
        ref = parse_reference(image)
        credentials = _credentials(auth)
        allowed = self._catalog.config.registries
        if ref.registry not in allowed:
            raise InvalidInput(f"registry {ref.registry} is not one this node pulls from: its setting `registries` "
                               f"(STRATA_REGISTRIES) allows {', '.join(allowed) or 'none'}")
        name = ref.default_name()
        self._catalog.check_import(caller, name, None)
        return Pull(ref, name, credentials)

    def _pull(self, build: Build, pull: Pull) -> Source:
        """Pull the base into the store as the team's image, within PULL_TIMEOUT and the node's disk:
        its layers, their unpacked tree and the disk made of it sit there at once (a third each)."""
        build.log(f"pulling {pull.ref} as {pull.name}")
        build_root = self._catalog.config.state_dir / "build"
        build_root.mkdir(parents=True, exist_ok=True)
        room = (shutil.disk_usage(build_root).free - RESERVE) // 3
        if room <= 0:
            raise Capacity(f"no room on this node's disk to pull {pull.ref}")
        _, result = pull_image(self._store, pull.ref, None, build_root=build_root,
                               credentials=pull.credentials, deadline=time.monotonic() + PULL_TIMEOUT,
                               max_bytes=min(DEFAULT_MAX_BYTES, room), note=build.log)
        caller = Caller(build.team)
        self._catalog.check_import(caller, pull.name, str(result.size))  # again: taken since? within quota?
        self._store.set_ref(pull.name, result.manifest_id, owner=build.team)
        build.log(f"pulled {pull.ref} as {pull.name} (manifest {result.manifest_id[:16]}, {result.new_chunks} new "
                  "chunks)")
        return self._starter.source(pull.name, caller)

    # the build -------------------------------------------------------------------------
    def _run(self, build: Build, base: Source | Pull, steps: list[dict[str, Any]], spec: dict[str, Any]) -> None:
        """The build, on its own thread; its sandbox is gone before the status says it ended."""
        sid, status = new_sid(), "error"
        try:
            self._build(build, sid, base, steps, spec)
            status = "ready"
        except (StrataError, OSError, ValueError) as exc:
            build.reason = str(exc)
            build.log(f"build failed: {exc}", "error")
        finally:
            try:
                self._boxes.kill(sid)
            except StrataError:
                pass
            build.end(status)

    def _build(self, build: Build, sid: str, base: Source | Pull, steps: list[dict[str, Any]],
               spec: dict[str, Any]) -> None:
        if isinstance(base, Pull):
            base = self._pull(build, base)
        started = time.monotonic()
        build.log(f"booting {base.template} as {sid}")
        record = self._starter.start_build_sandbox(base, sid=sid, build_id=build.build_id, team=build.team)
        build.timings["boot"] = time.monotonic() - started
        agent = self._boxes.agent(sid)
        state = {"env": dict(record.env), "cwd": record.cwd, "user": record.user}
        for n, step in enumerate(steps, 1):
            build.step = str(n)
            self._step(build, agent, step, state)
        build.timings["steps"] = time.monotonic() - started - build.timings["boot"]
        self._start_and_wait(build, agent, spec, state)
        mark = time.monotonic()
        build.log("snapshotting the running sandbox")
        snapshot_id = self._boxes.snapshot(sid)
        build.timings["snapshot"] = time.monotonic() - mark
        self._catalog.check_template_free(Caller(build.team), build.name)  # another team may have taken it since
        self._store.put_template(new_template(build.name, "snapshot", snapshot_id, owner=build.team,
                                                  process=state))
        build.log(f"template {build.name} ready: snapshot {snapshot_id} (boot {build.timings['boot']:.1f} s, "
                  f"steps {build.timings['steps']:.1f} s, start {build.timings.get('start', 0):.1f} s, "
                  f"snapshot {build.timings['snapshot']:.1f} s)")

    def _step(self, build: Build, agent: Agent, step: dict[str, Any], state: dict[str, Any]) -> None:
        kind, args = step["type"], [str(a) for a in step.get("args") or []]
        build.log(f"step {build.step}: {kind} {' '.join(args)[:300]}")
        if kind == "RUN" and args:
            self._run_command(build, agent, args[0], state, user=args[1] if len(args) > 1 and args[1] else "")
        elif kind == "ENV":
            state["env"].update(dict(zip(args[::2], args[1::2])))
        elif kind == "WORKDIR" and args:
            try:
                agent.make_dir(args[0], user=state["user"])
            except StrataError as exc:
                if getattr(exc, "code", "") != "exists":
                    raise
            state["cwd"] = args[0]
        elif kind == "USER" and args:
            state["user"] = args[0]
        elif kind == "COPY" and len(args) >= 2:
            self._copy(agent, self.upload_path(build.team, str(step.get("filesHash") or "")), args, state)
        else:
            raise InvalidInput(f"step {build.step}: {kind} {args} is not a step this node runs")

    def _run_command(self, build: Build, agent: Agent, command: str, state: dict[str, Any], *,
                     user: str = "", timeout: float = STEP_TIMEOUT) -> int:
        _, stream = agent.start("/bin/sh", ["-c", command], env=state["env"], cwd=state["cwd"],
                                user=user or state["user"], merge=True)
        line = b""
        for ev in output_events(stream, time.monotonic() + timeout):
            if isinstance(ev, Exit):
                if line:
                    build.log(line.decode("utf-8", "replace"))
                if ev.code != 0:
                    raise StrataError(f"step {build.step}: `{command[:200]}` failed ({ev.status})")
                return ev.code
            *done, line = (line + ev.data).split(b"\n")
            for d in done:
                build.log(d.decode("utf-8", "replace"))
        return 0

    def _copy(self, agent: Agent, tar_path: Path, args: list[str], state: dict[str, Any]) -> None:
        src, dest = args[0].rstrip("/"), args[1]
        user = args[2] if len(args) > 2 and args[2] else state["user"]
        with HostileTar.open(tar_path) as tar:
            for member in tar:
                name = member.name.lstrip("./")
                if not member.isfile():
                    continue
                if name == src:
                    target = dest.rstrip("/") + "/" + Path(name).name if dest.endswith("/") else dest
                elif src in ("", ".") or name.startswith(src + "/"):
                    target = dest.rstrip("/") + "/" + name[len(src):].lstrip("/")
                else:
                    continue
                data = tar.extractfile(member)
                agent.write_file(target, iter(lambda: data.read(1 << 20), b"") if data else [b""], user=user)
                mode = args[3] if len(args) > 3 and args[3] else oct(member.mode & 0o7777)[2:]
                agent.run(f"chmod {int(mode, 8):o} {shlex.quote(target)}", timeout=60)

    def _start_and_wait(self, build: Build, agent: Agent, spec: dict[str, Any], state: dict[str, Any]) -> None:
        start_cmd, ready_cmd = spec.get("startCmd"), spec.get("readyCmd")
        mark = time.monotonic()
        if start_cmd:
            build.log(f"start command: {start_cmd}")
            agent.start("/bin/sh", ["-c", str(start_cmd)], env=state["env"], cwd=state["cwd"], user=state["user"])
        if ready_cmd:
            build.log(f"waiting for: {ready_cmd}")
            deadline = time.monotonic() + READY_TIMEOUT
            while agent.run(str(ready_cmd), timeout=60, env=state["env"]).exit_code != 0:
                if time.monotonic() > deadline:
                    raise StrataError(f"the ready command did not succeed within {READY_TIMEOUT:.0f} s")
                time.sleep(0.5)
        build.timings["start"] = time.monotonic() - mark


def _credentials(auth: Any) -> Credentials | None:
    """E2B's fromImageRegistry as Credentials (None: anonymous); its `aws`
    and `gcp` types are 400, naming the one this node takes."""
    if auth is None:
        return None
    kind = auth.get("type") if isinstance(auth, dict) else None
    if kind != "registry":
        raise InvalidInput(f"fromImageRegistry type {str(kind)[:40]!r} is not supported: this node pulls "
                           "anonymously or with {type: registry, username, password}")
    username, password = auth.get("username"), auth.get("password")
    if not isinstance(username, str) or not username or not isinstance(password, str) or not password:
        raise InvalidInput("fromImageRegistry of type registry needs a username and a password")
    return Credentials(username, password)


def _check_hash(files_hash: str) -> None:
    if not FILES_HASH.match(files_hash):
        raise InvalidInput("files hash must be 64 lowercase hex digits")


def check_tar(path: Path) -> None:
    """InvalidInput unless `path` is a tar a COPY step can use: readable
    within tarsafe's bounds, at most MAX_TAR_MEMBERS entries of files,
    directories and links holding MAX_TAR_BYTES, no absolute name and no
    `..` in any."""
    unpacked = 0
    try:
        with HostileTar.open(path) as tar:
            for n, member in enumerate(tar):
                unpacked += member.size
                if n >= MAX_TAR_MEMBERS or unpacked > MAX_TAR_BYTES:
                    raise InvalidInput(f"template files: more than {MAX_TAR_MEMBERS} entries or "
                                       f"{MAX_TAR_BYTES >> 30} GiB unpacked")
                parts = member.name.split("/")
                if member.name.startswith("/") or ".." in parts:
                    raise InvalidInput(f"template files: unsafe name {member.name[:200]!r}")
                if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
                    raise InvalidInput(f"template files: {member.name[:200]!r} is not a file, directory or link")
    except TarRefused as exc:
        raise InvalidInput(f"template files: refused: {exc}") from None
    except (tarfile.TarError, EOFError) as exc:
        raise InvalidInput(f"template files are not a tar: {exc}") from None
