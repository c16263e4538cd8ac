"""A pod-like network namespace for root tests: what a CNI plugin does for a pod.

A namespace, a veth pair with one end moved into it and renamed ``eth0``, a /30 on each end and
a default route via the node's end. Processes run inside with ``ip netns exec`` (which execs in
place, so their pids are the ones started). Everything is removed on the way out."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

LLMDIAG = Path(sys.executable).with_name("llmdiag")


@dataclass
class Pod:
    netns: str  # "net:[INODE]"
    address: str  # inside, on eth0
    gateway: str  # the node's end of the veth
    procs: list[subprocess.Popen[bytes]]

    @property
    def engine(self) -> subprocess.Popen[bytes]:
        return self.procs[0]

    @property
    def loopback_engine(self) -> subprocess.Popen[bytes]:
        return self.procs[1]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 in 10.203.0.0/16 that no route or address of this host touches (pid-dependent, so two
    runs at once pick different ones)."""
    taken = [ipaddress.ip_network(word, strict=False) for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines()
             for word in line.split()[:1] if word[0].isdigit()]
    taken += [ipaddress.ip_interface(word).network for line in _ip("-4", "-o", "addr").stdout.splitlines()
              for word in line.split() if "/" in word and word[0].isdigit()]
    for n in range(256):
        subnet = ipaddress.ip_network(f"10.203.{(os.getpid() + n) % 256}.0/30")
        if not any(subnet.overlaps(t) for t in taken if t.prefixlen > 0):
            return subnet
    pytest.fail("no free /30 in 10.203.0.0/16 on this host")


def _cannot(reason: str) -> None:
    if os.environ.get("LLMDIAG_REQUIRE_BPF") == "1":
        pytest.fail(f"LLMDIAG_REQUIRE_BPF=1 but this root test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def fake_engine_argv(host: str, port: int, *more: str) -> list[str]:
    return [str(LLMDIAG), "fake-engine", "--host", host, "--port", str(port), *more]


def _wait_listening(proc: subprocess.Popen[bytes], port: int) -> None:
    """Until the engine's socket is in its namespace's table (a readiness wait, not an assertion)."""
    # IPv4, or IPv6 (gRPC's dual-stack listener on "*")
    needles = {"tcp": f":{port:04X} 00000000:0000 0A", "tcp6": f":{port:04X} {'0' * 32}:0000 0A"}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"fake-engine exited {proc.returncode}: {proc.stderr.read().decode() if proc.stderr else ''}")
        for table, needle in needles.items():
            try:
                if needle in Path(f"/proc/{proc.pid}/net/{table}").read_text():
                    return
            except OSError:
                pass
        time.sleep(0.1)
    pytest.fail(f"fake-engine in its namespace never listened on port {port}")


@contextlib.contextmanager
def network_namespace_pod(engines: list[tuple[list[str], int]], env: dict[str, str], cwd: str | None = None,
                          tag: str = "") -> Iterator[Pod]:
    """A pod-like network namespace running each ``(argv, port)`` of ``engines`` until its port listens.

    Everything is removed on the way out, also when set-up fails half-way. ``tag`` (one character)
    tells apart two pods made at once by one test."""
    if shutil.which("ip") is None:
        _cannot("no `ip` command (iproute2) to create a network namespace")
    tag = f"{os.getpid() % 100000}{tag}"
    netns, host_end, pod_end = f"llmdiag-test-{tag}", f"ldh{tag}", f"ldp{tag}"
    made = _ip("netns", "add", netns, check=False)
    if made.returncode != 0:
        _cannot(f"`ip netns add` failed: {made.stderr.strip()}")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        subnet = _free_subnet()
        gateway, address = (str(h) for h in subnet.hosts())
        _ip("link", "add", host_end, "type", "veth", "peer", "name", pod_end, "netns", netns)
        _ip("-n", netns, "link", "set", pod_end, "name", "eth0")
        _ip("-n", netns, "addr", "add", f"{address}/30", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("-n", netns, "route", "add", "default", "via", gateway)
        _ip("addr", "add", f"{gateway}/30", "dev", host_end)
        _ip("link", "set", host_end, "up")
        for argv, _port in engines:
            procs.append(subprocess.Popen(["ip", "netns", "exec", netns, *argv], env={**os.environ, **env}, cwd=cwd,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        for proc, (_argv, port) in zip(procs, engines, strict=True):
            _wait_listening(proc, port)
        yield Pod(f"net:[{os.stat(f'/run/netns/{netns}').st_ino}]", address, gateway, procs)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        # Deleting the host end removes its peer at once; `ip netns del` alone frees the pair later.
        _ip("link", "del", host_end, check=False)
        _ip("netns", "del", netns, check=False)
    assert netns not in _ip("netns", "list").stdout, "the test namespace was left behind"
    assert _ip("link", "show", host_end, check=False).returncode != 0, "the test veth was left behind"
