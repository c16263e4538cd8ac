"""deploy/ against the real thing: a running ``llmdiag agent``, a real Prometheus on the shipped config.

One agent watches one fake engine whose process carries the downward-API environment of a pod
(``POD_NAME``, ``POD_NAMESPACE``, ``CONTAINER_NAME``) while the agent has the DaemonSet's
``NODE_NAME``; the GPU collector replays a recorded 8 x H200 node. Then:

* every metric name the alert and recording rules and the Grafana dashboard use is in the agent's
  ``/metrics`` (``# TYPE`` lines and sample names), except the two listed in ``NOT_HERE`` with why;
* the Kubernetes labels read from /proc reach ``llmdiag_backend_info``;
* a real Prometheus runs the shipped ``prometheus.yml`` and ``llmdiag.rules.yml``. Debian's Prometheus
  has no Kubernetes discovery, so the pod role is stood in for by a ``file_sd_configs`` whose
  targets carry the ``__meta_kubernetes_*`` labels the pod role gives the DaemonSet's ports; the
  relabelling, ``honor_labels`` and the bearer token are the shipped ones. The agent-check port and
  an unannotated pod must be dropped, the agent's series must come out with ``node``/``agent_pod``,
  and every dashboard query must be valid PromQL on that Prometheus.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from deploy_support import RULES, SCRAPE_CONFIG, dashboard_exprs, promql_for_api, used_metric_names
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
NVML_REPLAY = REPO / "tests" / "fixtures" / "nvml" / "h200x8.json"
TOKEN = "deploy-test-token-5c1e"
NODE = "gpu-node-test"
AGENT_POD = "llmdiag-agent-7x2kq"

#: Names only a setting this test cannot make produces; each is still the exporter's rule
#: (``llmdiag_backend_<signal>``) applied to a signal its collector emits.
NOT_HERE = {
    "llmdiag_backend_h2_rst_stream_total": ("h2_rst_stream_total", "llmdiag/collectors/http2.py",
                                            "needs a gRPC backend whose streams are reset"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, deadline_s: float, headers: dict[str, str] | None = None) -> bytes:
    end = time.monotonic() + deadline_s
    last: Exception | None = None
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2) as resp:  # noqa: S310
                return resp.read()
        except OSError as exc:
            last = exc
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer within {deadline_s} s: {last}")


def get_json(url: str, headers: dict[str, str] | None = None) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as resp:  # noqa: S310
        return json.loads(resp.read())


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    work = tmp_path_factory.mktemp("deploy-agent")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    engine_port = free_port()
    # The engine's process has what the kubelet and a downward-API pod spec would give it.
    engine_env = {**env, "POD_NAME": "vllm-kube-0", "POD_NAMESPACE": "inference", "CONTAINER_NAME": "vllm",
                  "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    engine = subprocess.Popen([sys.executable, "-m", "llmdiag.cli", "fake-engine", "--port", str(engine_port)],
                              env=engine_env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [engine]
    try:
        engine_url = f"http://127.0.0.1:{engine_port}"
        wait_http(f"{engine_url}/health", 20)
        (work / "token").write_text(TOKEN + "\n")
        (work / "config.toml").write_text(
            '[agent]\ncollectors = ["engine", "proc", "timewait", "gpu"]\n'
            f'[gpu]\nreplay_file = "{NVML_REPLAY}"\n'
        )
        port = free_port()
        agent_proc = subprocess.Popen(
            [sys.executable, "-m", "llmdiag.cli", "--config", str(work / "config.toml"), "agent", "--backend", engine_url,
             "--listen", f"127.0.0.1:{port}", "--token-file", str(work / "token"), "--interval", "0.5"],
            env={**env, "NODE_NAME": NODE}, cwd=work, stdout=subprocess.DEVNULL, stderr=open(work / "agent.log", "w"),  # noqa: SIM115
        )
        procs.append(agent_proc)
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/healthz", 60)
        # A little traffic, so the engine's TTFT histogram (a distribution signal) has observations.
        for _ in range(4):
            body = json.dumps({"model": "fake/llama3-8b", "prompt_tokens": 200, "max_tokens": 8}).encode()
            req = urllib.request.Request(f"{engine_url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310
                resp.read()
        auth = {"Authorization": f"Bearer {TOKEN}"}
        deadline = time.monotonic() + 30
        while True:
            # Connections to the engine that we close first: TIME_WAIT on our side towards it, so the
            # destination has an entry rate and a port-exhaustion ETA (the agent's own scrapes keep
            # their connection and leave none).
            for _ in range(5):
                with socket.create_connection(("127.0.0.1", engine_port), timeout=2):
                    pass
            text = wait_http(f"{base}/metrics", 10, auth).decode()
            # the replay reports XID 48 on its second tick
            if ('stat="p99"' in text and "llmdiag_gpu_xid_errors_total" in text
                    and "llmdiag_destination_port_exhaustion_eta_seconds{" in text) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        yield {"base": base, "port": port, "work": work, "metrics": text, "auth": auth, "engine_url": engine_url}
    finally:
        for proc in reversed(procs):
            stop(proc)


def exposed_names(text: str) -> set[str]:
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name + ("_total" if family.type == "counter" else ""))
        names.update(sample.name for sample in family.samples)
    # families without samples yet (no open diagnosis) still have their TYPE line
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind == "histogram":
                names.update({f"{name}_bucket", f"{name}_sum", f"{name}_count"})
    return names


def test_every_metric_the_rules_and_dashboard_use_is_on_the_agents_metrics(agent):
    exposed = exposed_names(agent["metrics"])
    used = used_metric_names()
    assert used, "nothing extracted from the rules and dashboard?"
    missing = {name: sorted(where) for name, where in used.items() if name not in exposed and name not in NOT_HERE}
    assert not missing, f"used but not exposed by a running agent: {missing}"
    for name, (signal, module, _why) in NOT_HERE.items():
        assert name in used, f"{name} is no longer used: drop it from NOT_HERE"
        assert f'"{signal}"' in (REPO / module).read_text(), f"{module} no longer emits {signal}"
        assert name == f"llmdiag_backend_{signal}"


def test_kubernetes_labels_from_proc_reach_backend_info(agent):
    (info,) = [s for f in text_string_to_metric_families(agent["metrics"]) if f.name == "llmdiag_backend_info"
               for s in f.samples]
    assert info.labels["pod"] == "vllm-kube-0"
    assert info.labels["namespace"] == "inference"
    assert info.labels["container"] == "vllm"
    assert info.labels["node"] == NODE


@pytest.fixture(scope="module")
def prometheus(agent, tmp_path_factory):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is missing: scripts/setup.sh installs it")
    work = tmp_path_factory.mktemp("deploy-prometheus")
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"]["evaluation_interval"] = "1s"
    (job,) = config["scrape_configs"]
    assert "kubernetes_sd_configs" in job
    del job["kubernetes_sd_configs"]
    job["file_sd_configs"] = [{"files": [str(work / "targets.json")], "refresh_interval": "1s"}]
    job["scrape_interval"], job["scrape_timeout"] = "1s", "1s"
    job["authorization"]["credentials_file"] = str(agent["work"] / "token")
    for group in (rules := yaml.safe_load(RULES.read_text()))["groups"]:
        group["interval"] = "1s"
    (work / RULES.name).write_text(yaml.safe_dump(rules))
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))

    def pod_target(port: int, port_name: str, pod: str, annotated: bool) -> dict:
        # The labels Prometheus's Kubernetes pod role gives each container port of a pod.
        labels = {
            "__meta_kubernetes_namespace": "llmdiag",
            "__meta_kubernetes_pod_name": pod,
            "__meta_kubernetes_pod_node_name": NODE,
            "__meta_kubernetes_pod_ip": "127.0.0.1",
            "__meta_kubernetes_pod_label_app_kubernetes_io_name": "llmdiag-agent",
            "__meta_kubernetes_pod_container_name": "agent",
            "__meta_kubernetes_pod_container_port_name": port_name,
            "__meta_kubernetes_pod_container_port_number": str(port),
            "__meta_kubernetes_pod_container_port_protocol": "TCP",
        }
        if annotated:
            labels |= {"__meta_kubernetes_pod_annotation_prometheus_io_scrape": "true",
                       "__meta_kubernetes_pod_annotation_prometheus_io_port": str(agent["port"]),
                       "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics"}
        return {"targets": [f"127.0.0.1:{port}"], "labels": labels}

    targets = [pod_target(agent["port"], "http-metrics", AGENT_POD, True),
               pod_target(free_port(), "agent-check", AGENT_POD, True),  # must be dropped: not HTTP
               pod_target(free_port(), "http-metrics", "some-other-pod", False)]  # not annotated: dropped
    (work / "targets.json").write_text(json.dumps(targets))
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], cwd=work,
                            stdout=subprocess.DEVNULL, stderr=open(work / "prometheus.log", "w"))  # noqa: SIM115
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/-/ready", 60)
        yield {"base": base, "work": work}
    finally:
        stop(proc)


def query(prom: dict, expr: str) -> dict:
    return get_json(f"{prom['base']}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))


def wait_for(prom: dict, expr: str, deadline_s: float = 30) -> list[dict]:
    end = time.monotonic() + deadline_s
    while True:
        result = query(prom, expr)["data"]["result"]
        if result or time.monotonic() > end:
            return result
        time.sleep(0.5)


def test_the_pod_role_relabelling_keeps_one_target_per_agent(prometheus):
    end = time.monotonic() + 30
    while True:
        targets = get_json(f"{prometheus['base']}/api/v1/targets")["data"]
        active = targets["activeTargets"]
        if active and active[0]["health"] == "up" or time.monotonic() > end:
            break
        time.sleep(0.5)
    assert len(active) == 1, active
    (target,) = active
    assert target["health"] == "up", target.get("lastError")
    assert target["labels"] == {"job": "llmdiag-agent", "instance": NODE, "node": NODE, "agent_pod": AGENT_POD}
    assert len(targets["droppedTargets"]) == 2


def test_engine_labels_are_kept_and_agent_series_get_node_and_agent_pod(prometheus):
    (info,) = wait_for(prometheus, "llmdiag_backend_info")
    labels = info["metric"]
    assert labels["pod"] == "vllm-kube-0" and labels["namespace"] == "inference" and labels["node"] == NODE
    assert labels["agent_pod"] == AGENT_POD
    (score,) = wait_for(prometheus, "llmdiag_backend_score")
    assert score["metric"]["node"] == NODE and "pod" not in score["metric"]
    joined = wait_for(prometheus, "llmdiag_backend_score * on (node, backend) group_left (pod, namespace) llmdiag_backend_info")
    assert joined and joined[0]["metric"]["pod"] == "vllm-kube-0"


def test_recording_rules_produce_fleet_series(prometheus):
    (row,) = wait_for(prometheus, "llmdiag:backend_score:min_by_node", 30)
    assert row["metric"] == {"__name__": "llmdiag:backend_score:min_by_node", "node": NODE}
    assert wait_for(prometheus, "llmdiag:gpu_utilization:avg_by_node", 30), "the replayed GPUs feed the fleet view"


def test_every_dashboard_query_is_valid_promql_on_a_real_prometheus(prometheus):
    for expr in dashboard_exprs():
        if expr.startswith("label_values("):
            inner = expr[len("label_values("):].rsplit(",", 1)[0]
            expr = inner
        result = query(prometheus, promql_for_api(expr))
        assert result["status"] == "success", (expr, result)
