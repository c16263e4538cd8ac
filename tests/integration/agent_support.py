"""Helpers for the agent's integration tests: real processes on 127.0.0.1, bounded waits.

Everything here starts real programs (``llmdiag fake-engine``, ``llmdiag agent``, HAProxy,
Prometheus) on free loopback ports and stops them, with every wait bounded in time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = str(REPO) + (os.pathsep + out["PYTHONPATH"] if out.get("PYTHONPATH") else "")
    out.pop("LLMDIAG_AGENT_TOKEN", None)
    return out


def llmdiag(*args: str, extra_env: dict[str, str] | None = None, stdout: Any = subprocess.PIPE,
            **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "llmdiag.cli", *args], cwd=REPO, env={**env(), **(extra_env or {})},
                            stdout=stdout, stderr=subprocess.STDOUT, text=True, **kwargs)


def _drain(proc: subprocess.Popen[str]) -> None:
    """Read a child's output in the background so that a chatty child never blocks on a full pipe."""
    def run() -> None:
        assert proc.stdout is not None
        with contextlib.suppress(ValueError, OSError):
            for _ in proc.stdout:
                pass

    threading.Thread(target=run, daemon=True).start()


class Fatal(AssertionError):
    """Raised by a check that can never succeed any more (the process died): no retry."""


def wait_for(what: str, check: Callable[[], T | None], timeout: float, interval: float = 0.1) -> T:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except Fatal:
            raise
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            last_error, value = exc, None
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}" + (f" (last error: {last_error})" if last_error else ""))


def stop(proc: subprocess.Popen[str], timeout: float = 10.0) -> tuple[int, str]:
    """SIGTERM, wait, return ``(exit code, output)``; SIGKILL if it does not stop in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=5)
    return proc.returncode, out or ""


def http(url: str, token: str | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def get_json(url: str, token: str | None = None) -> Any:
    status, body = http(url, token)
    assert status == 200, (url, status, body[:300])
    return json.loads(body)


def agent_check(port: int, line: bytes, timeout: float = 5.0) -> str:
    """Send one agent-send line, read the reply until the agent closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(line)
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return data.decode()


@contextlib.contextmanager
def fake_engines(specs: Sequence[Sequence[str]], timeout: float = 15.0) -> Iterator[list[str]]:
    """Start ``llmdiag fake-engine --port 0 <spec...>`` for each spec; yield their URLs; stop them."""
    procs = [llmdiag("fake-engine", "--port", "0", *spec) for spec in specs]
    try:
        urls = []
        for proc in procs:
            assert proc.stdout is not None
            line = wait_for("the fake engine to start", proc.stdout.readline, timeout)
            match = re.search(r"serving on (http://127\.0\.0\.1:\d+)", line)
            assert match, line
            urls.append(match.group(1))
            _drain(proc)
        yield urls
    finally:
        for proc in procs:
            stop(proc)


class AgentProcess:
    """``llmdiag agent ...`` as a user runs it; knows its HTTP and agent-check ports."""

    def __init__(self, args: Sequence[str], tmp: Path, config: str = "", token: str | None = None,
                 agent_check: bool = True, extra_env: dict[str, str] | None = None,
                 prefix: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.check_port = free_port() if agent_check else None
        self.token = token
        argv = ["agent", *args, "--listen", f"127.0.0.1:{self.port}"]
        if self.check_port:
            argv += ["--agent-check", f"127.0.0.1:{self.check_port}"]
        if config:
            path = tmp / f"agent-{self.port}.toml"
            path.write_text(config)
            argv = ["--config", str(path), *argv]
        self.log_path = tmp / f"agent-{self.port}.log"
        self._log = self.log_path.open("w")
        self.proc = llmdiag(*argv, extra_env=extra_env, stdout=self._log) if not prefix else subprocess.Popen(
            [*prefix, sys.executable, "-m", "llmdiag.cli", *argv], cwd=REPO, env={**env(), **(extra_env or {})},
            stdout=self._log, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 60.0, ticks: int = 2) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise Fatal(f"agent exited with {self.proc.returncode}: {self.log()}")
            status, _ = http(f"{self.url}/healthz")
            return status == 200 and self.state()["ticks"] >= ticks

        wait_for("the agent to tick", ready, timeout, 0.2)

    def state(self) -> dict[str, Any]:
        return get_json(f"{self.url}/v1/state", self.token)

    def penalties(self) -> dict[str, Any]:
        return get_json(f"{self.url}/v1/penalties", self.token)

    def metrics(self) -> str:
        status, body = http(f"{self.url}/metrics", self.token)
        assert status == 200, status
        return body.decode()

    def stop(self) -> tuple[int, str, float]:
        """SIGTERM; ``(exit code, log, seconds to exit)``."""
        started = time.monotonic()
        code, _ = stop(self.proc)
        took = time.monotonic() - started
        self._log.close()
        return code, self.log_path.read_text(), took


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text (``None`` when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None
