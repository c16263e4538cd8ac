"""deploy/grafana/llmdiag-fleet.json: a well-formed dashboard covering what the issue asks for.

Its PromQL runs against a real Prometheus in tests/integration/test_deploy_prometheus.py; its
metric names are checked against the agent's /metrics there too.
"""

from __future__ import annotations

from deploy_support import dashboard, dashboard_exprs


def test_panels_have_unique_ids_and_do_not_overlap():
    panels = dashboard()["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_every_query_panel_uses_the_datasource_variable_and_has_an_expression():
    d = dashboard()
    names = [v["name"] for v in d["templating"]["list"]]
    assert names == ["datasource", "node", "backend"]
    for p in d["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}", p["title"]
            assert t["expr"].count("(") == t["expr"].count(")") and t["expr"].count("{") == t["expr"].count("}"), t["expr"]


def test_the_dashboard_covers_the_issue_list():
    exprs = " ".join(dashboard_exprs())
    for needed in ("llmdiag_backend_score", "llmdiag_backend_penalty", "llmdiag:diagnoses_open:count_by_kind_severity",
                   "llmdiag_backend_ttft_seconds", "llmdiag_backend_requests_waiting", "llmdiag_backend_kv_cache_usage",
                   "llmdiag_host_sockstat_tcp_tw", "llmdiag_backend_h2_rst_stream_total", "llmdiag_gpu_utilization"):
        assert needed in exprs, needed
