"""``llmdiag collect`` without --json: a per-backend view where every value has its unit."""

from __future__ import annotations

import pytest
from rich.console import Console

from llmdiag.cli.main import main
from llmdiag.cli.snapshot_view import format_value, render_snapshot
from llmdiag.model import CollectorState, CollectorStatus, Distribution, Labelled, Snapshot


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("kv_cache_usage", 0.8295, "83 %"),
    ("psi_io_full_avg10", 0.0013, "0.13 %"),
    ("rss_bytes", 3 * 1024**3, "3 GiB"),
    ("tcp_send_bytes_total", 25_400, "24.8 KiB"),
    ("io_rchar_total", 9_858_313, "9.4 MiB"),
    ("srtt_seconds", 3.1e-05, "31 µs"),
    ("scrape_duration_seconds", 0.00642, "6.42 ms"),
    ("port_exhaustion_eta_seconds", 29171.4, "8.1 h"),
    ("timewait_entry_rate", 0.9677, "0.968/s"),
    ("kv_capacity_tokens", 450000, "450,000"),
    ("requests_waiting", 87.0, "87"),
    ("gpu_temperature_celsius", 71.6, "72 °C"),
    ("gpu_power_watts", 412.5, "412 W"),
    ("ttft_seconds", None, "n/a"),
    ("ttft_seconds", Distribution(p50=0.12, p99=1.5, ewma=0.2, count=88), "p50 120 ms  p99 1.5 s (n=88)"),
    ("ttft_seconds", Distribution(count=0), "no samples"),
    ("responses_total", Labelled({"class=2xx": 10.0, "class=5xx": 2.0}), "2xx 10, 5xx 2"),
])
def test_values_carry_their_units(name: str, value: object, shown: str) -> None:
    assert format_value(name, value) == shown


def _snapshot() -> Snapshot:
    snap = Snapshot(ts=1733140000.0, hostname="gpu-node-7")
    snap.host.update({"psi_cpu_some_avg10": 0.099, "timewait_sockets": 303})
    snap.destinations["10.0.0.7:8000"] = {"timewait_sockets": 12}
    snap.backends["vllm-0"] = {"kv_cache_usage": 0.42, "requests_waiting": 3, "rss_bytes": 1.5 * 1024**3,
                               "ttft_seconds": Distribution(0.12, 0.3, 0.15, 40), "tcp_retransmits_total": 0,
                               "mystery_signal": 7}
    snap.gpus["0"] = {"gpu_utilization": 0.93}
    snap.collectors = {"engine": CollectorStatus(CollectorState.OK),
                       "http2": CollectorStatus(CollectorState.UNAVAILABLE, "pass a [[backends]] grpc url")}
    return snap


def test_the_view_groups_each_backend_by_source_at_80_columns() -> None:
    console = Console(width=80, record=True, force_terminal=False)
    console.print(render_snapshot(_snapshot()))
    text = console.export_text()
    lines = [line.rstrip() for line in text.splitlines()]
    assert max(map(len, lines)) <= 80
    assert "engine ok · http2 unavailable" in text
    assert "http2: pass a [[backends]] grpc url" in text  # brackets printed, not eaten as markup
    assert "(1 destinations: see --json)" in text
    backend = lines.index("vllm-0")
    block = "\n".join(lines[backend:])
    assert "engine   kv_cache_usage 42 % · requests_waiting 3" in block
    assert "latency  ttft_seconds p50 120 ms  p99 300 ms (n=40)" in block
    assert "process  rss_bytes 1.5 GiB" in block and "other    mystery_signal 7" in block
    assert "gpu 0" in text and "gpu_utilization 93 %" in text


def test_collect_without_json_prints_the_view(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from test_cli import PROC_FIXTURE

    config = tmp_path / "proc.toml"
    config.write_text(f'[proc]\nproc_root = "{PROC_FIXTURE}"\n')
    assert main(["collect", "--config", str(config), "--once", "--interval", "0.05", "--collectors", "proc"]) == 0
    out = capsys.readouterr().out
    assert "proc ok" in out and "pressure psi_cpu_some_avg10 1.54 %" in out
