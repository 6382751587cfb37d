"""Operator work on the stores: garbage collection of this node's store or
of its remote, and copying images, snapshots and templates between them.

The remote (config `remote`) is opened per operation and closed after, one
open at a time per node: its catalog is shared with every other node, and
an operation that holds it open for minutes should not be joined by a
second one from the same node.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from layerstore.config import NodeConfig
from layerstore.errors import Conflict
from layerstore.gc import collect
from layerstore.reach import Name
from layerstore.store import Store, open_node_backend
from layerstore.nodes import Holds
from layerstore.transfer import copy, lazy_pull


class Maintenance:
    def __init__(self, store: Store, config: NodeConfig, *, gc_roots: Callable[[], list[Name]],
                 node_id: str) -> None:
        """`gc_roots` names what GC must keep beyond a store's own refs,
        templates and snapshots for this node (what its sandboxes sit on);
        every other node sharing the store adds its own through its record
        (layerstore/nodes.py)."""
        self.store = store
        self._config = config
        self._gc_roots = gc_roots
        self.node_id = node_id
        self._remote_lock = threading.Lock()

    @contextmanager
    def _remote(self) -> Iterator[Store]:
        if not self._config.remote:
            raise Conflict("this node has no remote store (config `remote`, STRATA_REMOTE)")
        from layerstore.store import open_store

        with self._remote_lock, open_store(self._config.remote, **self._config.store_options(own=False)) as remote:
            yield remote

    def gc(self, *, grace: float, dry_run: bool, remote: bool = False, forget_nodes: list[str] | None = None,
           allow_missing: bool = False) -> dict:
        """Collect garbage (two phases, `grace` seconds, leases, every node's
        roots) in this node's store or its remote."""
        options = dict(grace=grace, dry_run=dry_run, extra_roots=self._gc_roots(), own_node=self.node_id,
                       forget_nodes=forget_nodes or [], allow_missing=allow_missing)
        if remote:
            with self._remote() as store:
                return collect(store, **options).as_dict()  # type: ignore[arg-type]
        return collect(self.store, **options).as_dict()  # type: ignore[arg-type]

    def refresh_hold(self) -> None:
        """Rewrite this node's hold in its remote from its own store, which
        deletes through the API may have shrunk: until then the remote keeps
        more than needed, never less (layerstore/nodes.py)."""
        if not self._config.remote or self._config.remote == self._config.store:
            return
        c = self._config
        remote = open_node_backend(c, c.remote)
        Holds(remote, self.node_id, Path(c.state_dir)).refresh(self.store)

    def push(self, name: str) -> dict:
        """Copy an image, snapshot or template and all it needs to the remote."""
        with self._remote() as remote:
            return copy(self.store, remote, name).as_dict()

    def pull(self, name: str, *, full: bool) -> dict:
        """Fetch `name` from the remote: every chunk (`full`), or only the
        manifests, the chunks then read from the remote as needed; those are
        this node's hold in the remote (layerstore/nodes.py), which the
        remote's GC keeps whether or not this node's record is live."""
        with self._remote() as remote:  # the node reads chunks it lacks from this same remote
            holds = Holds(remote.backend, self.node_id, Path(self._config.state_dir))
            if not full:
                return lazy_pull(remote, self.store, name, holds=holds).as_dict()
            result = copy(remote, self.store, name, chunks=True).as_dict()
            holds.refresh(self.store)  # what this node now holds itself is no longer held there
            return result
