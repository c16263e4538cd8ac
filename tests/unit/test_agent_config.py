"""``[agent]`` keys and the bearer token's sources."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmdiag.cli.agent import TOKEN_ENV, resolve_token
from llmdiag.config import Config, ConfigError
from llmdiag.config.agent import split_address


def test_defaults_are_loopback_and_off() -> None:
    agent = Config().agent
    assert (agent.listen_host, agent.listen_port, agent.agent_check_listen) == ("127.0.0.1", 9464, "")
    assert agent.stale_after_seconds == 5.0
    assert Config.from_toml("[agent]\ninterval_seconds = 2.0\n").agent.stale_after_seconds == 10.0
    assert Config.from_toml("[agent]\nhealthz_stale_seconds = 3.0\n").agent.stale_after_seconds == 3.0


@pytest.mark.parametrize(("text", "key"), [
    ('agent_check_listen = "9465"', "agent_check_listen"),
    ('agent_check_listen = ":9465"', "agent_check_listen"),
    ("agent_check_max_connections = 0", "agent_check_max_connections"),
    ("agent_check_max_line_bytes = 4", "agent_check_max_line_bytes"),
    ("agent_check_timeout_seconds = 0", "agent_check_timeout_seconds"),
    ("penalties_ttl_seconds = -1", "penalties_ttl_seconds"),
    ("healthz_stale_seconds = -1", "healthz_stale_seconds"),
    ("discover_interval_seconds = inf", "discover_interval_seconds"),
    ("agent_check_lisen = \"127.0.0.1:1\"", "agent_check_lisen"),
])
def test_bad_values_name_the_key(text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        Config.from_toml(f"[agent]\n{text}\n")


def test_split_address() -> None:
    assert split_address("127.0.0.1:9465") == ("127.0.0.1", 9465)
    assert split_address("[::1]:9464") == ("::1", 9464)
    assert split_address("0.0.0.0:0") == ("0.0.0.0", 0)  # a wildcard only when written out
    for bad in ("9465", ":9465", "host:", "host:99999", "host:http"):
        with pytest.raises(ValueError, match="host:port"):
            split_address(bad)


def test_token_sources_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert resolve_token(Config(), None) is None
    in_config = Config.from_toml('[agent]\nbearer_token = "from-config"\n')
    assert resolve_token(in_config, None) == "from-config"
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert resolve_token(in_config, None) == "from-env"
    (tmp_path / "t").write_text("  from-file\n")
    with_file = Config.from_toml(f'[agent]\ntoken_file = "{tmp_path / "t"}"\n')
    assert resolve_token(with_file, None) == "from-file"
    (tmp_path / "cli").write_text("from-cli")
    assert resolve_token(with_file, str(tmp_path / "cli")) == "from-cli"
    for content, why in (("", "one token"), ("two words", "one token")):
        (tmp_path / "bad").write_text(content)
        with pytest.raises(ValueError, match=why):
            resolve_token(Config(), str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="cannot read"):
        resolve_token(Config(), str(tmp_path / "missing"))
