"""deploy/prometheus: promtool checks the rules and runs their unit tests; the scrape config is checked.

Debian's promtool and prometheus are built without Kubernetes service discovery
("field kubernetes_sd_configs not found"), so the scrape config is checked by promtool with its
``kubernetes_sd_configs`` replaced by a ``file_sd_configs`` and everything else as shipped;
tests/integration/test_deploy_prometheus.py then runs a real Prometheus on that config with the
``__meta_kubernetes_*`` labels the pod role produces, to test the relabelling itself.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy_support import (
    DEPLOY,
    RULE_TESTS,
    RULES,
    SCRAPE_CONFIG,
    metric_names,
    rules,
)

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: scripts/setup.sh installs prometheus")


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_promtool_check_rules():
    proc = promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules())} rules found" in proc.stdout


def test_promtool_rule_unit_tests_pass():
    proc = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_rule_unit_tests_fail_when_an_alert_threshold_is_wrong(tmp_path):
    text = RULES.read_text().replace("llmdiag_destination_port_exhaustion_eta_seconds < 300", "llmdiag_destination_port_exhaustion_eta_seconds < 30")
    assert text != RULES.read_text()
    (tmp_path / RULES.name).write_text(text)
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    proc = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert proc.returncode != 0
    assert "LlmdiagTimeWaitExhaustion" in proc.stdout + proc.stderr


def test_every_alert_fires_in_a_unit_test_and_every_alert_has_a_severity():
    alerts = {rule["alert"]: rule for rule in rules() if "alert" in rule}
    fired: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            if check.get("exp_alerts"):
                fired.add(check["alertname"])
    assert set(alerts) == fired, f"alerts never fired by a test: {sorted(set(alerts) - fired)}"
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    # the list: a critical diagnosis, a collector down, stale ticks, the agent's own overhead, TIME_WAIT ETA
    for required in ("LlmdiagCriticalDiagnosis", "LlmdiagCollectorDown", "LlmdiagStaleTicks", "LlmdiagAgentCPUHigh",
                     "LlmdiagAgentMemoryHigh", "LlmdiagTimeWaitExhaustion"):
        assert required in alerts


def file_sd_variant(config: dict, targets_file: str) -> dict:
    """The shipped scrape config with its Kubernetes discovery replaced by a file (same relabelling)."""
    out = copy.deepcopy(config)
    for job in out["scrape_configs"]:
        if "kubernetes_sd_configs" in job:
            del job["kubernetes_sd_configs"]
            job["file_sd_configs"] = [{"files": [targets_file], "refresh_interval": "5s"}]
    return out


def test_scrape_config_passes_promtool_check_config(tmp_path):
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    token = tmp_path / "token"
    token.write_text("secret\n")
    variant = file_sd_variant(config, str(tmp_path / "targets.json"))
    variant["scrape_configs"][0]["authorization"]["credentials_file"] = str(token)
    (tmp_path / "targets.json").write_text("[]")
    shutil.copy(RULES, tmp_path / RULES.name)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(variant))
    proc = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 1 rule files found" in proc.stdout + proc.stderr


def test_scrape_config_finds_the_daemonset_pods():
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["kubernetes_sd_configs"]
    ds = yaml.safe_load((DEPLOY / "kubernetes" / "base" / "daemonset.yaml").read_text())
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert sd["role"] == "pod" and sd["namespaces"]["names"] == [ds["metadata"]["namespace"]]
    (selector,) = sd["selectors"]
    key, _, value = selector["label"].partition("=")
    assert pod_labels[key] == value
    keep_port = next(r for r in job["relabel_configs"] if r["source_labels"] == ["__meta_kubernetes_pod_container_port_name"])
    ports = [p["name"] for p in ds["spec"]["template"]["spec"]["containers"][0]["ports"]]
    assert keep_port["regex"] in ports
    assert job["honor_labels"] is True
    targets = {r.get("target_label") for r in job["relabel_configs"]}
    assert {"node", "agent_pod", "instance"} <= targets and "pod" not in targets and "namespace" not in targets


def test_metric_name_extraction():
    assert metric_names('max by (node) (llmdiag_backend_ttft_seconds{stat="p99", x="llmdiag_fake"}) '
                        "/ llmdiag:recorded:rule + rate(process_cpu_seconds_total[5m])") == {
        "llmdiag_backend_ttft_seconds", "process_cpu_seconds_total"}
