"""Rows: the shared store's garbage collection against what a node reads
from it lazily. Node B pulls an image manifests-only from the remote R with
the `strata` CLI (no `strata serve` runs on B: nothing renews a node record),
so every chunk of it stays in R; whoever removes or moves R's ref and runs
R's GC, B's image must still export bit for bit (B's hold in R,
layerstore/nodes.py). Two local-directory stores, the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.images import write_image
from tests.test_cli import run


def _env(tmp_path: Path, name: str, remote: str | None = None) -> dict[str, str]:
    env = {"STRATA_STORE": str(tmp_path / name), "STRATA_STATE_DIR": str(tmp_path / f"{name}-state"),
           "STRATA_RUN_DIR": str(tmp_path / f"{name}-run")}
    return {**env, "STRATA_REMOTE": str(tmp_path / remote)} if remote else env


def _ok(*args: str, env: dict[str, str]) -> str:
    r = run(list(args), env)
    assert r.returncode == 0, (args, r.stderr)
    return r.stdout


@pytest.mark.parametrize("attempt", ["rm", "retag"])
def test_the_remotes_gc_keeps_a_lazily_pulled_image(tmp_path: Path, attempt: str) -> None:
    """attacker: an admin's routine `strata gc --grace 0` on the remote R,
    after R's ref img:a is removed or pointed at other data (a remover of the
    remote ref).  target: node B's image img:a, pulled manifests-only with
    the CLI, no `strata serve` on B.  attempt: rm (or re-import) img:a on R,
    then collect R twice (candidates, then deletion).  must: B's `image
    export img:a` is still exact, and R's gc report names B's hold."""
    data = write_image(tmp_path / "a.img", "rzrp", seed=33, tail=4321)
    r, b = _env(tmp_path, "r"), _env(tmp_path, "b", remote="r")
    _ok("image", "import", str(tmp_path / "a.img"), "img:a", env=r)
    assert json.loads(_ok("pull", "img:a", "--from", str(tmp_path / "r"), "--json", env=b))["chunks_sent"] == 0
    if attempt == "rm":
        _ok("image", "rm", "img:a", env=r)
    else:
        write_image(tmp_path / "other.img", "rr", seed=34)
        _ok("image", "import", str(tmp_path / "other.img"), "img:a", env=r)
    for _ in range(2):
        report = json.loads(_ok("gc", "--grace", "0", "--json", env=r))
    assert report["deleted"] == 0 and [h["node"] for h in report["holds"]] != []
    _ok("image", "export", "img:a", str(tmp_path / "out.img"), env=b)
    assert (tmp_path / "out.img").read_bytes() == data
