"""Gateway pieces without sockets: request parsing, header filtering, [gateway] config, load schedules, CLI usage errors."""

from __future__ import annotations

import pytest

from llmdiag.cli.main import EX_USAGE, main
from llmdiag.config import Config, ConfigError
from llmdiag.config.gateway import GatewayConfig, split_listen
from llmdiag.gateway.loadgen import LoadReport, RequestResult, percentile, schedule_from_trace
from llmdiag.gateway.request import BadRequest, estimate_prompt_tokens, forward_headers, parse_request


def test_parse_request_routes_on_model_stream_and_size() -> None:
    r = parse_request(b'{"model": "m", "prompt": "' + b"x" * 400 + b'", "stream": true}')
    assert (r.model, r.stream, r.est_prompt_tokens) == ("m", True, 100)
    r = parse_request(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "abcdefgh"}]}]}')
    assert (r.model, r.stream, r.est_prompt_tokens) == (None, False, 2)
    assert parse_request(b'{"model": "m", "prompt_tokens": 1234, "prompt": "x"}').est_prompt_tokens == 1234
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3  # token ids
    for bad in (b"{", b"[1]", b'{"model": 3}', b"\xff"):
        with pytest.raises(BadRequest):
            parse_request(bad)


def test_forward_headers_drops_hop_by_hop_and_connection_named() -> None:
    headers = [("Host", "gw"), ("Connection", "keep-alive, X-Private"), ("X-Private", "1"), ("Authorization", "Bearer k"),
               ("Content-Length", "10"), ("Transfer-Encoding", "chunked"), ("X-Tag", "a"), ("X-Tag", "b")]
    assert forward_headers(headers) == [("Authorization", "Bearer k"), ("X-Tag", "a"), ("X-Tag", "b")]


def test_gateway_config_section_is_strict_and_validated() -> None:
    cfg = Config.from_toml('[gateway]\nlisten = "0.0.0.0:9000"\nagents = ["http://10.0.0.7:9464"]\nmirror_url = "http://s:1"\n'
                           "mirror_fraction = 0.1\n")
    assert cfg.gateway.listen == "0.0.0.0:9000" and cfg.gateway.agents == ("http://10.0.0.7:9464",)
    with pytest.raises(ConfigError, match="gateway.listn"):
        Config.from_toml('[gateway]\nlistn = ":1"\n')
    for bad in ('listen = "nope"', "mirror_fraction = 0.5", 'agents = ["ftp://x"]', "idle_timeout_seconds = 0"):
        with pytest.raises(ConfigError):
            Config.from_toml(f"[gateway]\n{bad}\n")
    assert split_listen(":8080") == ("127.0.0.1", 8080)
    assert split_listen("[::1]:8080") == ("::1", 8080)
    assert GatewayConfig().listen.startswith("127.0.0.1:")  # loopback unless configured


def test_schedule_offers_the_asked_rate_with_the_trace_shape() -> None:
    arrivals, inputs, outputs = [0.0, 10.0, 11.0, 30.0], [100, 200, 300, 400], [5, 6, 7, 8]
    s = schedule_from_trace(arrivals, inputs, outputs, rate=2.0, duration=5.0, max_prompt_tokens=250)
    assert len(s) == 10
    assert s[0].at == 0.0 and all(a.at < b.at for a, b in zip(s, s[1:])) and s[-1].at < 5.0
    assert [r.prompt_tokens for r in s[:5]] == [100, 200, 250, 250, 100]  # clipped, then tiled
    # The trace's gaps keep their proportions: 10 s then 1 s.
    assert (s[1].at - s[0].at) == pytest.approx(10 * (s[2].at - s[1].at))


def test_report_summary_counts_goodput_and_errors() -> None:
    results = [RequestResult("t", 0.0, "200", ttft=0.1, e2e=1.0, tokens=10, gaps=[0.01] * 9, backend="a"),
               RequestResult("t", 0.5, "200", ttft=3.0, e2e=4.0, tokens=10, gaps=[0.02] * 9, backend="b"),
               RequestResult("t", 1.0, "429", backend="a"), RequestResult("t", 1.5, "timeout")]
    s = LoadReport(["t"], 2.0, 2.0, 2.0, results).summary()
    assert s["completed"] == 2 and s["errors"] == {"429": 1, "timeout": 1}
    assert s["goodput_rps"] == 0.5 and s["goodput_ratio"] == 0.25
    assert s["ttft_s"]["p50"] == 0.1 and s["ttft_s"]["p99"] == 3.0
    assert s["backends"] == {"a": 2, "b": 1}
    assert percentile([], 50) is None and percentile([3, 1, 2], 100) == 3


@pytest.mark.parametrize("argv", [
    ["bench", "load", "--target", "http://x:1", "--trace", "azure2023_conv", "--rate", "0", "--duration", "5"],
    ["bench", "load", "--target", "nope", "--trace", "azure2023_conv", "--rate", "1", "--duration", "5"],
    ["bench", "load", "--target", "http://x:1", "--trace", "/no/such.csv", "--rate", "1", "--duration", "5"],
    ["bench", "load", "--trace", "azure2023_conv", "--rate", "1", "--duration", "5"],
    ["gateway"],
    ["--backend", "http://127.0.0.1:1", "gateway", "--listen", "bad"],
    ["--backend", "http://127.0.0.1:1", "gateway", "--agent", "ftp://x"],
])
def test_usage_errors_exit_64(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(argv))
    assert exc.value.code == EX_USAGE
    assert "Traceback" not in capsys.readouterr().err
