"""deploy/inferencepool.yaml: the core resources validate against the Kubernetes schemas, the custom ones
have the shape the Gateway API Inference Extension v1 defines, and the pieces point at each other."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from llmdiag.config import Config

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "inferencepool.yaml"
DOCS = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
BY_KIND = {(d["kind"], d["metadata"]["name"]): d for d in DOCS}


@pytest.mark.parametrize("doc", [d for d in DOCS if d["apiVersion"] in ("v1", "apps/v1")],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_core_resources_validate(doc):
    kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_pool_picker_and_pods_fit_together():
    pool = BY_KIND[("InferencePool", "vllm-llama3-8b")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    ref = spec["endpointPickerRef"]
    assert set(ref) <= {"group", "kind", "name", "port", "failureMode"} and ref["failureMode"] in ("FailOpen", "FailClose")
    service = BY_KIND[("Service", ref["name"])]
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    deployment = BY_KIND[("Deployment", "llmdiag-picker")]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    # The headless Service selects the pool's pods on the pool's port.
    headless = BY_KIND[("Service", "vllm-llama3-8b-pods")]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert headless["spec"]["ports"][0]["port"] == spec["targetPorts"][0]["number"]
    route = BY_KIND[("HTTPRoute", "vllm-llama3-8b")]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"], backend["name"]) == ("inference.networking.k8s.io", "InferencePool", "vllm-llama3-8b")
    assert {d["metadata"]["namespace"] for d in DOCS} == {"default"}


def test_picker_config_loads_and_matches_the_ports():
    config = Config.from_toml(BY_KIND[("ConfigMap", "llmdiag-picker")]["data"]["picker.toml"], source="picker.toml")
    picker = config.picker
    assert picker.listen.endswith(":9002") and picker.metrics_listen.endswith(":9090")
    host, port = picker.discover.rsplit(":", 1)
    assert host.startswith("vllm-llama3-8b-pods.default.svc") and int(port) == 8000
    container = BY_KIND[("Deployment", "llmdiag-picker")]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][-1] == "picker"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/etc/llmdiag/picker.toml" in mounts
    assert any(picker.tls_cert_file.startswith(m) for m in mounts)
