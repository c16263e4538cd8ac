"""The ``[engine]`` config section: defaults, TOML overrides, and errors that name the key."""

from __future__ import annotations

import pytest

from llmdiag.config import Config, ConfigError


def test_defaults():
    engine = Config().engine
    assert (engine.timeout_seconds, engine.ewma_alpha, engine.max_workers, engine.metrics_path) == (1.0, 0.2, 8, "/metrics")


def test_toml_overrides():
    engine = Config.from_toml("[engine]\ntimeout_seconds = 0.5\newma_alpha = 0.5\nmax_response_bytes = 65536\n").engine
    assert (engine.timeout_seconds, engine.ewma_alpha, engine.max_response_bytes) == (0.5, 0.5, 65536)


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ("[engine]\newma_alpha = 0\n", "ewma_alpha"),
        ("[engine]\ntimeout_seconds = -1\n", "timeout_seconds"),
        ("[engine]\nmetrics_path = 'metrics'\n", "metrics_path"),
        ("[engine]\ntimeout = 1\n", "engine.timeout"),
    ],
)
def test_bad_values_name_the_key(toml, needle):
    with pytest.raises(ConfigError, match=needle):
        Config.from_toml(toml)
