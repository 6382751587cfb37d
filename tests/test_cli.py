"""The `strata` command end to end, as a user runs it, on all three backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import MotoHTTP, free_port, seaweed_env
from tests.images import write_image


def strata_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "strata"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "api.cli"]


def run(args: list[str], env: dict[str, str] | None = None, *, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "AWS_"))}
    full_env["HOME"] = str(Path(tempfile.gettempdir()) / "strata-test-home")  # no user config file leaks in
    full_env.update(env or {})
    return subprocess.run(strata_cmd() + args, env=full_env, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def moto_server() -> Iterator[str]:
    server = MotoHTTP("cli-tests")
    yield server.endpoint
    server.stop()


@pytest.fixture(params=["local", "moto", "seaweedfs"])
def store_env(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """Environment selecting a fresh store of each kind via STRATA_STORE."""
    state = {"STRATA_STATE_DIR": str(tmp_path / "state")}
    if request.param == "local":
        return {**state, "STRATA_STORE": str(tmp_path / "store")}
    prefix = f"s3://cli-tests/{tmp_path.name[-20:]}"
    if request.param == "moto":
        endpoint = request.getfixturevalue("moto_server")
        return {**state, "STRATA_STORE": prefix, "STRATA_S3_ENDPOINT": endpoint,
                "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    server = request.getfixturevalue("seaweed")
    server.create_bucket("cli-tests") if "cli-tests" not in _buckets(server) else None
    return {**state, **seaweed_env(server), "STRATA_STORE": prefix}


def _buckets(server) -> set[str]:
    return {b["Name"] for b in server.client().list_buckets().get("Buckets", [])}


def test_roundtrip_all_backends(store_env: dict[str, str], tmp_path: Path) -> None:
    content = write_image(tmp_path / "disk.img", "rzpprd", tail=777)
    r = run(["image", "import", str(tmp_path / "disk.img"), "demo:v1", "--json"], store_env)
    assert r.returncode == 0, r.stderr
    imported = json.loads(r.stdout)
    assert imported["ref"] == "demo:v1" and imported["size"] == len(content) and imported["new_chunks"] == 5

    r = run(["image", "ls", "--json"], store_env)
    assert r.returncode == 0, r.stderr
    assert [row["ref"] for row in json.loads(r.stdout)] == ["demo:v1"]

    r = run(["image", "inspect", "demo:v1", "--json"], store_env)
    info = json.loads(r.stdout)
    assert info["manifest"] == imported["manifest"] and info["data_chunks"] == 6 and info["unique_chunks"] == 5
    assert 0 < info["stored_bytes"] < info["logical_bytes"] and info["dedup_ratio"] > 1

    out = tmp_path / "out.img"
    r = run(["image", "export", "demo:v1", str(out), "--json"], store_env)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == content

    r = run(["verify", "--json"], store_env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True

    r = run(["image", "import", str(tmp_path / "disk.img"), "demo:v2", "--json"], store_env)
    assert json.loads(r.stdout)["new_chunks"] == 0

    r = run(["image", "rm", "demo:v1"], store_env)
    assert r.returncode == 0, r.stderr
    r = run(["image", "ls", "--json"], store_env)
    assert [row["ref"] for row in json.loads(r.stdout)] == ["demo:v2"]


def test_text_output_is_human(tmp_path: Path) -> None:
    env = {"STRATA_STORE": str(tmp_path / "s")}
    write_image(tmp_path / "a.img", "rp")
    r = run(["image", "import", str(tmp_path / "a.img"), "a:1"], env)
    assert r.returncode == 0 and "imported" in r.stdout and "MB/s" in r.stdout
    r = run(["image", "inspect", "a:1"], env)
    assert "dedup ratio" in r.stdout and "stored bytes" in r.stdout
    r = run(["image", "ls"], env)
    assert "a:1" in r.stdout


def _one_line_error(r: subprocess.CompletedProcess, code: int, needle: str) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("strata: error:") and needle in lines[0], lines[0]


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and "catalog" not in p.parts}


def test_bad_input_one_line_and_store_unchanged(tmp_path: Path) -> None:
    store = tmp_path / "s"
    env = {"STRATA_STORE": str(store)}
    write_image(tmp_path / "a.img", "rp")
    assert run(["image", "import", str(tmp_path / "a.img"), "a:1"], env).returncode == 0
    before = _snapshot(store)
    cases = [
        (["image", "import", str(tmp_path / "nope.img"), "a:2"], "no such file"),
        (["image", "import", str(tmp_path), "a:2"], "directory"),
        (["image", "import", str(tmp_path / "a.img"), "../evil:x"], "invalid image name"),
        (["image", "import", str(tmp_path / "a.img"), "a/b:x"], "invalid image name"),
        (["image", "import", str(tmp_path / "a.img"), "a:x/y"], "invalid image tag"),
        (["image", "import", str(tmp_path / "a.img"), "a:.."], "invalid image tag"),
        (["image", "export", "missing:v1", str(tmp_path / "o")], "not found"),
        (["image", "inspect", "missing:v1"], "not found"),
        (["image", "rm", "missing:v1"], "not found"),
        (["image", "export", "a:1", str(tmp_path / "nodir" / "o")], "no such directory"),
    ]
    for args, needle in cases:
        _one_line_error(run(args, env), 1, needle)
    assert _snapshot(store) == before


def test_bad_chunk_size_is_usage_error(tmp_path: Path) -> None:
    r = run(["image", "import", "x", "a:1", "--chunk-size", "12abc"], {"STRATA_STORE": str(tmp_path / "s")})
    assert r.returncode == 2 and "invalid size" in r.stderr
    write_image(tmp_path / "a.img", "r")
    r = run(["image", "import", str(tmp_path / "a.img"), "a:1", "--chunk-size", "3M"], {"STRATA_STORE": str(tmp_path / "s")})
    _one_line_error(r, 1, "power of two")


def test_unreadable_file(tmp_path: Path) -> None:
    img = tmp_path / "secret.img"
    write_image(img, "r")
    os.chmod(img, 0o000)
    store = tmp_path / "store"
    args = ["image", "import", str(img), "a:1"]
    if os.geteuid() == 0:  # root reads anything: run without the capabilities that bypass file modes
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *strata_cmd(), *args]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "AWS_"))}
        r = subprocess.run(cmd, env={**env, "STRATA_STORE": str(store)}, capture_output=True, text=True, timeout=60)
    else:
        r = run(args, {"STRATA_STORE": str(store)})
    _one_line_error(r, 1, "permission denied")
    assert list((store / "objects").rglob("*")) == []


def test_corrupt_chunk_fails_export_and_verify(tmp_path: Path) -> None:
    store = tmp_path / "s"
    env = {"STRATA_STORE": str(store)}
    write_image(tmp_path / "a.img", "rr")
    assert run(["image", "import", str(tmp_path / "a.img"), "a:1"], env).returncode == 0
    victim = sorted((store / "objects" / "chunks").rglob("*"))[-1]
    victim.write_bytes(victim.read_bytes()[:-10])  # truncated object
    _one_line_error(run(["image", "export", "a:1", str(tmp_path / "o")], env), 1, victim.name)
    assert not (tmp_path / "o").exists()
    r = run(["verify"], env)
    assert r.returncode == 3 and victim.name in r.stdout and "FAILED" in r.stdout


def test_unreachable_s3_endpoint(tmp_path: Path) -> None:
    env = {"STRATA_STORE": "s3://bucket/x", "STRATA_S3_ENDPOINT": f"http://127.0.0.1:{free_port()}",
           "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b", "STRATA_STATE_DIR": str(tmp_path)}
    _one_line_error(run(["image", "ls"], env, timeout=60), 1, "cannot reach")


def test_missing_bucket_and_bad_url(moto_server: str, tmp_path: Path) -> None:
    env = {"STRATA_STORE": "s3://no-such-bucket/x", "STRATA_S3_ENDPOINT": moto_server,
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "STRATA_STATE_DIR": str(tmp_path)}
    _one_line_error(run(["image", "ls"], env), 1, "does not exist")
    _one_line_error(run(["image", "ls"], {"STRATA_STORE": "ftp://x/y"}), 1, "unsupported store URL")
    _one_line_error(run(["image", "ls"], {}), 1, "no store given")


def test_wrong_credentials(seaweed, tmp_path: Path) -> None:
    env = {**seaweed_env(seaweed), "AWS_SECRET_ACCESS_KEY": "wrong-secret", "STRATA_STORE": "s3://strata-tests/creds",
           "STRATA_STATE_DIR": str(tmp_path)}
    _one_line_error(run(["image", "ls"], env), 1, "access denied")


def test_config_file_selects_store(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'store = "{tmp_path / "cfgstore"}"\n')
    write_image(tmp_path / "a.img", "r")
    r = run(["image", "import", str(tmp_path / "a.img"), "c:1"], {"STRATA_CONFIG": str(config)})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "cfgstore" / "objects" / "refs" / "c" / "1").exists()
    config.write_text('bogus = 1\n')
    _one_line_error(run(["image", "ls"], {"STRATA_CONFIG": str(config)}), 1, "unknown key")


def test_template_and_snapshot_nouns(tmp_path: Path) -> None:
    env = {"STRATA_STORE": str(tmp_path / "s"), "STRATA_STATE_DIR": str(tmp_path / "state")}
    write_image(tmp_path / "a.img", "rp")
    assert run(["image", "import", str(tmp_path / "a.img"), "a:1"], env).returncode == 0
    r = run(["template", "create", "base", "--image", "a:1", "--json"], env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) | {"created": 0} == {"name": "base", "kind": "image", "target": "a:1", "created": 0,
                                                   "public": False}
    assert [t["name"] for t in json.loads(run(["template", "ls", "--json"], env).stdout)] == ["base"]
    _one_line_error(run(["template", "create", "bad", "--image", "missing:1"], env), 1, "missing:1")
    _one_line_error(run(["template", "create", "bad", "--snapshot", "ab" * 32], env), 1, "not found")
    assert json.loads(run(["snapshot", "ls", "--json"], env).stdout) == []
    _one_line_error(run(["snapshot", "inspect", "nope"], env), 1, "not found")
    _one_line_error(run(["snapshot", "rm", "cd" * 32], env), 1, "not found")
    assert run(["template", "rm", "base"], env).returncode == 0
    assert json.loads(run(["template", "ls", "--json"], env).stdout) == []
    _one_line_error(run(["template", "rm", "base"], env), 1, "base")


def test_push_and_pull_default_to_the_configured_remote(tmp_path: Path) -> None:
    env = {"STRATA_STORE": str(tmp_path / "s"), "STRATA_STATE_DIR": str(tmp_path / "state")}
    write_image(tmp_path / "a.img", "rp")
    assert run(["image", "import", str(tmp_path / "a.img"), "a:1"], env).returncode == 0
    _one_line_error(run(["push", "a:1"], env), 1, "STRATA_REMOTE")
    assert run(["image", "ls"], {"STRATA_STORE": str(tmp_path / "remote")}).returncode == 0  # creates it
    config = tmp_path / "config.toml"
    config.write_text(f'remote = "{tmp_path / "remote"}"\n')  # in the file only: the file is read too
    env["STRATA_CONFIG"] = str(config)
    r = run(["push", "a:1", "--json"], env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["chunks_sent"] == 2
    other = {**env, "STRATA_STORE": str(tmp_path / "other")}
    r = run(["pull", "a:1", "--full", "--json"], other)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["chunks_sent"] == 2


def test_the_command_line_starts_without_the_web_framework() -> None:
    """Every `strata` command pays for what its entry point imports; FastAPI
    alone was half a second of it, and only `strata serve` / `gateway` need it;
    the registry client's httpx (50 ms) only pulls and builds."""
    code = "import sys, api.cli; print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'httpx') " \
           "if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def _two_nodes(tmp_path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The environments of a remote R and of a node B whose remote is R, with img:a imported in R."""
    remote = {"STRATA_STORE": str(tmp_path / "r"), "STRATA_STATE_DIR": str(tmp_path / "r-state"),
              "STRATA_RUN_DIR": str(tmp_path / "r-run")}
    node = {"STRATA_STORE": str(tmp_path / "b"), "STRATA_STATE_DIR": str(tmp_path / "b-state"),
            "STRATA_RUN_DIR": str(tmp_path / "b-run"), "STRATA_REMOTE": str(tmp_path / "r")}
    write_image(tmp_path / "a.img", "rp", seed=41)
    assert run(["image", "import", str(tmp_path / "a.img"), "img:a"], remote).returncode == 0
    return remote, node


def test_a_lazy_pull_whose_hold_the_remote_refuses_is_refused(tmp_path: Path) -> None:
    """Fail closed: R cannot take B's hold, so B's lazy pull says so in one line and publishes
    nothing; `pull --full` (which leaves nothing in R) still works."""
    remote, node = _two_nodes(tmp_path)
    (tmp_path / "r" / "objects" / "holds").write_text("not a directory")  # every put under holds/ fails
    _one_line_error(run(["pull", "img:a"], node), 1, "pull --full")
    assert json.loads(run(["image", "ls", "--json"], node).stdout) == []
    r = run(["pull", "img:a", "--full", "--json"], node)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["chunks_sent"] == 2


def test_gc_lists_the_holds_it_keeps_and_forget_node_releases_them(tmp_path: Path) -> None:
    """A hold never expires, so `strata gc` names it (node, layers, age) where an operator sees it;
    `--forget-node` lets a node that is gone for good go, and R collects its image."""
    remote, node = _two_nodes(tmp_path)
    assert run(["pull", "img:a"], node).returncode == 0
    node_id = (tmp_path / "b-state" / "node-id").read_text().strip()
    assert run(["image", "rm", "img:a"], remote).returncode == 0
    r = run(["gc", "--grace", "0"], remote)
    assert r.returncode == 0, r.stderr
    assert f"kept for nodes that pulled lazily from this store: {node_id} (1 layers, written 0.0 d ago)" in r.stdout
    assert "`strata gc --forget-node NODE`" in r.stdout
    for _ in range(2):
        r = run(["gc", "--grace", "0", "--forget-node", node_id, "--json"], remote)
        assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["deleted"] == 3 and json.loads(r.stdout)["holds"] == []
