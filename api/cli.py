"""`strata`: the one command-line tool, and its entry point.

It sits at the top of the package order (layerstore < fusefs < vmm < api)
because it is where everything meets: it builds the parser from each
package's `register` (named here, not discovered), reads the node's
configuration once (config file, then environment, then this command's
flags) and hands each command a `NodeContext` (api/compose.py) that builds
the parts of the node the command asks for.

Exit codes: 0 ok; 1 (EXIT_FAILED) a failed operation, one line `strata:
error: ...` on stderr; 2 bad usage (argparse); 3 `verify` found problems;
`sandbox exec` passes the guest command's code through and uses 255 for its
own failures; 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import fusefs.cli
import layerstore.cli
import vmm.cli
from layerstore.clikit import EXIT_FAILED, Output, common_options
from layerstore.config import NodeConfig
from layerstore.errors import StrataError

from . import build_cli, server
from .compose import NodeContext

# Flags that override a setting of the same name (argparse dest == NodeConfig field).
OVERRIDES = ("store", "mount", "guest_dir", "vmm", "cache_dir", "cache_size", "host", "port", "warm_pool")


def build_parser() -> argparse.ArgumentParser:
    common = common_options()
    parser = argparse.ArgumentParser(prog="strata", parents=[common],
                                     description="Content-addressed images and snapshots for microVMs.")
    nouns = parser.add_subparsers(dest="noun", metavar="COMMAND", required=True)
    verbs = layerstore.cli.register(nouns, common)
    fusefs.cli.register(nouns, verbs, common)
    vmm.cli.register(nouns, common)
    server.register(nouns, common)
    build_cli.register(verbs, common)
    return parser


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings this command's flags override (None: not given)."""
    given = {name: getattr(args, name, None) for name in OVERRIDES}
    if isinstance(given["warm_pool"], list):
        given["warm_pool"] = ",".join(given["warm_pool"])
    return given


def load_config(args: argparse.Namespace, env: Mapping[str, str]) -> NodeConfig:
    return NodeConfig.load(env, require_store=False, **overrides(args))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Output(json_mode=getattr(args, "json", False))
    failed = getattr(args, "error_exit", EXIT_FAILED)
    ctx = None
    try:
        ctx = NodeContext(load_config(args, os.environ), out)
        return args.func(args, ctx)
    except StrataError as exc:
        sys.stderr.write(f"strata: error: {exc}\n")
        return failed
    except KeyboardInterrupt:
        sys.stderr.write("strata: interrupted\n")
        return 130
    except BrokenPipeError:
        return failed
    except Exception as exc:  # a bug: still one line, traceback on demand
        if os.environ.get("STRATA_DEBUG"):
            raise
        sys.stderr.write(f"strata: internal error: {type(exc).__name__}: {exc} (set STRATA_DEBUG=1 for a traceback)\n")
        return failed
    finally:
        if ctx is not None:
            ctx.close()


if __name__ == "__main__":
    sys.exit(main())
