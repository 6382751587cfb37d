"""Request and response bodies of the node API.

The sandbox models follow E2B's public OpenAPI spec (e2b-dev/infra
spec/openapi.yml; tests/test_e2b_spec.py checks them against it) field for
field, so E2B's SDKs and clients work unchanged;
fields E2B sends that Strata does not act on are accepted and ignored. The
rest are Strata's own (images, snapshots, cache, exec).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Literal
from uuid import UUID

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from vmm.agent import GuestMetrics
from vmm.events import Event
from vmm.registry import SandboxRecord

from .envd import ENVD_VERSION  # the envd features the node serves

CLIENT_ID = "strata"


def timestamp(ts: float | None) -> datetime:
    """A record's epoch seconds as E2B's date-time (unset: the epoch)."""
    return datetime.fromtimestamp(ts or 0.0, tz=timezone.utc)


def e2b_state(record: SandboxRecord) -> Literal["running", "paused"]:
    """E2B knows two states: its "paused" is our suspended (snapshot taken,
    VM freed); a VM whose vCPUs an operator stopped still counts as running."""
    return "paused" if record.state == "suspended" else "running"


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


def refuse_unserved(body: object, unserved: dict[str, tuple[object, str]]) -> object:
    """ValueError (a 400 naming the field) for a field of E2B's this node does not serve, given
    with a value other than the one it means by default: taken and ignored, it would mislead."""
    if isinstance(body, dict):
        for name, (default, why) in unserved.items():
            if name in body and body[name] not in (None, default) and body[name] != {}:
                raise ValueError(f"{name} is not served by this node: {why}")
    return body


class Reply(BaseModel):
    """An E2B response body: every field is always sent (defaults included),
    and the schema says so, since E2B's SDKs read E2B's required fields
    without checking for them."""
    model_config = ConfigDict(json_schema_serialization_defaults_required=True)


class Error(BaseModel):
    code: int = Field(description="HTTP status code")
    message: str = Field(description="what went wrong, in one line")


# --- E2B sandbox lifecycle ------------------------------------------------------
class SandboxNetwork(Lenient):
    """E2B's `network` of a new sandbox and of `PUT /sandboxes/{id}/network`:
    the egress rules (vmm/egress.py). E2B's `rules`, `egressProxy` and
    `maskRequestHost` are refused (400 naming them) rather than ignored;
    `dnsServers` and `httpsPorts` are accepted and not applied: a sandbox's
    DNS always goes through its node's resolver."""
    allowOut: list[str] | None = Field(None, description="CIDRs, IPs and domains (example.com, *.example.com) "
                                                          "the sandbox may reach; beats denyOut")
    denyOut: list[str] | None = Field(None, description="CIDRs and IPs the sandbox may not reach")
    allowPublicTraffic: bool | None = Field(None, description="whether the sandbox's ports answer without its "
                                                              "traffic access token")

    @model_validator(mode="before")
    @classmethod
    def _served(cls, body: object) -> object:
        return refuse_unserved(body, {
            "rules": ([], "per-host egress rules (header transforms) are not applied; use allowOut and denyOut"),
            "egressProxy": (None, "egress goes out through the node, never through a proxy of the sandbox's"),
            "maskRequestHost": (None, "the Host of requests to sandbox ports is passed on as sent")})


class SandboxNetworkUpdate(SandboxNetwork):
    allow_internet_access: bool | None = Field(None, description="omitted: unchanged (allowInternetAccess too)",
                                               validation_alias=AliasChoices("allow_internet_access",
                                                                             "allowInternetAccess"))


class SandboxVolumeMount(BaseModel):
    name: str = Field(max_length=128)
    path: str = Field(max_length=4096)


class NewSandbox(Lenient):
    templateID: str = Field(description="template (named image or snapshot) or image NAME:TAG")
    timeout: int | None = Field(None, description="seconds to live; default from the node's config")
    autoPause: bool = Field(False, description="pause instead of kill when the timeout expires")
    metadata: dict[str, str] = Field(default_factory=dict)
    envVars: dict[str, str] = Field(default_factory=dict)
    diskSizeMB: int | None = Field(None, ge=1, le=16 << 20, description="Strata: a disk this large (MiB, at least "
                                   "the image's); the guest's root filesystem grows into it at boot")
    allow_internet_access: bool | None = Field(None, description="false = deny every address allowOut does not "
                                                                 "allow; default from the node's config "
                                                                 "(allowInternetAccess too)",
                                               validation_alias=AliasChoices("allow_internet_access",
                                                                             "allowInternetAccess"))
    network: SandboxNetwork | None = None
    volumeMounts: list[SandboxVolumeMount] = Field(default_factory=list, max_length=16,
                                                   description="refused for now (400): the sandbox would not see "
                                                               "the volume; use the volume content API")

    @model_validator(mode="before")
    @classmethod
    def _served(cls, body: object) -> object:
        if isinstance(body, dict) and isinstance(body.get("autoResume"), dict):  # E2B's {"enabled": bool}
            body = {**body, "autoResume": body["autoResume"].get("enabled", False)}
        return refuse_unserved(body, {
            "mcp": (None, "no MCP gateway runs in its sandboxes"),
            "iam": (None, "sandboxes get no workload identity tokens"),
            "autoResume": (False, "a paused sandbox resumes on connect or resume, not on traffic"),
            "autoPauseMemory": (True, "its pauses always keep memory (no filesystem-only snapshots)")})


class Sandbox(Reply):
    templateID: str
    sandboxID: str
    clientID: str = CLIENT_ID
    envdVersion: str = ENVD_VERSION
    alias: str | None = None
    envdAccessToken: str | None = None
    trafficAccessToken: str | None = None
    domain: str | None = None

    @classmethod
    def of(cls, record: SandboxRecord, *, domain: str | None = None) -> Sandbox:
        return cls(templateID=record.template or record.source, sandboxID=record.sid,
                   envdAccessToken=record.access_token or None, trafficAccessToken=record.traffic_token or None,
                   domain=domain)


class ListedSandbox(Reply):
    templateID: str
    alias: str | None = None
    sandboxID: str
    clientID: str = CLIENT_ID
    startedAt: datetime
    endAt: datetime
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    state: Literal["running", "paused"]
    envdVersion: str = ENVD_VERSION
    metadata: dict[str, str] = Field(default_factory=dict)
    volumeMounts: list[SandboxVolumeMount] = Field(default_factory=list)

    @classmethod
    def of(cls, record: SandboxRecord, *, disk_mb: int, volume_names: dict[str, str] | None = None) -> ListedSandbox:
        """`volume_names`: {volume id: name} of the volumes mounted (a deleted one shows its id)."""
        names = volume_names or {}
        mounts = [SandboxVolumeMount(name=names.get(v, v), path=p) for p, v in sorted(record.volumes.items())]
        return cls(templateID=record.template or record.source, sandboxID=record.sid,
                   startedAt=timestamp(record.created), endAt=timestamp(record.end_at), cpuCount=1,
                   memoryMB=record.memory_mib, diskSizeMB=disk_mb, state=e2b_state(record), metadata=record.metadata,
                   volumeMounts=mounts)


class Lifecycle(Reply):
    autoResume: bool = False
    onTimeout: Literal["kill", "pause"]


class SandboxNetworkInfo(Reply):
    allowPublicTraffic: bool = True
    allowOut: list[str] = Field(default_factory=list)
    denyOut: list[str] = Field(default_factory=list)
    address: str | None = Field(None, description="Strata: the sandbox's address on its node (the source of its "
                                                  "traffic there; unique per sandbox, forks included)")


class SandboxDetail(ListedSandbox):
    domain: str | None = None
    lifecycle: Lifecycle
    allow_internet_access: bool | None = Field(None, description="null: the sandbox has no network at all")
    network: SandboxNetworkInfo

    @classmethod
    def of(cls, record: SandboxRecord, *, disk_mb: int, address: str | None = None,
           volume_names: dict[str, str] | None = None) -> SandboxDetail:
        listed = ListedSandbox.of(record, disk_mb=disk_mb, volume_names=volume_names).model_dump()
        rules = record.network
        given = rules or {}  # no network: no rules, no address
        network = SandboxNetworkInfo(allowOut=given.get("allow", []), denyOut=given.get("deny", []), address=address,
                                     allowPublicTraffic=not record.traffic_token)
        return cls(**listed, lifecycle=Lifecycle(onTimeout="pause" if record.auto_pause else "kill"),
                   allow_internet_access=None if rules is None else rules.get("internet", True), network=network)


class SandboxMetric(Reply):
    """One sample, taken when asked (the node keeps no series): the guest's
    CPU use since the previous sample, its memory and root disk now."""
    timestamp: datetime
    timestampUnix: int
    cpuCount: int
    cpuUsedPct: float
    memUsed: int
    memTotal: int
    memCache: int
    diskUsed: int
    diskTotal: int
    netSentBytes: int = Field(0, description="Strata: bytes the guest sent on its network since its VM started")
    netReceivedBytes: int = Field(0, description="Strata: bytes it received")

    @classmethod
    def of(cls, at: float, g: GuestMetrics, traffic: dict[str, int] | None = None) -> SandboxMetric:
        traffic = traffic or {}
        return cls(timestamp=timestamp(at), timestampUnix=int(at), cpuCount=g.cpu_count,
                   cpuUsedPct=round(g.cpu_used_pct, 2), memUsed=g.mem_used, memTotal=g.mem_total,
                   memCache=g.mem_cache, diskUsed=g.disk_used, diskTotal=g.disk_total,
                   netSentBytes=traffic.get("sent_bytes", 0), netReceivedBytes=traffic.get("received_bytes", 0))


class SandboxesWithMetrics(Reply):
    sandboxes: dict[str, SandboxMetric]


class SandboxLog(Reply):
    timestamp: datetime
    line: str


class SandboxLogEntry(Reply):
    timestamp: datetime
    level: Literal["debug", "info", "warn", "error"]
    message: str
    fields: dict[str, str]

    @classmethod
    def of(cls, e: Event) -> SandboxLogEntry:
        return cls(timestamp=timestamp(e.t), level=e.level, message=e.message, fields=e.fields)  # type: ignore[arg-type]


class SandboxLogs(Reply):
    """The sandbox's event log (vmm/events.py): lifecycle, and the processes clients ran."""
    logs: list[SandboxLog]
    logEntries: list[SandboxLogEntry]


class SandboxLogsV2(Reply):
    logs: list[SandboxLogEntry]


# --- E2B template builds (api/builds.py) ----------------------------------------
class TemplateBuildRequestV3(Lenient):
    name: str | None = Field(None, description="template name (NAME or NAME:TAG; the tag is ignored)")
    alias: str | None = Field(None, description="deprecated name")
    tags: list[str] | None = None
    cpuCount: int | None = None
    memoryMB: int | None = None
    minFreeDiskMb: int | None = None


class TemplateRequestResponseV3(Reply):
    templateID: str
    buildID: str
    public: bool = False
    names: list[str]
    tags: list[str]
    aliases: list[str]


class TemplateBuildFileUpload(Reply):
    present: bool
    url: str | None = None


class TemplateStep(Lenient):
    type: str = Field(max_length=32)
    args: list[Annotated[str, Field(max_length=1 << 16)]] = Field(default_factory=list, max_length=256)
    filesHash: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")  # names a file of the node's: only a hash
    force: bool | None = None


class FromImageRegistry(Lenient):
    """E2B's credentials for a registry `fromImage`: this node pulls with
    type `registry` (username, password); `aws` and `gcp` are refused with a
    400 naming what is supported (their other fields are ignored)."""
    type: str = Field(description="registry (username and password); aws and gcp are not supported")
    username: str | None = Field(None, max_length=1024)
    password: str | None = Field(None, max_length=16384)


class TemplateBuildStartV2(Lenient):
    fromImage: str | None = Field(None, description="an image NAME:TAG in this node's store, or a registry image "
                                                    "HOST[:PORT]/REPO[:TAG|@sha256:...] from one the node's "
                                                    "`registries` setting allows")
    fromImageRegistry: FromImageRegistry | None = None
    fromTemplate: str | None = None
    steps: list[TemplateStep] = Field(default_factory=list, max_length=1000)
    startCmd: str | None = None
    readyCmd: str | None = None
    force: bool | None = None


class BuildLogEntry(Reply):
    timestamp: datetime
    level: Literal["debug", "info", "warn", "error"]
    message: str
    step: str | SkipJsonSchema[None] = None  # omitted, not null (the route excludes None)


class BuildStatusReason(Reply):
    message: str
    step: str | SkipJsonSchema[None] = None


class TemplateBuildInfo(Reply):
    templateID: str
    buildID: str
    status: Literal["building", "waiting", "ready", "error"]
    logs: list[str]
    logEntries: list[BuildLogEntry]
    reason: BuildStatusReason | SkipJsonSchema[None] = None  # omitted while there is none


class SandboxTimeoutRequest(Lenient):
    timeout: int = Field(description="seconds from now; replaces the TTL")


class SandboxRefreshRequest(Lenient):
    duration: int | None = Field(None, description="seconds (0..3600) to extend the TTL by, from now")


class SandboxPauseRequest(Lenient):
    memory: bool = Field(True, description="keep memory (Strata always snapshots memory and disk)")
    requireHealthyGuest: bool = False


class ConnectSandbox(Lenient):
    timeout: int | None = Field(None, description="seconds to live from now (only ever extends the TTL)")


class ResumedSandbox(Lenient):
    timeout: int | None = None
    autoPause: bool | None = None


class SandboxForkRequest(Lenient):
    timeout: int | None = Field(None, description="seconds to live for each fork")
    count: int = Field(1, description="number of forks, 1..100")


class SandboxForkResult(Reply):
    """One fork: `sandbox` when it started, `error` when it did not. The other
    is left out, not sent as null: E2B's SDK parses a present `error` (the
    route answers with response_model_exclude_none)."""

    sandbox: Sandbox | SkipJsonSchema[None] = None
    error: Error | SkipJsonSchema[None] = None


class SandboxSnapshotRequest(Lenient):
    name: str | None = Field(None, description="also publish the snapshot as a template of this name (NAME or NAME:TAG)")


class SnapshotInfo(Reply):
    snapshotID: str
    names: list[str]


class AssignTemplateTags(Lenient):
    target: str = Field(max_length=257, description="the template to tag, NAME:TAG")
    tags: list[str] = Field(max_length=64)


class DeleteTemplateTags(Lenient):
    name: str = Field(max_length=257)
    tags: list[str] = Field(max_length=64)


class AssignedTemplateTags(Reply):
    tags: list[str]
    buildID: UUID = Field(description="a UUID naming what the tags point at (tags of one image or snapshot share it)")


class TemplateTag(Reply):
    tag: str
    buildID: UUID
    createdAt: datetime


class TemplateAlias(Reply):
    templateID: str
    public: bool = Field(description="every team may start it (else it is its team's alone)")


class Template(Reply):
    templateID: str
    buildID: str
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    public: bool = False
    aliases: list[str]
    names: list[str]
    createdAt: datetime
    updatedAt: datetime
    createdBy: None = None
    lastSpawnedAt: datetime | None = None
    spawnCount: int = 0
    buildCount: int = 1
    envdVersion: str = ENVD_VERSION
    buildStatus: Literal["ready"] = "ready"
    kind: Literal["image", "snapshot"] = Field(description="Strata: what the template names")
    target: str = Field(description="Strata: the image NAME:TAG or snapshot id")


class NewTemplate(BaseModel):
    name: str = Field(description="template name (letters, digits, '.', '_', '-')")
    image: str | None = Field(None, description="an imported image NAME:TAG")
    snapshot: str | None = Field(None, description="a snapshot id")


# --- Strata's own -----------------------------------------------------------------
class ExecRequest(BaseModel):
    command: str = Field(description="run with `sh -c` in the guest")
    timeout: float = Field(60, description="seconds, 1..3600")


class ExecResult(BaseModel):
    exitCode: int
    output: str = Field(description="stdout and stderr together, cut at the node's `exec_output_limit` "
                                     "with a `[strata: output truncated: ...]` line")
    truncated: bool = Field(False, description="output went past `exec_output_limit`; the rest was dropped")


class ImageInfo(BaseModel):
    ref: str
    manifest: str
    size: int | None
    updated: int | None = None


class ImageDetail(BaseModel):
    ref: str
    manifest: str
    size: int
    chunk_size: int
    layers: int
    data_chunks: int
    hole_chunks: int
    unique_chunks: int
    stored_bytes: int
    missing_chunks: int


class ImportResult(BaseModel):
    ref: str
    manifest: str
    size: int
    new_chunks: int
    new_stored_bytes: int
    seconds: float


class SnapshotLayer(BaseModel):
    role: str
    manifest: str
    size: int
    stored_bytes: int


class SnapshotDetail(BaseModel):
    snapshotID: str
    parents: list[str] = Field(description="parent chain, nearest first")
    layers: list[SnapshotLayer]
    stored_bytes: int = Field(description="compressed bytes of every chunk the snapshot needs")
    vm: dict[str, object]
    annotations: dict[str, str]
    templates: list[str]


class CacheStats(BaseModel):
    model_config = ConfigDict(extra="allow")
    size: int
    capacity: int
    hits: int
    misses: int
    sources: dict[str, int] = Field(default_factory=dict,
                                    description="where fetched chunks came from: local, peer, remote, peer_rejected")


class PinRequest(BaseModel):
    image: str


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    store: str
    mount: bool
    sandboxes: int
    mount_state: Literal["ok", "restarting", "failed"] = Field(
        "ok", description="the mount daemon's supervisor: failed = died too often, no longer restarted")
    mount_restarts: int = Field(0, description="times the mount daemon was found dead and restarted")
    mount_last_restart: datetime | None = None


class GcRequest(BaseModel):
    grace: str = Field("24h", description="never delete anything younger (90s, 15m, 24h, 7d)")
    dryRun: bool = Field(False, description="report what would be deleted; change nothing")
    target: Literal["local", "remote"] = Field("local", description="this node's store, or its remote")
    forgetNodes: list[str] = Field(default_factory=list, description="drained nodes whose stale records are "
                                                                       "removed before this GC (see layerstore/nodes.py)")
    allowMissing: bool = Field(False, description="collect even though the store's roots name missing objects")


class TransferRequest(BaseModel):
    name: str = Field(description="NAME:TAG, a snapshot id or a template name")
    full: bool = Field(True, description="pull: copy every chunk (false: manifests only, chunks read from the remote)")


# volumes (E2B's /volumes and /volumecontent) --------------------------------------------------
class NewVolume(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]+$", max_length=128)
    fromSnapshot: str | None = Field(None, max_length=64, description="Strata: a volume snapshot of the team's "
                                     "to start from (its files, not copied: their layers are shared)")


class VolumeSnapshot(Reply):
    snapshotID: str
    volumeID: str = Field(description="the volume it was taken of")
    name: str = Field(description="that volume's name then")
    takenAt: datetime


class Volume(Reply):
    volumeID: str
    name: str


class VolumeAndToken(Reply):
    volumeID: str
    name: str
    token: str = Field(description="the bearer token of the volume's content API (/volumecontent)")


class VolumeEntryStat(Reply):
    name: str
    type: Literal["file", "directory", "symlink", "unknown"]
    path: str
    size: int
    mode: int
    uid: int
    gid: int
    atime: datetime
    mtime: datetime
    ctime: datetime
    target: str | SkipJsonSchema[None] = None  # symlinks only (omitted otherwise)


class VolumeMetadata(Lenient):
    uid: int | None = Field(None, ge=0, le=2**31)
    gid: int | None = Field(None, ge=0, le=2**31)
    mode: int | None = Field(None, ge=0, le=0o7777)
