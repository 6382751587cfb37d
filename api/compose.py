"""Where a node is put together: the one place that wires store, mount, VMM
backend, sandboxes and API service from one `NodeConfig`.

    NodeConfig (file + environment + flags, read once by api/cli.py)
        |
    NodeContext
        open_store()  -> Store: RetryingBackend(own store) read through
                          peers, then the remote (layerstore.store.open_store)
        mount_client()-> MountClient of the node's FUSE daemon (fusefs)
        sandboxes()   -> Sandboxes(store, mount started if needed,
                          VMM backend, guest dir, work root)   (vmm)
        node()        -> api.node.Node: lifetimes, pools, metrics  (api)

Every `strata` command gets a NodeContext and asks it only for what it
needs (a store command never starts a mount); lower packages describe what
they use of it as Protocols (layerstore.clikit.StoreContext,
vmm.cli.NodeContext), so none of them imports this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from layerstore.clikit import Output
from layerstore.config import NodeConfig
from layerstore.errors import Conflict, InvalidInput

if TYPE_CHECKING:  # each part's modules load when a command first asks for that part
    from fusefs.client import MountClient
    from layerstore.reach import Name
    from layerstore.store import Store
    from vmm.sandbox import Sandboxes


class NodeContext:
    """One node's parts, each built on first use from one NodeConfig."""

    def __init__(self, config: NodeConfig, out: Output) -> None:
        self.config = config
        self.out = out
        self._sandboxes: Sandboxes | None = None

    def open_store(self, spec: str | None = None, *, level: int | None = None, bulk: bool = False) -> Store:
        """The node's store (`spec` None), or another store (a push target, a
        pull source). Only the node's own store reads through peers and the
        remote: another store is opened bare."""
        from layerstore.chunk import DEFAULT_LEVEL
        from layerstore.store import open_store

        own = spec is None or spec == self.config.store
        return open_store(spec or self.config.store, level=level or DEFAULT_LEVEL, direct_writes=bulk,
                          **self.config.store_options(own=own))

    def mount_client(self, mountpoint: Path | None = None) -> MountClient:
        """The control client of the daemon serving `mountpoint` (default: the node's mount)."""
        from fusefs.client import MountClient

        return MountClient(mountpoint or self.config.mount, run_dir=self.config.run_dir)

    def node_roots(self, store: Store) -> list[Name]:
        """The layers this node's sandbox disks sit on, if its mount serves `store`."""
        from fusefs.client import DaemonError
        from layerstore.reach import Name

        client = self.mount_client()
        try:
            if client.ping().store != store.describe():
                return []
            return [Name("layer", m) for m in client.disk_layers()]
        except DaemonError:
            live = self._sandboxes_on_the_mount()
            if live:  # their layers are known only to the daemon: a GC now could delete what they sit on
                raise Conflict(f"the node's mount daemon ({self.config.mount}) does not answer, so the layers "
                               f"its {len(live)} sandbox(es) ({', '.join(live[:3])}) sit on are unknown: start "
                               "it (strata serve, or strata mount) or kill those sandboxes, then run gc again") \
                    from None
            return []

    def _sandboxes_on_the_mount(self) -> list[str]:
        """Sandboxes of this node whose disks live on its mount (all but those paused to the store)."""
        from vmm.registry import Registry

        root = self.config.state_dir / "sandboxes"
        if not root.exists():
            return []
        return sorted(r.sid for r in Registry(root).all() if r.state != "suspended")

    def node_snapshot_users(self) -> dict[str, list[str]]:
        from vmm.registry import Registry

        return Registry(self.config.state_dir / "sandboxes").snapshot_users()

    def sandboxes(self) -> Sandboxes:
        """The node's sandboxes (the mount is started if none serves yet)."""
        from vmm.backend import open_backend
        from vmm.sandbox import Sandboxes

        if self._sandboxes is None:
            store = self.open_store()
            client = ensure_mount(self.config, store.describe(), self.out)
            c = self.config
            backend = open_backend(c.vmm, accel=c.accel, state_dir=c.state_dir)
            self._sandboxes = Sandboxes(store, client, backend, guest_dir=c.guest_dir,
                                        work_root=c.state_dir / "sandboxes", memory_mib=c.sandbox_memory,
                                        network=self.network(), volume_staging=c.max_upload)
        return self._sandboxes

    def network(self):  # noqa: ANN201 (vmm.network.Network | None)
        """The node's sandbox networks, or None with config network.enabled = false."""
        from vmm.network import Network

        c = self.config
        if not c.network_enabled:
            return None
        # guests never reach the store's endpoint, the peers or this node's advertised address (unless opened)
        endpoints = (c.s3_endpoint, *c.peers, c.advertise_url)
        return Network(c.state_dir / "network", pool=c.network_pool, dns_port=c.network_dns_port,
                       gate_port=c.network_gate_port, blocked=c.network_blocked, opened=c.network_open,
                       endpoints=endpoints, max_connections=c.network_max_connections,
                       bandwidth=c.network_bandwidth)


    def node(self):  # noqa: ANN201 (api.node.Node; imported late: FastAPI's import is slow)
        """The API's node over this node's sandboxes: its services, each with
        one job (api/node.py lists them), wired here; its metrics watching them."""
        import threading

        from layerstore.nodes import node_id_of

        from .access import Access
        from .builds import Builds
        from .catalog import Catalog
        from .cluster import Membership
        from .envd import Watchers
        from .lifecycle import Lifecycle
        from .lifetimes import Lifetimes
        from .maintenance import Maintenance
        from .metrics import Metrics
        from .node import Node
        from .pools import POOL, WarmPools
        from .server import watch_metrics
        from .supervisor import MountSupervisor
        from .teams import Caller
        from .volumes import TeamVolumes

        c, boxes, metrics = self.config, self.sandboxes(), Metrics()
        store, state = boxes.store, Path(c.state_dir)
        hold_stale = threading.Event()  # a name was deleted: the hold in the remote may shrink
        catalog = Catalog(store, c, uploads=state / "uploads", node_users=boxes.snapshot_users,
                          deleted=hold_stale.set)
        cluster = Membership(c, store, boxes, node_id=node_id_of(state), quietly=metrics.quietly)
        watchers = Watchers()
        lifecycle: Lifecycle
        pools = WarmPools(c.warm_pool, boxes, lambda template: lifecycle.start_pooled(template), failed=metrics.error)
        lifecycle = Lifecycle(c, store, boxes, metrics, catalog=catalog, cluster=cluster, pools=pools,
                              watchers=watchers)
        node = Node(c, boxes, metrics, catalog=catalog, cluster=cluster,
                    maintenance=Maintenance(store, c, gc_roots=cluster.roots, node_id=cluster.node_id),
                    supervisor=MountSupervisor(c, boxes, disposable=lambda r: r.kind == POOL), watchers=watchers,
                    lifetimes=Lifetimes(c, boxes, cluster, quietly=metrics.quietly), pools=pools, lifecycle=lifecycle,
                    access=Access(c, boxes, lifecycle.record),
                    builds=Builds(lifecycle, catalog, boxes, store, state / "template-files"),
                    volumes=TeamVolumes(store, c, catalog, uploads=state / "uploads"), hold_stale=hold_stale,
                    network=boxes.network)
        boxes.volumes.quota = lambda team, size: catalog.check_stored(Caller(team), size)  # guests' volume writes
        watch_metrics(node)
        return node

    def close(self) -> None:
        if self._sandboxes is not None:
            self._sandboxes.store.close()


def ensure_mount(config: NodeConfig, wanted: str, out: Output) -> MountClient:
    """The client of the daemon serving the node's mount, started on `config`
    if none answers; refuses a mount that serves another store than `wanted`
    (sandboxes would mix two)."""
    from fusefs.client import DaemonError, MountClient, mount
    from fusefs.control import MountSettings, make_mountpoint

    client = MountClient(config.mount, run_dir=config.run_dir)
    try:
        served = client.ping().store
    except DaemonError:
        make_mountpoint(config.mount)
        with out.status(f"mounting {wanted} at {config.mount}"):
            mount(MountSettings.from_config(config))
        return client
    if served != wanted:
        raise InvalidInput(f"{config.mount} serves {served}, not {wanted}: pass --mount for another mount point")
    return client
