"""`strata serve`: assemble one node (store, mount, VMM, sandboxes, API) and run it.

The service is only the front door: VMs and the FUSE mount are their own
processes, so stopping or restarting the service leaves running sandboxes
running; the next start re-attaches to them through their records.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Any

from layerstore.errors import InvalidInput
from layerstore.logs import configure as configure_logging

if TYPE_CHECKING:
    from layerstore.config import NodeConfig

    from .compose import NodeContext
    from .node import Node

log = logging.getLogger("strata.api")


def watch_metrics(node: Node) -> None:
    """Gauges read at scrape time: sandboxes by state, the mount's cache, sandbox traffic."""
    from .pools import POOL

    def states() -> dict[str, int]:
        counts = {"running": 0, "paused": 0, "pool": 0}
        for record in node.boxes.records():
            if record.kind == POOL:
                counts["pool"] += 1
            else:
                counts["paused" if record.state == "suspended" else "running"] += 1
        return counts

    def cache() -> dict[str, int]:
        return node.cache_stats().counters()

    def traffic() -> dict[str, dict[str, int]]:
        return {r.sid: counters for r in node.boxes.records() if (counters := node.lifecycle.traffic(r))}

    node.metrics.watch(states, cache, traffic)


def run_uvicorn(app: Any, config: NodeConfig) -> None:
    """Serve `app` on the configured address; a WebSocket message from a client is capped as the relay
    caps its targets' (api/proxy.py)."""
    import uvicorn

    from .proxy import MAX_WS_MESSAGE, WS_QUEUE

    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=10,
                ws_max_size=MAX_WS_MESSAGE, ws_max_queue=WS_QUEUE)


def cmd_serve(args: argparse.Namespace, ctx: NodeContext) -> int:
    from .app import create_app

    config = ctx.config
    if not config.store:
        raise InvalidInput("no store given: pass --store PATH|s3://BUCKET/PREFIX or set STRATA_STORE")
    if not config.api_keys:
        raise InvalidInput("no API keys: set STRATA_API_KEYS (comma-separated, 8+ characters each)")
    configure_logging()
    node = ctx.node()
    node.start()
    try:
        log.info("serving %s on http://%s:%d (mount %s)", node.store.describe(), config.host, config.port,
                 config.mount)
        run_uvicorn(create_app(node), config)
    finally:
        node.stop()
    return 0


def cmd_gateway(args: argparse.Namespace, ctx: NodeContext) -> int:
    from layerstore.store import open_node_backend

    from .gateway import Cluster, Gateway

    config = ctx.config
    if not config.store:
        raise InvalidInput("no store given: the gateway reads the cluster's shared store (--store s3://BUCKET/PREFIX "
                           "or STRATA_STORE)")
    configure_logging()
    backend = open_node_backend(config, config.store)
    cluster = Cluster(backend, refresh=args.refresh)
    log.info("gateway for the nodes of %s on http://%s:%d", backend.describe(), config.host, config.port)
    run_uvicorn(Gateway(cluster, admin_keys=tuple(key for _team, key in config.admin_keys)), config)
    return 0


def cmd_config_check(args: argparse.Namespace, ctx: NodeContext) -> int:
    from layerstore.config import FIELDS

    values = ctx.config.values
    if not ctx.config.store:
        raise InvalidInput("config: store is required (STRATA_STORE): the store: a directory (embedded) or "
                           "s3://BUCKET/PREFIX")
    shown = {f.name: ("(set)" if values[f.name] else "(none)") if f.secret else _shown(values[f.name])
             for f in FIELDS}
    ctx.out.result(shown, "\n".join(f"{k:<18} {v}" for k, v in shown.items()) + "\nconfig OK")
    return 0


def _shown(value: object) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def register(nouns: Any, common: argparse.ArgumentParser) -> None:
    p = nouns.add_parser("serve", parents=[common], help="run this node's API service (E2B-compatible)")
    p.add_argument("--host", help="listen address (env STRATA_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (env STRATA_PORT; default 8080)")
    p.add_argument("--warm-pool", action="append", metavar="TEMPLATE=N",
                   help="keep N pre-started paused sandboxes of TEMPLATE (repeatable; env STRATA_WARM_POOL)")
    p.set_defaults(func=cmd_serve)
    p = nouns.add_parser("gateway", parents=[common],
                         help="one E2B endpoint for every node sharing this store (stateless; run any number)")
    p.add_argument("--host", help="listen address (env STRATA_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (env STRATA_PORT; default 8080)")
    p.add_argument("--refresh", type=float, default=5.0, metavar="SECONDS",
                   help="how often the node records are re-read (default 5)")
    p.set_defaults(func=cmd_gateway)
    config = nouns.add_parser("config", help="node configuration")
    cv = config.add_subparsers(dest="verb", metavar="VERB", required=True)
    p = cv.add_parser("check", parents=[common], help="validate the config file + environment and show the result")
    p.set_defaults(func=cmd_config_check)
