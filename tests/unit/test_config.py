"""Config: defaults for every key, unknown keys rejected with the key named, CLI overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmdiag.cli.main import main
from llmdiag.config import Config, ConfigError, load_config, to_data, to_toml


def test_empty_file_is_all_defaults(tmp_path: Path) -> None:
    path = tmp_path / "llmdiag.toml"
    path.write_text("")
    assert load_config(path) == Config()
    assert load_config(None) == Config()


def test_round_trip_through_plain_data() -> None:
    config = Config.from_toml(
        '[agent]\ninterval_seconds = 2\n[[backends]]\nurl = "http://127.0.0.1:8000"\nengine = "vllm"\nmodels = ["m"]\n'
    )
    assert config.agent.interval_seconds == 2.0
    assert Config.from_data(to_data(config)) == config
    (backend,) = config.backend_list()
    assert (backend.name, backend.engine, backend.models) == ("127.0.0.1:8000", "vllm", ("m",))


@pytest.mark.parametrize("text, message", [
    ("[agent]\nintervl = 1\n", "unknown config key 'agent.intervl'"),
    ("nonsense = 1\n", "unknown config key 'nonsense'"),
    ('[agent]\ninterval_seconds = "fast"\n', "config key 'agent.interval_seconds' must be a number"),
    ("[agent]\ninterval_seconds = 0\n", "interval_seconds must be a finite number > 0"),
    ("[agent]\ninterval_seconds = inf\n", "interval_seconds must be a finite number > 0"),
    ("[agent]\ndiscover = 1\n", "must be true or false"),
    ('[[backends]]\nurl = "ftp://x:1"\n', "backends[0]"),
    ('[[backends]]\nname = "a"\n', "needs a url"),
    ('[[backends]]\nurl = "grpc://h:8001"\nmetrics_url = "grpc://h:8002/metrics"\n',
     "backends[0]': metrics_url: bad metrics URL 'grpc://h:8002/metrics': scheme must be http or https"),
    ('[[backends]]\nurl = "grpc://h:8001"\nmetrics_url = "h:8002"\n', "metrics_url: bad metrics URL"),
    ('[[backends]]\nurl = "grpc://h:8001"\nmetrics_url = "http://:8002/metrics"\n', "metrics_url: bad metrics URL"),
    ('[[backends]]\nurl = "grpc://h:8001"\nmetrics_url = "http://h:99999/metrics"\n', "metrics_url: bad metrics URL"),
    ('[[backends]]\nurl = "grpc://h:8001"\nmetrics_url = 8002\n', "config key 'backends[0].metrics_url' must be a string"),
    ('[[backends]]\nurl = "http://h:1"\n[[backends]]\nurl = "http://h:1"\n', "duplicate backend names: h:1"),
    ("[agent\n", "not valid TOML"),
])
def test_bad_config_names_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_toml(text, source="test.toml")
    assert message in str(info.value)
    assert str(info.value).startswith("test.toml: ")


def test_a_backend_names_where_its_metrics_live() -> None:
    config = Config.from_toml(
        '[[backends]]\nname = "triton"\nurl = "grpc://10.0.0.7:8001"\nmetrics_url = "http://10.0.0.7:8002/metrics"\n'
        '[[backends]]\nurl = "http://10.0.0.7:8000"\n'
    )
    triton, plain = config.backend_list()
    assert (triton.url, triton.metrics_url) == ("grpc://10.0.0.7:8001", "http://10.0.0.7:8002/metrics")
    assert plain.metrics_url is None
    assert Config.from_data(to_data(config)) == config
    assert Config.from_toml(to_toml(config)) == config


def test_backend_option_overrides_config() -> None:
    config = Config.from_toml('[[backends]]\nurl = "http://h:1"\n').with_backends(
        ["http://127.0.0.1:8000", "grpc://127.0.0.1:8001"])
    assert [b.url for b in config.backend_list()] == ["http://127.0.0.1:8000", "grpc://127.0.0.1:8001"]
    with pytest.raises(ConfigError, match="--backend"):
        Config().with_backends(["127.0.0.1:8000"])


def test_cli_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[agent]\nbogus = 1\n")
    assert main(["--config", str(path), "doctor", "--json"]) == 64
    assert f"{path}: unknown config key 'agent.bogus'" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.toml"), "doctor"]) == 64
    assert "cannot read config file" in capsys.readouterr().err
