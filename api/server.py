"""`strata serve`: assemble one node (store, mount, VMM, sandboxes, API) and run it.

The service is only the front door: VMs and the FUSE mount are their own
processes, so stopping or restarting the service leaves running sandboxes
running; the next start re-attaches to them through their records.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from layerstore.cli import Output
from layerstore.config import NodeConfig
from layerstore.errors import InvalidInput

log = logging.getLogger("strata.api")


def build_node(config: NodeConfig, env: dict[str, str], out: Output | None = None):  # noqa: ANN201
    """Open the store, make sure the node's mount serves it, and wire a Node."""
    from vmm.cli import open_sandboxes

    from .metrics import Metrics
    from .node import Node

    boxes = open_sandboxes(config, env, out or Output(json_mode=True))
    store = boxes.store
    metrics = Metrics()
    node = Node(config, store, boxes, metrics)

    def states() -> dict[str, int]:
        counts = {"running": 0, "paused": 0, "pool": 0}
        for record in boxes.registry.all():
            if "strata.pool" in record.metadata:
                counts["pool"] += 1
            else:
                counts["paused" if record.state == "suspended" else "running"] += 1
        return counts

    def cache() -> dict[str, int]:
        reply = boxes.client.stats()
        return {**reply.cache, "memory_hits": reply.memory_hits}

    metrics.watch(states, cache)
    return node


def cmd_serve(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    import uvicorn

    from .app import create_app

    store = getattr(args, "store", None)
    config = NodeConfig.load(env, store=store, host=args.host, port=args.port,
                             warm_pool=",".join(args.warm_pool) if args.warm_pool else None)
    if not config.api_keys:
        raise InvalidInput("no API keys: set STRATA_API_KEYS (comma-separated, 8+ characters each)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = build_node(config, env, out)
    node.start()
    try:
        log.info("serving %s on http://%s:%d (mount %s)", node.store.describe(), config.host, config.port,
                 config.mount)
        uvicorn.run(create_app(node), host=config.host, port=config.port, log_level="warning",
                    timeout_graceful_shutdown=10)
    finally:
        node.stop()
        node.store.close()
    return 0


def cmd_config_check(args: argparse.Namespace, env: dict[str, str], out: Output) -> int:
    from layerstore.config import FIELDS

    config = NodeConfig.load(env, store=getattr(args, "store", None))
    shown = {f.name: ("(set)" if config.values[f.name] else "(none)") if f.secret else str(config.values[f.name])
             for f in FIELDS}
    out.result(shown, "\n".join(f"{k:<18} {v}" for k, v in shown.items()) + "\nconfig OK")
    return 0


def register(nouns: Any, verbs: dict[str, Any], common: argparse.ArgumentParser) -> None:
    p = nouns.add_parser("serve", parents=[common], help="run this node's API service (E2B-compatible)")
    p.add_argument("--host", help="listen address (env STRATA_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (env STRATA_PORT; default 8080)")
    p.add_argument("--warm-pool", action="append", metavar="TEMPLATE=N",
                   help="keep N pre-started paused sandboxes of TEMPLATE (repeatable; env STRATA_WARM_POOL)")
    p.set_defaults(func=cmd_serve)
    config = nouns.add_parser("config", help="node configuration")
    cv = config.add_subparsers(dest="verb", metavar="VERB", required=True)
    p = cv.add_parser("check", parents=[common], help="validate the config file + environment and show the result")
    p.set_defaults(func=cmd_config_check)
