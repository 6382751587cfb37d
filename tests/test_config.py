"""layerstore/config.py: the one configuration schema, and deploy/README.md's copy of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerstore.config import NodeConfig, config_reference, parse_bytes, parse_duration
from layerstore.errors import InvalidInput

ROOT = Path(__file__).resolve().parent.parent


def test_readme_documents_the_schema_as_it_is() -> None:
    """deploy/README.md's Configuration table is the schema's, exactly."""
    assert config_reference() in (ROOT / "deploy" / "README.md").read_text()


def test_parsers() -> None:
    assert parse_bytes("64K") == 65536 and parse_bytes("2GiB") == 2 << 30 and parse_bytes("10") == 10
    assert parse_duration("90") == 90 and parse_duration("15m") == 900 and parse_duration("7d") == 604800
    for bad in ("x", "-1", "1Q"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(ValueError):
        parse_duration("soon")


def test_file_then_environment_then_overrides(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('store = "/srv/store"\nport = 9000\nwarm_pool = "base=2,other=1"\n[s3]\npath_style = true\n')
    c = NodeConfig.load({"STRATA_CONFIG": str(config), "STRATA_PORT": "9100", "STRATA_API_KEYS": "k" * 8,
                         "STRATA_ADMIN_KEYS": "a" * 8, "STRATA_STATE_DIR": str(tmp_path)})
    assert c.store == "/srv/store" and c.port == 9100 and c.warm_pool == {"base": 2, "other": 1}
    assert c.api_keys == (("default", "k" * 8), ("default", "a" * 8)) and c.admin_keys == (("default", "a" * 8),)
    assert c.mount == tmp_path / "mnt" and c.s3_path_style is True and c.path_style
    assert NodeConfig.load({"STRATA_CONFIG": str(config)}, port=9200).port == 9200
    (tmp_path / "empty.toml").write_text("")
    again = NodeConfig.load({**c.env(), "STRATA_CONFIG": str(tmp_path / "empty.toml")})
    assert again.warm_pool == c.warm_pool and again.port == c.port  # env() round-trips


@pytest.mark.parametrize("env, message", [
    ({"STRATA_PORT": "70000"}, "STRATA_PORT"), ({"STRATA_CACHE_SIZE": "big"}, "STRATA_CACHE_SIZE"),
    ({"STRATA_SANDBOX_TIMEOUT": "soon"}, "STRATA_SANDBOX_TIMEOUT"), ({"STRATA_VMM": "xen"}, "STRATA_VMM"),
    ({"STRATA_API_KEYS": "short"}, "STRATA_API_KEYS"), ({"STRATA_WARM_POOL": "base"}, "STRATA_WARM_POOL"),
    ({"STRATA_API_KEYS": "good-key-123,REPLACE-ME-api-key-1"}, "STRATA_API_KEYS: a key is still a placeholder"),
    ({"STRATA_API_KEYS": "Team A:key-12345678"}, "'Team A' is not a team name"),
    ({"STRATA_API_KEYS": "ops:short"}, "at least 8 characters"),
    ({"STRATA_TEAM_MAX_SANDBOXES": "ops"}, "STRATA_TEAM_MAX_SANDBOXES: 'ops' is not TEAM=N"),
    ({"STRATA_TEAM_MAX_SANDBOXES": "ops=0"}, "must be at least 1"),
    ({"STRATA_TEAM_MAX_STORED": "ops=lots"}, "STRATA_TEAM_MAX_STORED"),
    ({"STRATA_ADMIN_KEYS": "dev-admin-key-change-me"}, "STRATA_ADMIN_KEYS: a key is still a placeholder"),
    ({"STRATA_SANDBOX_TIMEOUT": "2d"}, "longer than STRATA_MAX_TIMEOUT"), ({"STRATA_STORE": None}, "store is required"),
    ({"STRATA_NETWORK_ENABLED": "yes please"}, "STRATA_NETWORK_ENABLED: 'yes please' is not true or false"),
    ({"STRATA_S3_PATH_STYLE": "1"}, "STRATA_S3_PATH_STYLE: '1' is not true or false"),
])
def test_bad_values_name_their_field(tmp_path: Path, env: dict, message: str) -> None:
    full = {"STRATA_STORE": "/s", "STRATA_CONFIG": str(tmp_path / "absent.toml"), **env}
    full = {k: v for k, v in full.items() if v is not None}
    (tmp_path / "absent.toml").write_text("")
    with pytest.raises(InvalidInput, match=message):
        NodeConfig.load(full)


def test_booleans_are_parsed_once(tmp_path: Path) -> None:
    """A boolean setting is a bool from the file (a TOML boolean or its text) or the
    environment (true/false, any case); env() writes it back as true/false."""
    config = tmp_path / "c.toml"
    config.write_text('store = "/s"\n[network]\nenabled = true\ninternet = "FALSE"\n')
    c = NodeConfig.load({"STRATA_CONFIG": str(config)})
    assert c.network_enabled is True and c.network_internet is False and c.path_style  # s3_path_style unset
    assert c.env()["STRATA_NETWORK_ENABLED"] == "true" and c.env()["STRATA_NETWORK_INTERNET"] == "false"
    c = NodeConfig.load({"STRATA_CONFIG": str(config), "STRATA_NETWORK_ENABLED": "False",
                         "STRATA_S3_PATH_STYLE": "False"})
    assert c.network_enabled is False and c.s3_path_style is False and not c.path_style
    assert NodeConfig.load({"STRATA_CONFIG": str(config)}).store_options()["s3_path_style"] is True


def test_bad_files(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    for text, message in (('api_keys = "secret-secret"', "secret"), ('colour = "blue"', "unknown key 'colour'"),
                          ("[s3]\nbucket = 'x'", "unknown key 's3.bucket'"), ("port = ", "c.toml")):
        config.write_text(text)
        with pytest.raises(InvalidInput, match=message):
            NodeConfig.load({"STRATA_CONFIG": str(config), "STRATA_STORE": "/s"})
    with pytest.raises(InvalidInput, match="does not exist"):
        NodeConfig.load({"STRATA_CONFIG": str(tmp_path / "missing.toml"), "STRATA_STORE": "/s"})


def test_keys_belong_to_teams_and_quotas_are_per_team(tmp_path: Path) -> None:
    (tmp_path / "empty.toml").write_text("")
    c = NodeConfig.load({"STRATA_STORE": "/s", "STRATA_CONFIG": str(tmp_path / "empty.toml"),
                         "STRATA_API_KEYS": "alpha:key-of-alpha-1, bare-key-0001,beta-2:key:with:colons",
                         "STRATA_ADMIN_KEYS": "ops:admin-key-0001",
                         "STRATA_TEAM_MAX_SANDBOXES": "alpha=2,*=5", "STRATA_TEAM_MAX_STORED": "beta-2=1G"})
    assert c.api_keys == (("alpha", "key-of-alpha-1"), ("default", "bare-key-0001"),
                          ("beta-2", "key:with:colons"), ("ops", "admin-key-0001"))
    assert c.admin_keys == (("ops", "admin-key-0001"),)
    assert c.team_limit(c.team_max_sandboxes, "alpha") == 2 and c.team_limit(c.team_max_sandboxes, "zeta") == 5
    assert c.team_limit(c.team_max_stored, "beta-2") == 1 << 30 and c.team_limit(c.team_max_stored, "alpha") is None
    assert c.team_limit(c.team_max_snapshots, "alpha") is None


def test_long_requests_are_limited_per_team_and_node(tmp_path: Path) -> None:
    """Long requests (execs, data-plane streams, watchers; api/limits.py) have
    a node-wide cap and a per-team one; a team not named gets `*`, which has
    a default even when other teams are named (so naming one team never
    lifts the limit of the rest)."""
    (tmp_path / "empty.toml").write_text("")
    base = {"STRATA_STORE": "/s", "STRATA_CONFIG": str(tmp_path / "empty.toml")}
    c = NodeConfig.load(base)
    assert c.max_streams == 1024 and c.team_limit(c.team_max_streams, "anyone") == 256
    c = NodeConfig.load({**base, "STRATA_TEAM_MAX_STREAMS": "alpha=600", "STRATA_MAX_STREAMS": "2000"})
    assert c.team_limit(c.team_max_streams, "alpha") == 600 and c.team_limit(c.team_max_streams, "beta") == 256
    assert c.max_streams == 2000
    c = NodeConfig.load({**base, "STRATA_TEAM_MAX_STREAMS": "alpha=600,*=8"})
    assert c.team_limit(c.team_max_streams, "beta") == 8
    again = NodeConfig.load({**c.env(), "STRATA_CONFIG": str(tmp_path / "empty.toml")})
    assert again.team_max_streams == c.team_max_streams  # env() round-trips
    for bad in ({"STRATA_TEAM_MAX_STREAMS": "alpha=0"}, {"STRATA_MAX_STREAMS": "0"}):
        with pytest.raises(InvalidInput, match="must be at least 1"):
            NodeConfig.load({**base, **bad})
