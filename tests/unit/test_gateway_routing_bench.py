"""bench/bench_gateway_routing.py and bench/bench_fake_engine_fidelity.py: their simulator side and arithmetic
(the live runs are benchmarks, not tests)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_fake_engine_fidelity as fidelity  # noqa: E402
import bench_gateway_routing as routing  # noqa: E402

from llmdiag.gateway.loadgen import LoadRequest  # noqa: E402
from llmdiag.sim.cluster import ClusterSim, EngineSpec, SimConfig  # noqa: E402
from llmdiag.sim.engine_model import PRESETS  # noqa: E402
from llmdiag.sim.faults import Fault, FaultSchedule  # noqa: E402
from llmdiag.sim.metrics import percentile  # noqa: E402
from llmdiag.sim.workload import Trace  # noqa: E402

PRESET = "llama-70b-a100-tp8"


def _schedule(n: int = 160, gap: float = 0.1) -> list[LoadRequest]:
    # Uneven sizes, so that which quarter of the requests an engine gets matters.
    return [LoadRequest(i * gap, 300 + (i * 7919) % 2500, 20 + (i * 104729) % 200) for i in range(n)]


def _args(**kw: object) -> argparse.Namespace:
    base = {"engines": 4, "preset": PRESET, "speed": 0.3, "timeout": 30.0, "slo": 2.0, "seed": 0, "sim_seeds": 3}
    return argparse.Namespace(**{**base, **kw})


def test_run_sim_slows_the_engine_asked_and_reports_its_queue() -> None:
    schedule = _schedule()
    args = _args()
    for slow in (0, 3):
        out = routing.run_sim("round_robin", args, schedule, 2.0, slow=slow)
        peaks = [max(row[1 + i] for row in out["engines_waiting"]) for i in range(4)]
        assert out["slow_engine_waiting_peak"] >= max(peaks)  # the slowed engine has the longest queue
        assert peaks[slow] == max(peaks) > max(p for i, p in enumerate(peaks) if i != slow)
        assert out["fault_at_s"] == 2.0


def test_round_robin_spread_covers_each_position_of_the_slowed_engine() -> None:
    schedule = _schedule()
    spread = routing.sim_spread("round_robin", _args(), schedule, 2.0)
    expected = [routing.run_sim("round_robin", _args(), schedule, 2.0, slow=i)["ttft_p99"] for i in range(4)]
    assert spread["ttft_p99"] == expected
    assert spread["min"] == min(expected) and spread["max"] == max(expected)
    assert len(routing.sim_spread("least_conn", _args(), schedule, 2.0)["ttft_p99"]) == 3  # --sim-seeds


def test_margins_compare_live_and_predicted_ratios() -> None:
    def live(p99: float) -> dict:
        return {"ttft_s": {"p99": p99}}

    def sim(policy: str, p99: float, lo: float, hi: float) -> dict:
        return {"policy": policy, "same": {"ttft_p99": p99}, "spread": {"min": lo, "max": hi}}

    result = {"live": {"gateway": live(2.0), "haproxy_rr": live(10.0), "haproxy_leastconn": live(3.0),
                       "haproxy_agentcheck": live(9.0)},
              "sim": {"gateway": sim("llmdiag", 2.0, 1.6, 2.5), "haproxy_rr": sim("round_robin", 11.0, 5.0, 20.0),
                      "haproxy_leastconn": sim("least_conn", 6.0, 4.0, 8.0)}}
    rows = {m["haproxy"]: m for m in routing.margins(result)}
    assert rows["haproxy_rr"]["live_margin"] == 5.0 and rows["haproxy_rr"]["sim_margin"] == 5.5
    assert rows["haproxy_rr"]["within_20pct"] is True  # 5.0 / 5.5 = 0.91
    # Round robin's range is its same-run value (the slowed engine's quarter is fixed): 11/2.5 .. 11/1.6.
    assert rows["haproxy_rr"]["sim_margin_range"] == [4.4, 6.875] and rows["haproxy_rr"]["inside_sim_range"] is True
    assert rows["haproxy_leastconn"]["within_20pct"] is False  # 1.5 / 3.0 = 0.5
    assert rows["haproxy_leastconn"]["sim_margin_range"] == [1.6, 5.0]  # 4/2.5 .. 8/1.6
    assert rows["haproxy_leastconn"]["inside_sim_range"] is False  # 1.5 < 1.6
    assert rows["haproxy_agentcheck"]["sim_margin"] is None  # nothing in the simulator models agent-check weights
    assert rows["haproxy_agentcheck"]["within_20pct"] is None


def test_fidelity_driver_is_the_simulators_single_engine() -> None:
    """The fidelity bench's virtual-clock driver gives the same TTFTs as ClusterSim with one engine."""
    schedule = _schedule(n=120, gap=0.25)
    faults = FaultSchedule((Fault("slowdown", 5.0, speed=0.4),))
    own = fidelity.simulate(schedule, PRESET, faults, 30.0, [1.0, 2.0])
    trace = Trace("t", tuple(r.at for r in schedule), tuple(r.prompt_tokens for r in schedule),
                  tuple(r.output_tokens for r in schedule))
    ref = ClusterSim([EngineSpec(PRESETS[PRESET], faults=faults)], trace, "round_robin",
                     config=SimConfig(client_timeout_s=30.0)).run()
    # Overloaded on purpose: some clients hang up, and ClusterSim counts them at the timeout (censored).
    assert sum(1 for t in own["ttft"] if t is None) == ref.outcomes.get("timeout", 0) > 0
    ttfts = sorted(30.0 if t is None else t for t in own["ttft"])  # ClusterSim interpolates between ranks
    assert percentile(ttfts, 50) == pytest.approx(ref.ttft_p50, abs=1e-4)
    assert percentile(ttfts, 99) == pytest.approx(ref.ttft_p99, abs=1e-4)
    assert own["steps"] == ref.engine_steps


def test_haproxy_config_sends_a_newline_ended_agent_line_and_names_the_server() -> None:
    import re

    import bench_gateway_common as common

    cfg = common.haproxy_config(9000, ["http://127.0.0.1:8001", "http://127.0.0.1:8002"], "leastconn", agent_port=7000)
    servers = [line for line in cfg.splitlines() if line.strip().startswith("server ")]
    assert len(servers) == 2
    for line, addr in zip(servers, ("127.0.0.1:8001", "127.0.0.1:8002")):
        # Double quotes: HAProxy turns \n into a newline there; in single quotes it would send a
        # backslash and an "n", and the agent would wait for a line that never comes.
        assert re.search(r'agent-send "' + re.escape(addr) + r'\\n"$', line), line
        assert "agent-port 7000" in line and f" {addr} " in line
    assert "balance leastconn" in cfg
    assert "http-response set-header x-llmdiag-backend %si:%sp" in cfg  # bench load records the server
    assert "agent-check" not in common.haproxy_config(9000, ["http://127.0.0.1:8001"])
