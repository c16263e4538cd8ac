"""deploy/kubernetes: every manifest, and every overlay as rendered, validates against the Kubernetes schemas.

The base is plain resources listed in a kustomization with no transformers, so each file is exactly
what the API server receives and is validated as it stands. The overlays are JSON 6902 patches on
the base DaemonSet; they are applied here by :func:`apply_json_patch` (RFC 6902: add, remove,
replace, test) and validated too. Where ``kubectl`` is installed, ``kubectl kustomize`` renders
each directory as well and the result must equal ours object for object.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from llmdiag.config import load_config

KUBE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
BASE = KUBE / "base"
OVERLAYS = ["nvidia", "generic-headers", "privileged"]
#: Schemas to validate against: the oldest Kubernetes docs/deploy.md promises, and the newest known.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def render_base() -> list[dict[str, Any]]:
    docs = []
    for name in kustomization(BASE)["resources"]:
        docs.extend(load_all(BASE / name))
    return docs


def _pointer(path: str) -> list[str]:
    assert path.startswith("/"), path
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def apply_json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 add/remove/replace/test on a copy of ``doc`` (what kustomize's patches do)."""
    out = copy.deepcopy(doc)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        kind = op["op"]
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if kind == "add":
                node.insert(index, copy.deepcopy(op["value"]))
            elif kind == "remove":
                del node[index]
            elif kind == "replace":
                node[index] = copy.deepcopy(op["value"])
            elif kind == "test":
                assert node[index] == op["value"], f"test failed at {op['path']}: {node[index]!r} != {op['value']!r}"
            else:
                raise AssertionError(f"unsupported op {kind}")
        else:
            if kind == "add":
                node[last] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del node[last]
            elif kind == "replace":
                assert last in node, f"replace of missing {op['path']}"
                node[last] = copy.deepcopy(op["value"])
            elif kind == "test":
                assert node.get(last) == op["value"], f"test failed at {op['path']}: {node.get(last)!r} != {op['value']!r}"
            else:
                raise AssertionError(f"unsupported op {kind}")
    return out


def render_overlay(name: str) -> list[dict[str, Any]]:
    spec = kustomization(KUBE / name)
    assert spec["resources"] == ["../base"]
    assert set(spec) == {"apiVersion", "kind", "resources", "patches"}, "only JSON 6902 patches are rendered here"
    docs = render_base()
    for patch in spec["patches"]:
        target = patch["target"]
        ops = yaml.safe_load((KUBE / name / patch["path"]).read_text())
        hits = 0
        for i, doc in enumerate(docs):
            if doc["kind"] == target["kind"] and doc["metadata"]["name"] == target["name"]:
                docs[i] = apply_json_patch(doc, ops)
                hits += 1
        assert hits == 1, f"{name}: patch target {target} matched {hits} objects"
    return docs


def daemonset(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return ds


def validate(doc: dict[str, Any]) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


# -- the base --------------------------------------------------------------------------------


def test_base_kustomization_lists_every_manifest_and_transforms_nothing():
    spec = kustomization(BASE)
    assert set(spec) == {"apiVersion", "kind", "resources"}, "a transformer would make the files differ from what is applied"
    on_disk = sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(spec["resources"]) == on_disk


@pytest.mark.parametrize("name", sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml"))
def test_each_base_manifest_validates_strictly(name):
    docs = load_all(BASE / name)
    assert docs
    for doc in docs:
        validate(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "llmdiag", "namespaces are written out: no transformer adds them"


def test_validation_catches_a_broken_manifest():
    ds = daemonset(render_base())
    broken = copy.deepcopy(ds)
    broken["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] = "BPF"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)
    unknown = copy.deepcopy(ds)
    unknown["spec"]["template"]["spec"]["hostPid"] = True  # misspelt: strict validation rejects it
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(unknown)


def test_daemonset_runs_unprivileged_with_the_measured_capabilities():
    pod = daemonset(render_base())["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["automountServiceAccountToken"] is False
    (agent,) = pod["containers"]
    sc = agent["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    # tests/root/test_deploy_capabilities.py runs the collectors with exactly this set
    assert sorted(sc["capabilities"]["add"]) == ["BPF", "DAC_READ_SEARCH", "PERFMON", "SYS_PTRACE", "SYS_RESOURCE"]


def test_daemonset_mounts_probes_listen_address_and_token():
    ds = daemonset(render_base())
    pod = ds["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in ("/sys/kernel/tracing", "/sys/fs/bpf", "/lib/modules", "/usr/src"):
        assert volumes[mounts[path]["name"]]["hostPath"]["path"] == path, path
    for path in ("/sys/fs/bpf", "/lib/modules", "/usr/src", "/etc/llmdiag", "/var/run/secrets/llmdiag"):
        assert mounts[path].get("readOnly") is True, path
    assert volumes[mounts["/var/run/secrets/llmdiag"]["name"]]["secret"]["secretName"] == "llmdiag-agent-token"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert agent[probe]["httpGet"] == {"path": "/healthz", "port": "http-metrics"}, probe
    args = agent["args"]
    assert args[args.index("--listen") + 1] == "$(POD_IP):9464"
    assert args[args.index("--agent-check") + 1] == "$(POD_IP):9465"
    assert args[args.index("--token-file") + 1].startswith("/var/run/secrets/llmdiag/")
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in agent["env"] if "valueFrom" in e}
    assert env["POD_IP"] == "status.podIP" and env["NODE_NAME"] == "spec.nodeName"
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert ports == {"http-metrics": 9464, "agent-check": 9465}
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["http-metrics"])
    limits, requests = agent["resources"]["limits"], agent["resources"]["requests"]
    assert limits["memory"] and requests["memory"] and requests["cpu"]


def test_configmap_config_loads_with_the_strict_loader(tmp_path):
    (cm,) = [d for d in render_base() if d["kind"] == "ConfigMap"]
    path = tmp_path / "config.toml"
    path.write_text(cm["data"]["config.toml"])
    config = load_config(path)
    assert config.agent.discover is True
    # the path the DaemonSet passes to --config is where the ConfigMap is mounted
    agent = daemonset(render_base())["spec"]["template"]["spec"]["containers"][0]
    assert agent["args"][agent["args"].index("--config") + 1] == "/etc/llmdiag/config.toml"


# -- the overlays ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlay_renders_and_validates(name):
    docs = render_overlay(name)
    for doc in docs:
        validate(doc)


def test_nvidia_overlay_sets_the_runtime_class_and_gpu_nodes():
    pod = daemonset(render_overlay("nvidia"))["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"].get("limits", {})


def test_generic_headers_overlay_drops_the_node_headers_for_a_writable_modules_dir():
    pod = daemonset(render_overlay("generic-headers"))["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "/usr/src" not in mounts and "usr-src" not in volumes
    assert "emptyDir" in volumes[mounts["/lib/modules"]["name"]] and not mounts["/lib/modules"].get("readOnly")


def test_privileged_overlay_is_privileged():
    sc = daemonset(render_overlay("privileged"))["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert sc["privileged"] is True and "capabilities" not in sc


def test_patch_test_ops_guard_the_base_order():
    ds = daemonset(render_base())
    reordered = copy.deepcopy(ds)
    reordered["spec"]["template"]["spec"]["volumes"].reverse()
    ops = yaml.safe_load((KUBE / "generic-headers" / "generic-headers.patch.yaml").read_text())
    with pytest.raises(AssertionError, match="test failed"):
        apply_json_patch(reordered, ops)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) is not installed here")
@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_kubectl_kustomize_renders_the_same_objects(name):
    proc = subprocess.run(["kubectl", "kustomize", str(KUBE / name)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    theirs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    ours = render_base() if name == "base" else render_overlay(name)
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(theirs, key=key) == sorted(ours, key=key)
