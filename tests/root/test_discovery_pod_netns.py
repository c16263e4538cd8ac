"""Discovery finds an engine in a network namespace of its own, as in a Kubernetes pod without hostNetwork.

The set-up is what a CNI plugin does for a pod: a namespace, a veth pair with one end moved into it
and renamed ``eth0``, a /30 on each end and a default route via the node's end. A real ``llmdiag
fake-engine`` runs inside with ``ip netns exec`` (which execs in place, so its pid is the one we
started). Discovery runs here, in the test's own namespace, and must find it at the pod address.
Everything is removed by the fixture's finaliser, also when set-up or the test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pod_support import Pod, fake_engine_argv, network_namespace_pod

from llmdiag.collectors.discovery import discover, local_backend_pids
from llmdiag.collectors.http_fetch import http_get
from llmdiag.collectors.kube import PodMetadataReader
from llmdiag.collectors.netns import read_namespace_addresses
from llmdiag.model import Backend

pytestmark = pytest.mark.root

LLMDIAG = Path(sys.executable).with_name("llmdiag")
PORT = 18123  # the namespace is new and empty: no port in it can be taken
LOOPBACK_PORT = 18124
POD_ENV = {"POD_NAME": "fake-engine-0", "POD_NAMESPACE": "inference", "CONTAINER_NAME": "engine",
           "KUBERNETES_SERVICE_HOST": "10.96.0.1"}


@pytest.fixture
def pod() -> Iterator[Pod]:
    """fake-engine on 0.0.0.0:PORT and another on 127.0.0.1:LOOPBACK_PORT, with downward-API-like env."""
    with network_namespace_pod([(fake_engine_argv("0.0.0.0", PORT), PORT),
                                (fake_engine_argv("127.0.0.1", LOOPBACK_PORT), LOOPBACK_PORT)], POD_ENV) as made:
        yield made


def test_engine_in_its_own_network_namespace_is_found_at_the_pod_address(pod: Pod) -> None:
    result = discover(proc_root="/proc", timeout=2.0, ports=[PORT, LOOPBACK_PORT])
    assert [(b.url, b.engine, b.pid) for b in result.backends] == [(f"http://{pod.address}:{PORT}", "vllm", pod.engine.pid)]
    (backend,) = result.backends
    assert backend.name == f"{pod.address}:{PORT}" and backend.models == ("fake/llama3-8b",)

    # The one bound to 127.0.0.1 in the pod is reported, not probed, not added.
    unreachable = [u for u in result.unreachable if u.netns == pod.netns]
    assert [(u.host, u.port, u.pid) for u in unreachable] == [("127.0.0.1", LOOPBACK_PORT, pod.loopback_engine.pid)]
    assert unreachable[0].likely_engine and "loopback" in unreachable[0].reason

    # The Kubernetes labels come from the engine process, as for a hostNetwork one.
    (labelled,) = PodMetadataReader("/proc", "node-a").label_backends(result.backends)
    assert {k: labelled.labels.get(k) for k in ("pod", "namespace", "container", "node")} == {
        "pod": "fake-engine-0", "namespace": "inference", "container": "engine", "node": "node-a"}

    # And the address is one the node reaches: a scrape, as `llmdiag scrape` does it.
    scrape = subprocess.run([str(LLMDIAG), "scrape", backend.url, "--json", "--interval", "0"],
                            capture_output=True, text=True, timeout=60)
    assert scrape.returncode == 0, scrape.stderr
    assert json.loads(scrape.stdout)["engine"] == "vllm"


def test_namespace_addresses_and_a_configured_pod_ip_backend_get_the_pid(pod: Pod) -> None:
    addresses = read_namespace_addresses("/proc", pod.engine.pid)
    assert addresses.ipv4 == (pod.address,)
    configured = Backend.from_url(f"http://{pod.address}:{PORT}")
    assert local_backend_pids([configured]) == {configured.name: pod.engine.pid}
    # The gateway is the node's side of the veth: not the pod's address, so never the pod's process.
    assert local_backend_pids([Backend.from_url(f"http://{pod.gateway}:{PORT}")]) == {}
    assert http_get(f"http://{pod.address}:{PORT}/metrics", 2.0, 1 << 22).ok


def test_doctor_names_the_pod_engine_and_the_one_it_cannot_reach(pod: Pod) -> None:
    from llmdiag.cli.doctor import _engines  # noqa: PLC0415 - the cli layer, only for this check
    from llmdiag.config import Config  # noqa: PLC0415

    check = _engines(Config())
    assert f"vllm at http://{pod.address}:{PORT} (pid {pod.engine.pid}, pod inference/fake-engine-0)" in check.detail
    # `llmdiag` is a script: its command line starts with the Python interpreter
    assert f"pid {pod.loopback_engine.pid} (python" in check.detail
    assert f" llmdiag fake-engine) in {pod.netns} listens on 127.0.0.1:{LOOPBACK_PORT}" in check.detail
    assert check.status == "degraded" and "0.0.0.0" in check.hint


def test_collect_without_backends_scrapes_the_pod_engine_and_reads_its_process(pod: Pod) -> None:
    """The agent's path: no backend configured, so discovery; then the engine scrape at the pod IP and
    the /proc signals of the pid discovery found."""
    out = subprocess.run([str(LLMDIAG), "collect", "--once", "--json", "--collectors", "engine,proc", "--interval", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    backends = json.loads(out.stdout.splitlines()[-1])["backends"]
    signals = backends[f"{pod.address}:{PORT}"]
    assert signals["up"] == 1 and signals["kv_cache_usage"] is not None
    assert signals["rss_bytes"] > 0 and signals["open_fds"] >= 3  # the proc collector found the process
    assert not any(name.endswith(f":{LOOPBACK_PORT}") for name in backends)


# -- with exactly the DaemonSet's capabilities -------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
VLLM_SCRAPE = REPO.parent / "shared" / "fixtures" / "engines" / "vllm_v1_real_scrape_0.9era.prom"


def _manifest_capabilities() -> list[str]:
    import yaml  # noqa: PLC0415

    ds = yaml.safe_load((REPO / "deploy" / "kubernetes" / "base" / "daemonset.yaml").read_text())
    return ["cap_" + c.lower() for c in ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"]]


def _discover_with(keep: list[str]) -> dict:
    """discover() in a child that keeps only ``keep`` of the bounding set (uid 0, as in the container)."""
    bounding = next(ln for ln in subprocess.run(["capsh", "--print"], capture_output=True, text=True, check=True)
                    .stdout.splitlines() if ln.startswith("Bounding set =")).split("=", 1)[1].strip().split(",")
    code = ("import json; from llmdiag.collectors.discovery import discover; "
            f"r = discover(timeout=2.0, ports=[{PORT}]); "
            "print(json.dumps({'found': [[b.url, b.engine, b.pid] for b in r.backends], "
            "'unreadable': r.unreadable_processes}))")
    drop = ",".join(c for c in bounding if c not in keep)
    proc = subprocess.run(["capsh", f"--drop={drop}", "--", "-c", subprocess.list2cmdline([sys.executable, "-c", code])],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.fixture
def pod_engine_as_nobody() -> Iterator[Pod]:
    """An engine-like server owned by uid 65534 (as engine containers usually run) in a pod namespace:
    Python's http.server serving a recorded vLLM scrape as /metrics from a world-readable folder."""
    if shutil.which("capsh") is None or shutil.which("setpriv") is None:
        pytest.fail("capsh and setpriv are needed (libcap2-bin, util-linux; scripts/setup.sh installs them)")
    import tempfile  # noqa: PLC0415

    site = Path(tempfile.mkdtemp(prefix="llmdiag-netns-", dir="/tmp"))
    try:
        site.chmod(0o755)
        (site / "metrics").write_text(VLLM_SCRAPE.read_text())
        (site / "metrics").chmod(0o644)
        argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                "/usr/bin/python3", "-m", "http.server", str(PORT), "--bind", "0.0.0.0"]
        with network_namespace_pod([(argv, PORT)], {}, cwd=str(site)) as made:
            yield made
    finally:
        shutil.rmtree(site)


def test_the_daemonset_capabilities_find_a_pod_engine_run_by_another_user(pod_engine_as_nobody: Pod) -> None:
    found = _discover_with(_manifest_capabilities())
    assert found["found"] == [[f"http://{pod_engine_as_nobody.address}:{PORT}", "vllm", pod_engine_as_nobody.engine.pid]]


def test_without_sys_ptrace_the_pod_namespace_is_out_of_sight(pod_engine_as_nobody: Pod) -> None:
    # readlink /proc/PID/ns/net is a ptrace-read access check: another user's process needs CAP_SYS_PTRACE.
    found = _discover_with([c for c in _manifest_capabilities() if c != "cap_sys_ptrace"])
    assert found["found"] == [] and found["unreadable"] >= 1
