"""Discovery across network namespaces, on a tree recorded from real namespaces (tests/fixtures/proc_netns)."""

from __future__ import annotations

import logging
import os
import shutil
import socket
from pathlib import Path

import pytest
from engine_http import FIXTURES, SHARED_ENGINES

from llmdiag.collectors import discovery
from llmdiag.collectors.discovery import ListeningSocket, _reach, discover, discover_engines, local_backend_pids
from llmdiag.collectors.http_fetch import FetchResult
from llmdiag.collectors.kube import PodMetadataReader
from llmdiag.collectors.netns import (
    NamespaceAddresses,
    parse_fib_trie_local,
    parse_if_inet6,
    parse_ipv6_default_ifaces,
    parse_route,
    rank_ipv4,
    read_namespace_addresses,
    scan_namespaces,
)
from llmdiag.model import Backend

TREE = Path(__file__).resolve().parents[1] / "fixtures" / "proc_netns" / "tree"
HOST_NS, POD_A, POD_B, POD_C = "net:[4026531833]", "net:[4026532178]", "net:[4026532249]", "net:[4026532318]"
VLLM = (SHARED_ENGINES / "vllm_v1_real_scrape_0.9era.prom").read_text()
SGLANG = (FIXTURES / "sglang_documented_text0.0.4.prom").read_text()


class RecordedHosts:
    """A fetch that answers as the engines of the recorded tree would, and remembers every URL asked."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def __call__(self, url: str, timeout: float, max_bytes: int, accept: str) -> FetchResult:
        self.asked.append(url)
        body = self.answers.get(url)
        if body is None:
            return FetchResult(url, error="connection refused", failure="connection_refused")
        return FetchResult(url, status=200, body=body)


ANSWERS = {
    "http://127.0.0.1:9000/metrics": VLLM,  # the hostNetwork engine, in the node's namespace
    "http://10.203.0.2:8000/metrics": VLLM,  # pod A: 0.0.0.0:8000
    "http://10.203.1.7:8000/metrics": SGLANG,  # pod B: [::]:8000, reached over IPv4
}


# -- the namespace's addresses ---------------------------------------------------


def test_fib_trie_gives_the_local_addresses_without_loopback_or_broadcast():
    assert parse_fib_trie_local((TREE / "7100/net/fib_trie").read_text()) == ["10.203.0.2"]
    # Calico-style /32 and a Multus secondary /24, both printed under Main: and Local:
    assert parse_fib_trie_local((TREE / "7200/net/fib_trie").read_text()) == ["10.203.1.7", "192.168.203.5"]


def test_garbled_fib_trie_and_route_give_what_can_be_read():
    text = "Main:\n  |-- 10.1.2.3\n     /32 host LOCAL\n  |-- not.an.ip\n     /32 host LOCAL\n" \
           "     /32 host LOCAL\n  |-- 10.1.2.4\n     /24 link UNICAST\n"
    assert parse_fib_trie_local(text) == ["10.1.2.3"]  # a prefix line after a bad leaf is not its own leaf
    assert parse_fib_trie_local("") == []
    assert parse_route("Iface\tDestination\nGARBAGE\neth0\tZZ\t0\t0003\t0\t0\t0\t00000000\n") == []
    assert parse_if_inet6("short line\n" + "g" * 32 + " 02 40 00 80 eth0\n") == []
    assert parse_ipv6_default_ifaces("x " * 12) == []


def test_addresses_are_ranked_by_the_default_route_interface():
    routes = parse_route((TREE / "7200/net/route").read_text())
    assert [(r.iface, r.is_default) for r in routes] == [("eth0", True), ("eth0", False), ("net1", False)]
    # Calico: the pod IP is in no subnet route; the secondary network's address is in net1's /24.
    assert rank_ipv4(["192.168.203.5", "10.203.1.7"], routes) == ["10.203.1.7", "192.168.203.5"]
    # flannel + Multus: eth0 has a subnet route and the default route; it wins over net1's address
    flannel = parse_route("Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n"
                          "net1\t00CBA8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"
                          "eth0\t0000F40A\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"
                          "eth0\t00000000\t0100F40A\t0003\t0\t0\t0\t00000000\n")
    assert rank_ipv4(["169.254.3.3", "192.168.203.5", "10.244.0.17"], flannel) == ["10.244.0.17", "192.168.203.5", "169.254.3.3"]


def test_recorded_namespace_addresses_ipv4_and_ipv6():
    assert read_namespace_addresses(TREE, 7100) == NamespaceAddresses(("10.203.0.2",), ("fdcb:203::2",))
    assert read_namespace_addresses(TREE, 7200) == NamespaceAddresses(("10.203.1.7", "192.168.203.5"), ())
    assert read_namespace_addresses(TREE, 4242) == NamespaceAddresses()  # no such process: no address, no error


def test_processes_are_grouped_by_namespace():
    scan = scan_namespaces(TREE)
    assert scan.own == HOST_NS
    assert scan.groups == {HOST_NS: [1, 6100], POD_A: [7099, 7100, 7101], POD_B: [7200], POD_C: [7300]}
    assert scan.unreadable == 0


def test_namespace_links_we_may_not_read_are_counted(monkeypatch):
    real = os.readlink

    def readlink(path, *args, **kwargs):
        if str(path).endswith("7200/ns/net"):
            raise PermissionError(13, "Permission denied")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "readlink", readlink)
    scan = scan_namespaces(TREE)
    assert POD_B not in scan.groups and scan.unreadable == 1


# -- where a listener in another namespace is reached ------------------------------


@pytest.mark.parametrize(("host", "family", "hosts", "why"), [
    ("0.0.0.0", socket.AF_INET, ("10.0.0.5",), ""),
    ("::", socket.AF_INET6, ("10.0.0.5", "fd00:5::5"), ""),  # IPv4 first: a "::" socket takes IPv4 too
    ("::ffff:0.0.0.0", socket.AF_INET6, ("10.0.0.5", "fd00:5::5"), ""),
    ("10.0.0.5", socket.AF_INET, ("10.0.0.5",), ""),
    ("127.0.0.1", socket.AF_INET, (), "loopback"),
    ("127.0.0.53", socket.AF_INET, (), "loopback"),
    ("::1", socket.AF_INET6, (), "loopback"),
    ("::ffff:127.0.0.1", socket.AF_INET6, (), "loopback"),
    ("fe80::1", socket.AF_INET6, (), "link-local"),
])
def test_reach(host, family, hosts, why):
    found, reason = _reach(ListeningSocket(host, 8000, 1, family), NamespaceAddresses(("10.0.0.5",), ("fd00:5::5",)))
    assert found == hosts and why in reason and bool(reason) == bool(why)


def test_a_wildcard_listener_in_a_namespace_without_addresses_is_reported():
    found, reason = _reach(ListeningSocket("0.0.0.0", 8000, 1, socket.AF_INET), NamespaceAddresses((), ("fd00::1",)))
    assert found == () and "no address" in reason


# -- discovery on the recorded tree ------------------------------------------------


def test_discover_probes_each_namespace_at_its_address():
    fetch = RecordedHosts(ANSWERS)
    said: list[str] = []
    result = discover(proc_root=TREE, fetch=fetch, progress=said.append)
    assert f"10.203.0.2:8000 ({POD_A}): vllm" in said and "port 9000: vllm" in said
    assert [(b.url, b.engine, b.pid) for b in result.backends] == [
        ("http://10.203.0.2:8000", "vllm", 7100),
        ("http://10.203.1.7:8000", "sglang", 7200),
        ("http://127.0.0.1:9000", "vllm", 6100),
    ]
    probed = {u for u in fetch.asked if u.endswith("/metrics")}
    assert probed == set(ANSWERS) | {
        # pod A's [::]:8002: the IPv4 address first, then the IPv6 one
        "http://10.203.0.2:8002/metrics", "http://[fdcb:203::2]:8002/metrics",
    }  # never ssh (22), never a loopback listener inside a pod
    assert fetch.asked.index("http://10.203.0.2:8002/metrics") < fetch.asked.index("http://[fdcb:203::2]:8002/metrics")
    assert result.namespaces == 3 and result.unreadable_processes == 0
    assert [(u.netns, u.host, u.port, u.pid, u.likely_engine) for u in result.unreachable] == [
        (POD_A, "127.0.0.1", 15000, 7101, False),  # the mesh sidecar's admin port
        (POD_C, "127.0.0.1", 8000, 7300, True),
    ]
    assert result.unreachable[1].describe() == (
        f"pid 7300 (python3 -m vllm.entrypoints.openai.api_server) in {POD_C} listens on 127.0.0.1:8000: "
        "bound to loopback, which only its own network namespace reaches")


def test_ports_filter_applies_to_every_namespace():
    fetch = RecordedHosts(ANSWERS)
    result = discover(proc_root=TREE, fetch=fetch, ports=[9000])
    assert [b.url for b in result.backends] == ["http://127.0.0.1:9000"]
    assert result.unreachable == []


def test_discovered_pod_backends_get_their_kubernetes_labels():
    result = discover(proc_root=TREE, fetch=RecordedHosts(ANSWERS))
    labelled = {b.name: b.labels for b in PodMetadataReader(str(TREE), "agent-node").label_backends(result.backends)}
    assert labelled["10.203.0.2:8000"] == {
        "pod": "vllm-qwen-7b-5c9d7f6b8-q8r2t", "namespace": "inference", "node": "gpu-node-3",
        "pod_uid": "0c1d2e3f-4a5b-4c6d-8e7f-8091a2b3c4d5",
        "container_id": "containerd://2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f80910",
    }
    assert labelled["10.203.1.7:8000"] == {"pod": "sglang-llama-0", "namespace": "llm", "container": "sglang",
                                           "node": "agent-node"}
    assert labelled["127.0.0.1:9000"] == {}  # a plain process on the node


def test_unreachable_engines_are_warned_about_once(caplog, monkeypatch):
    monkeypatch.setattr(discovery, "_warned", set())
    with caplog.at_level(logging.DEBUG, logger="llmdiag.collectors.discovery"):
        discover_engines(proc_root=TREE, fetch=RecordedHosts(ANSWERS))
        discover_engines(proc_root=TREE, fetch=RecordedHosts(ANSWERS))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(warnings) == 1 and "pid 7300" in warnings[0] and "127.0.0.1:8000" in warnings[0]
    assert len(debug) == 1 and "pid 7101 (envoy -c envoy.yaml)" in debug[0]


def test_own_namespace_seen_through_a_tree_without_self_is_not_probed_twice(tmp_path):
    tree = tmp_path / "proc"
    shutil.copytree(TREE, tree, symlinks=True)
    (tree / "self").unlink()
    shutil.copytree(TREE / "net", tree / "1" / "net")  # pid 1 now shows the node's tables
    (tree / "1" / "net" / "fib_trie").write_text("Main:\n  |-- 192.0.2.2\n     /32 host LOCAL\n")
    fetch = RecordedHosts(ANSWERS)
    result = discover(proc_root=tree, fetch=fetch)
    assert "http://192.0.2.2:9000/metrics" not in fetch.asked
    assert [b.url for b in result.backends] == ["http://10.203.0.2:8000", "http://10.203.1.7:8000", "http://127.0.0.1:9000"]
    assert result.namespaces == 3


def test_configured_pod_ip_backends_get_the_pid_of_their_listener():
    backends = [Backend.from_url(u) for u in (
        "http://10.203.1.7:8000",  # pod B's [::]:8000
        "http://192.168.203.5:8000",  # pod B's other address: the wildcard listens there too
        "http://[fdcb:203::2]:8002",  # pod A's [::]:8002 over IPv6
        "http://10.203.2.9:8000",  # pod C's address, but its engine listens on 127.0.0.1 only
        "http://10.9.9.9:8000",  # no local namespace has that address
        "http://127.0.0.1:9000",  # the node's own
    )]
    assert local_backend_pids(backends, TREE) == {
        "10.203.1.7:8000": 7200, "192.168.203.5:8000": 7200, "[fdcb:203::2]:8002": 7100, "127.0.0.1:9000": 6100,
    }


# -- each namespace's tables are read once, and again only when its sockets change ----------------


@pytest.fixture
def tables(monkeypatch):
    cache = discovery._TableCache()
    monkeypatch.setattr(discovery, "_TABLES", cache)
    return cache


def test_tables_are_read_once_per_namespace_and_not_again_while_the_held_sockets_stay(tables, tmp_path):
    tree = tmp_path / "proc"
    shutil.copytree(TREE, tree, symlinks=True)
    first = discover(proc_root=tree, fetch=RecordedHosts(ANSWERS))
    assert tables.reads == 3  # pods A (7099, 7100 and 7101 together), B and C
    again = discover(proc_root=tree, fetch=RecordedHosts(ANSWERS))
    assert tables.reads == 3 and [b.url for b in again.backends] == [b.url for b in first.backends]
    assert [u.port for u in again.unreachable] == [15000, 8000]
    # pod B's engine opens another socket (a new listener, or just a connection): its table is read again
    os.symlink("socket:[999999]", tree / "7200" / "fd" / "9")
    discover(proc_root=tree, fetch=RecordedHosts(ANSWERS))
    assert tables.reads == 4


def test_a_namespace_whose_processes_hold_no_socket_is_not_read(tables, tmp_path):
    tree = tmp_path / "proc"
    shutil.copytree(TREE, tree, symlinks=True)
    shutil.rmtree(tree / "7300" / "fd")
    (tree / "7300" / "fd").mkdir()  # pod C's only process holds no socket now: nothing can listen there
    result = discover(proc_root=tree, fetch=RecordedHosts(ANSWERS))
    assert tables.reads == 2 and [u.pid for u in result.unreachable] == [7101]


def test_when_fds_cannot_be_listed_the_table_is_read_every_time(tables, monkeypatch):
    real = os.scandir

    def scandir(path):
        if str(path).endswith("7200/fd"):
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    discover(proc_root=TREE, fetch=RecordedHosts(ANSWERS))
    discover(proc_root=TREE, fetch=RecordedHosts(ANSWERS))
    assert tables.reads == 3 + 1  # A and C once; B, whose sockets cannot be listed, twice
