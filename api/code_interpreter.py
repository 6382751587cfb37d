"""`strata template code-interpreter`: the template E2B's code interpreter
SDK starts by default (`code-interpreter-v1`), built on this node.

    Debian 12 root (mmdebstrap: python3, python3-ipykernel,
    python3-jupyter-client; Debian's packages only; cached as a tar)
      + layer: vmm/guest/codeinterp/server.py, /home/user
      -> image strata-code-interpreter:v1 (an OCI layout of those two layers, imported)
      -> template build: start the server, wait until its kernel is warm, snapshot
      -> template code-interpreter-v1: sandboxes restore it with the server listening on 49999

The Debian root is the slow part (a minute or so, once): it is cached at
`--cache` (default /var/tmp/strata-debian-code-interpreter.tar) and
reused on later runs, as its disk is (the import reuses the disk of a
layer chain it already has), so a rebuild after a change to the server
takes the import of one small layer and the build.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import tarfile
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import vmm
from layerstore.refs import STORE_OWNER

from .compose import NodeContext
from .debian import build_root

TEMPLATE = "code-interpreter-v1"  # the SDK's default template (e2b_code_interpreter.constants)
IMAGE = "strata-code-interpreter:v1"  # a node's own name: no team can replace it
CACHE = Path("/var/tmp/strata-debian-code-interpreter.tar")
PACKAGES = ("python3", "python3-ipykernel", "python3-jupyter-client")
SERVER = Path(vmm.__file__).resolve().parent / "guest" / "codeinterp" / "server.py"
SERVER_IN_GUEST = "/opt/strata/codeinterp/server.py"
READY_FILE = "/run/strata-code-interpreter.ready"
START = f"python3 {SERVER_IN_GUEST} --ready-file {READY_FILE} >/var/log/strata-code-interpreter.log 2>&1"
READY = f"test -f {READY_FILE}"
CONFIG = {"architecture": "amd64", "os": "linux",
          "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"],
                     "WorkingDir": "/root"}}


def register(verbs: dict[str, Any], common: argparse.ArgumentParser) -> None:
    p = verbs["template"].add_parser(
        "code-interpreter", parents=[common],
        help=f"build the template {TEMPLATE} (E2B's code interpreter: Jupyter kernels on port 49999)")
    p.add_argument("--name", default=TEMPLATE, help=f"template name (default {TEMPLATE}, the SDK's default)")
    p.add_argument("--cache", type=Path, default=CACHE, help=f"the Debian root's tar (default {CACHE})")
    p.set_defaults(func=cmd_code_interpreter)


def cmd_code_interpreter(args: argparse.Namespace, ctx: NodeContext) -> int:
    from .build_cli import run_build  # (it registers this command: imported here, not at the top)

    root = debian_root(args.cache, ctx)
    with ctx.out.status(f"importing {IMAGE} (the Debian root and the server as two layers)"):
        imported = import_image(ctx, root)
    ctx.out.note(f"image {IMAGE} imported (manifest {imported[:16]})")
    build = run_build(ctx, ctx.node().builds, args.name,
                      {"fromImage": IMAGE, "steps": [], "startCmd": START, "readyCmd": READY})
    store = ctx.sandboxes().store
    # every team's to start, no team's to change: the store's own (a bare key is team default, not the node)
    store.put_template(replace(store.get_template(build.name), public=True, owner=STORE_OWNER))
    ctx.out.result({"template": build.name, "build": build.build_id, "image": IMAGE, "timings": build.timings},
                   f"template {build.name} built from {IMAGE}: Sandbox.create() of e2b_code_interpreter starts "
                   f"it serving on port 49999 ({', '.join(f'{k} {v:.1f} s' for k, v in build.timings.items())})")
    return 0


def debian_root(cache: Path, ctx: NodeContext) -> Path:
    """The Debian 12 root with Python and Jupyter's kernel, as a tar: made
    once by mmdebstrap from Debian's mirror, then taken from `cache`."""
    return build_root(cache, PACKAGES, status=ctx.out.status)


def import_image(ctx: NodeContext, root: Path) -> str:
    """Import the root and the server layer as IMAGE; its manifest id."""
    from layerstore.rootfs import import_oci

    build_root = ctx.config.state_dir / "build"
    build_root.mkdir(parents=True, exist_ok=True)
    layout = Path(tempfile.mkdtemp(prefix="code-interpreter-", dir=build_root))
    try:
        write_layout(layout, root, server_layer())
        result = import_oci(ctx.sandboxes().store, layout, IMAGE, build_root=build_root, source="strata template code-interpreter")
        return result.manifest_id
    finally:
        shutil.rmtree(layout, ignore_errors=True)


def server_layer() -> bytes:
    """A tar of the server and E2B's working directory, /home/user."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("opt/strata", "opt/strata/codeinterp", "home/user"):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        data = SERVER.read_bytes()
        info = tarfile.TarInfo(SERVER_IN_GUEST.lstrip("/"))
        info.size, info.mode, info.mtime = len(data), 0o644, 0
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_layout(layout: Path, root: Path, layer: bytes) -> None:
    """An OCI image layout: `root` (linked, not copied) and `layer` as its two layers."""
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    root_digest = _cached_digest(root)
    (blobs / root_digest).symlink_to(root.resolve())
    config = json.dumps(CONFIG).encode()
    layers = [(root_digest, root.stat().st_size), (_blob(blobs, layer), len(layer))]
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": "sha256:" + _blob(blobs, config),
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": "sha256:" + digest, "size": size}
                   for digest, size in layers]}).encode()
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:" + _blob(blobs, manifest),
         "size": len(manifest), "platform": {"architecture": "amd64", "os": "linux"}}]}))


def _blob(blobs: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return digest


def _cached_digest(path: Path) -> str:
    """sha256 of `path`, remembered beside it (keyed by size and mtime) so reruns skip hashing it."""
    stat = path.stat()
    memo = path.with_name(path.name + ".sha256")
    key = f"{stat.st_size} {stat.st_mtime_ns}"
    try:
        saved_key, digest = memo.read_text().rsplit(" ", 1)
        if saved_key == key and len(digest) == 64:
            return digest
    except (OSError, ValueError):
        pass
    hashed = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            hashed.update(block)
    try:
        memo.write_text(f"{key} {hashed.hexdigest()}")
    except OSError:
        pass  # only a cache
    return hashed.hexdigest()
