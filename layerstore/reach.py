"""Reachability: everything a name needs, in publication order.

A name is an image ref (`NAME:TAG`), a snapshot id (64 hex digits), a
volume id (`vol` + 16 hex digits) or a template name. What it needs, its
closure, is:

    snapshot -> its parent snapshots, and the layers of each
                (disk, memory, state, kernel, initrd)
    layer    -> its parent layers, and the chunks and packs each needs
                (a packed chunk: its pack and its base chunk)
    template -> the image or snapshot it names
    volume   -> the layers of its files

Push and pull copy a closure (chunks, then layers parents first, then
snapshots parents first, then the name); GC marks the closure of every root
and sweeps the rest. One walk serves both, so what GC keeps is exactly what
a push would copy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import CorruptObject, InvalidInput, NotFound
from .manifest import MAX_STACK_DEPTH
from .refs import parse_ref
from .store import Store
from .templates import Template
from .volumes import Volume, Volumes, is_volume_id

_SNAPSHOT_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Name:
    kind: str  # image | snapshot | template | volume | layer
    value: str

    def __str__(self) -> str:
        return self.value


def parse_name(text: str) -> Name:
    """`NAME:TAG` -> image, 64 hex -> snapshot, a volume id -> volume,
    anything else -> template."""
    if ":" in text:
        return Name("image", str(parse_ref(text)))
    if _SNAPSHOT_RE.fullmatch(text):
        return Name("snapshot", text)
    if is_volume_id(text):
        return Name("volume", text)
    from .templates import check_template_name

    return Name("template", check_template_name(text))


@dataclass
class Closure:
    """Manifests in publication order (parents first), the chunk and pack sets."""

    layers: list[str] = field(default_factory=list)
    snapshots: list[str] = field(default_factory=list)
    chunks: set[str] = field(default_factory=set)
    packs: set[str] = field(default_factory=set)
    missing: list[str] = field(default_factory=list)  # objects a root names that are gone

    def add_layer(self, store: Store, layer_id: str, *, strict: bool) -> None:
        chain: list[str] = []
        current: str | None = layer_id
        while current is not None and current not in self._seen_layers:
            if len(chain) >= MAX_STACK_DEPTH:
                raise CorruptObject(f"manifest {layer_id}: parent chain deeper than {MAX_STACK_DEPTH}")
            try:
                layer = store.get_layer(current)
            except NotFound:
                if strict:
                    raise
                self.missing.append(f"manifest {current}")
                break
            chain.append(current)
            self._seen_layers.add(current)
            chunks, packs = layer.needs()
            self.chunks |= chunks
            self.packs |= packs
            current = layer.parent
        self.layers.extend(reversed(chain))

    def add_snapshot(self, store: Store, snapshot_id: str, *, strict: bool) -> None:
        chain: list[str] = []
        current: str | None = snapshot_id
        while current is not None and current not in self._seen_snapshots:
            if len(chain) >= 10_000:
                raise CorruptObject(f"snapshot {snapshot_id}: parent chain too deep")
            try:
                snap = store.get_snapshot(current)
            except NotFound:
                if strict:
                    raise
                self.missing.append(f"snapshot {current}")
                break
            chain.append(current)
            self._seen_snapshots.add(current)
            for layer_id in sorted(snap.layer_ids()):
                self.add_layer(store, layer_id, strict=strict)
            current = snap.parent
        self.snapshots.extend(reversed(chain))

    def add(self, store: Store, name: Name, *, strict: bool = True) -> Template | Volume | str | None:
        """Add `name`'s closure; returns what publishing the name needs (the
        template or volume, or the manifest a ref points at), None for a snapshot."""
        if name.kind == "image":
            try:
                manifest_id = store.resolve(name.value)
            except NotFound:
                if strict:
                    raise
                self.missing.append(f"ref {name.value}")
                return None
            self.add_layer(store, manifest_id, strict=strict)
            return manifest_id
        if name.kind == "snapshot":
            self.add_snapshot(store, name.value, strict=strict)
            return None
        if name.kind == "layer":  # a manifest a running sandbox's disk sits on (GC extra root)
            self.add_layer(store, name.value, strict=strict)
            return None
        if name.kind == "volume":
            volume = Volumes(store.backend).get(name.value)
            for layer_id in volume.layers():
                self.add_layer(store, layer_id, strict=strict)
            return volume
        if name.kind == "template":
            template = store.get_template(name.value)
            target = Name("image" if template.kind == "image" else "snapshot", template.target)
            self.add(store, target, strict=strict)
            return template
        raise InvalidInput(f"unknown name kind {name.kind!r}")

    def __post_init__(self) -> None:
        self._seen_layers: set[str] = set()
        self._seen_snapshots: set[str] = set()
