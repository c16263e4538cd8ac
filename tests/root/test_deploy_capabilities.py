"""The DaemonSet's capability set is enough: collectors and Kubernetes labels run with exactly it.

The capabilities are read from deploy/kubernetes/base/daemonset.yaml and the agent's collectors run
under ``capsh --drop`` of every other capability (uid 0 keeps only the bounding set on exec, as in
a container with ``drop: [ALL]`` plus ``add``), against an engine-like process that runs as
``nobody``, as engines in pods usually do. Dropping one of them shows what it is for.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


def manifest_capabilities() -> list[str]:
    ds = yaml.safe_load((REPO / "deploy" / "kubernetes" / "base" / "daemonset.yaml").read_text())
    add = ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"]
    return ["cap_" + name.lower() for name in add]


def capsh_drop_all_but(keep: list[str]) -> str:
    out = subprocess.run(["capsh", "--print"], capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("Bounding set ="))
    bounding = line.split("=", 1)[1].strip().split(",")
    return ",".join(cap for cap in bounding if cap not in keep)


def run_with(keep: list[str], argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    command = " ".join(subprocess.list2cmdline([a]) for a in argv)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(["capsh", f"--drop={capsh_drop_all_but(keep)}", "--", "-c", command],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


@pytest.fixture
def engine_as_nobody():
    """An HTTP listener owned by uid 65534 with downward-API-like env: (pid, url)."""
    if shutil.which("capsh") is None or shutil.which("setpriv") is None:
        pytest.fail("capsh and setpriv are needed (libcap2-bin, util-linux; scripts/setup.sh installs them)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PATH": "/usr/bin:/bin", "POD_NAME": "vllm-cap-test-0", "POD_NAMESPACE": "captest", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    proc = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "/usr/bin/python3", "-m", "http.server",
         str(port), "--bind", "127.0.0.1"],
        cwd="/", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the nobody-owned listener did not start")
    try:
        yield proc.pid, f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def collect(keep: list[str], url: str) -> dict:
    proc = run_with(keep, [sys.executable, "-m", "llmdiag.cli", "--backend", url, "collect", "--once",
                           "--collectors", "tcp,timewait,proc", "--json"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout)


def kube_labels(keep: list[str], pid: int) -> dict:
    code = f"import json; from llmdiag.collectors.kube import PodMetadataReader as R; print(json.dumps(R('/proc', 'n1').labels({pid})))"
    proc = run_with(keep, [sys.executable, "-c", code], timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_manifest_capabilities_run_every_collector_and_read_the_engine(engine_as_nobody):
    pid, url = engine_as_nobody
    caps = manifest_capabilities()
    snap = collect(caps, url)
    statuses = {name: c["status"] for name, c in snap["collectors"].items()}
    assert statuses == {"tcp": "ok", "timewait": "ok", "proc": "ok"}, snap["collectors"]
    (signals,) = snap["backends"].values()
    # /proc/PID/io (0400, the engine's uid) and /proc/PID/fd: DAC_READ_SEARCH + SYS_PTRACE
    assert signals["io_rchar_total"] is not None and signals["open_fds"] >= 3
    assert kube_labels(caps, pid) == {"pod": "vllm-cap-test-0", "namespace": "captest", "node": "n1"}


def test_without_dac_read_search_the_engine_process_is_opaque(engine_as_nobody):
    pid, url = engine_as_nobody
    caps = [c for c in manifest_capabilities() if c != "cap_dac_read_search"]
    assert kube_labels(caps, pid) == {}, "environ unreadable: no label may be made up"
    snap = collect(caps, url)
    signals = next(iter(snap["backends"].values()), {})
    assert "io_rchar_total" not in signals


def test_without_perfmon_the_bpf_collector_cannot_load(engine_as_nobody):
    _pid, url = engine_as_nobody
    caps = [c for c in manifest_capabilities() if c != "cap_perfmon"]
    snap = collect(caps, url)
    assert snap["collectors"]["tcp"]["status"] == "unavailable"
    assert snap["collectors"]["timewait"]["status"] == "ok"
