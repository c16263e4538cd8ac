"""Kubernetes labels read from recorded /proc trees (tests/fixtures/proc_k8s/README.md)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from llmdiag.collectors.kube import KUBE_LABELS, PodMetadataReader, parse_cgroup, parse_environ, resolve_in_root
from llmdiag.model import Backend

TREES = Path(__file__).resolve().parents[1] / "fixtures" / "proc_k8s"


def reader(tree: str, node: str | None = "gpu-node-7") -> PodMetadataReader:
    return PodMetadataReader(proc_root=str(TREES / tree), node_name=node)


def test_containerd_cgroup_v2_systemd_driver_with_hostname_only():
    labels = reader("containerd_v2").labels(2300)
    assert labels == {
        "pod": "vllm-llama-8b-6d5f8c9b7-x2k4q",
        # read through the image's absolute /var/run -> /run link, inside the container root
        "namespace": "inference",
        "node": "gpu-node-7",
        "pod_uid": "3f0e7f8c-2b1d-4a6e-9c3a-5d2f1e0b7a91",
        "container_id": "containerd://9b1e4b7f0c2d4e6a8b0c1d2e3f405162738495a6b7c8d9e0f1a2b3c4d5e6f708",
    }


def test_downward_api_env_wins_and_cgroup_namespace_relative_path_parses():
    labels = reader("containerd_v2", node="agent-node-name").labels(2400)
    assert labels == {
        "pod": "sglang-qwen-0",
        "namespace": "llm-serving",
        "container": "sglang",
        "node": "gpu-node-7",  # the process's own NODE_NAME
        "pod_uid": "a71c02d4-5e9b-4f3c-b8d6-1e2f3a4b5c6d",
        "container_id": "containerd://4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b",
    }
    assert set(labels) == set(KUBE_LABELS)


def test_host_network_pod_gets_no_pod_name_from_the_node_hostname():
    labels = reader("containerd_v2").labels(2500)
    assert "pod" not in labels
    assert labels["namespace"] == "tgi"
    assert labels["pod_uid"] == "5d8e9fa0-1b2c-4d3e-8f4a-6b7c8d9e0f1a"  # Guaranteed: kubepods-pod<uid>.slice
    assert labels["container_id"].startswith("containerd://e0f1a2b3")


def test_process_outside_any_pod_gets_no_labels():
    assert reader("containerd_v2").labels(2600) == {}


def test_unreadable_environ_and_missing_root_leave_only_cgroup_labels(caplog):
    r = reader("containerd_v2")
    with caplog.at_level(logging.WARNING, logger="llmdiag.collectors.kube"):
        first = r.labels(2700)
        r._cache.clear()
        second = r.labels(2700)
    assert first == second == {
        "node": "gpu-node-7",
        "pod_uid": "0c1d2e3f-4a5b-4c6d-9e7f-8091a2b3c4d5",
        "container_id": "containerd://7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e",
    }
    warnings = [rec for rec in caplog.records if "environ" in rec.getMessage()]
    assert len(warnings) == 1, "one warning per cause, not one per read"


def test_no_service_account_no_ns_links_means_no_pod_and_no_namespace():
    labels = reader("containerd_v2").labels(2800)
    assert set(labels) == {"node", "pod_uid", "container_id"}


def test_without_agent_node_name_node_is_absent_not_made_up():
    labels = reader("containerd_v2", node=None).labels(2300)
    assert "node" not in labels
    assert labels["pod"] == "vllm-llama-8b-6d5f8c9b7-x2k4q"


@pytest.mark.parametrize(
    ("pid", "pod", "namespace", "uid", "cid"),
    [
        (3100, "vllm-mistral-0", "inference", "74c13223-5a00-11e9-b385-42010a80018d",
         "34dc0b5e626f2c5c4c5170e34b10e7654ce36f0fcd532739f4445baabea03376"),
        (3200, "triton-0", "triton", "9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d",
         "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"),
    ],
)
def test_containerd_cgroup_v1_cgroupfs_driver(pid, pod, namespace, uid, cid):
    labels = reader("containerd_v1").labels(pid)
    # cgroupfs paths do not name the runtime: the bare id, no made-up scheme
    assert labels == {"pod": pod, "namespace": namespace, "node": "gpu-node-7", "pod_uid": uid, "container_id": cid}


def test_crio_cgroup_v2_with_crun_container_subcgroup():
    labels = reader("crio_v2").labels(4100)
    assert labels == {
        "pod": "vllm-granite-7f9c-abcde",
        "namespace": "granite",
        "node": "gpu-node-7",
        "pod_uid": "c4d5e6f7-0819-4a2b-bc3d-4e5f60718293",
        "container_id": "cri-o://f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f00",
    }


def test_crio_conmon_is_in_the_pod_but_not_the_container():
    assert reader("crio_v2").labels(4090) == {"node": "gpu-node-7", "pod_uid": "c4d5e6f7-0819-4a2b-bc3d-4e5f60718293"}


def test_crio_cgroup_v1_systemd_driver():
    labels = reader("crio_v1").labels(5100)
    assert labels == {
        "pod": "tgi-falcon-5c6d7-q8w9e",
        "namespace": "tgi",
        "node": "gpu-node-7",
        "pod_uid": "2b3c4d5e-6f70-4182-93a4-b5c6d7e8f901",
        "container_id": "cri-o://5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b",
    }


def test_vanished_pid_has_no_labels_and_is_not_cached():
    r = reader("containerd_v2")
    assert r.labels(99999) == {}
    assert r._cache == {}


def test_reused_pid_is_read_again(tmp_path):
    tree = tmp_path / "proc"
    shutil.copytree(TREES / "containerd_v2", tree, symlinks=True)
    r = PodMetadataReader(str(tree), node_name="n1")
    assert r.labels(2300)["pod"] == "vllm-llama-8b-6d5f8c9b7-x2k4q"
    # the pod is replaced: same pid, a new process (new start time) with a new HOSTNAME
    environ = (tree / "2300" / "environ").read_bytes().replace(b"x2k4q", b"zz999")
    (tree / "2300" / "environ").write_bytes(environ)
    assert r.labels(2300)["pod"] == "vllm-llama-8b-6d5f8c9b7-x2k4q", "same process: cached"
    stat = (tree / "2300" / "stat").read_text().replace(" 1203344 ", " 1209999 ")
    (tree / "2300" / "stat").write_text(stat)
    assert r.labels(2300)["pod"] == "vllm-llama-8b-6d5f8c9b7-zz999"


def test_label_backends_adds_labels_and_config_labels_win():
    r = reader("containerd_v2")
    backends = [
        Backend("vllm-0", "http://127.0.0.1:8000", pid=2300, labels={"namespace": "from-config"}),
        Backend("remote", "http://10.0.0.9:8000"),  # no local pid: untouched
        Backend("svc", "http://127.0.0.1:8001", pid=2600),  # not in a pod: untouched
    ]
    out = r.label_backends(backends)
    assert out[0].labels["pod"] == "vllm-llama-8b-6d5f8c9b7-x2k4q"
    assert out[0].labels["namespace"] == "from-config"
    assert out[0].to_json()["labels"]["container_id"].startswith("containerd://")
    assert out[1] is backends[1] and out[2] is backends[2]
    assert backends[0].labels == {"namespace": "from-config"}, "the input backend is not mutated"


@pytest.mark.parametrize(
    ("text", "uid", "cid"),
    [
        ("0::/", None, None),
        ("0::/system.slice/containerd.service\n", None, None),
        ("garbage without colons\n\n", None, None),
        # docker under cri-dockerd, systemd driver
        ("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod01234567_89ab_4cde_8f01_23456789abcd.slice/"
         "docker-" + "ab" * 32 + ".scope", "01234567-89ab-4cde-8f01-23456789abcd", "ab" * 32),
        # the pod slice itself (the pause sandbox's parent): uid, no container
        ("0::/kubepods.slice/kubepods-pod01234567_89ab_4cde_8f01_23456789abcd.slice", "01234567-89ab-4cde-8f01-23456789abcd", None),
        # a 64-hex component outside any pod is not a container of a pod
        ("0::/system.slice/" + "cd" * 32, None, None),
    ],
)
def test_parse_cgroup_edge_cases(text, uid, cid):
    identity = parse_cgroup(text)
    assert identity.pod_uid == uid
    assert identity.container_id == cid


def test_parse_environ_skips_entries_without_equals_and_keeps_equals_in_values():
    assert parse_environ(b"A=1\0junk\0B=x=y\0=nokey\0\0") == {"A": "1", "B": "x=y"}


def test_resolve_in_root_stays_inside_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "run" / "secrets").mkdir(parents=True)
    (root / "run" / "secrets" / "ns").write_text("mine")
    (root / "var").mkdir()
    os.symlink("/run", root / "var" / "run")
    os.symlink("../../../../../etc", root / "escape")
    os.symlink("loop", root / "loop")
    assert resolve_in_root(str(root), "/var/run/secrets/ns") == str(root / "run" / "secrets" / "ns")
    assert resolve_in_root(str(root), "/escape/passwd") == str(root / "etc" / "passwd")  # not the host's /etc
    assert resolve_in_root(str(root), "/loop/x") is None
