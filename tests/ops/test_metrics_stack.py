"""`slimserve serve --metrics`' pieces without Ray: deploy/grafana's panels as Prometheus
console graphs, and the Prometheus config (the running stack: tests/ops/test_dashboard.py)."""

from __future__ import annotations

import json

from app.serve.metrics_stack import (
    GRAFANA_JSON,
    RATE_INTERVAL,
    console_page,
    grafana_panels,
    prometheus_config,
)


def test_every_grafana_panel_and_query_becomes_a_console_graph():
    with open(GRAFANA_JSON) as f:
        board = json.load(f)["panels"]
    panels = grafana_panels()
    assert [p.title for p in panels] == [p["title"] for p in board]
    for panel, source in zip(panels, board):
        assert len(panel.exprs) == len(source.get("targets", []))
        for expr in panel.exprs:
            assert "$" not in expr, expr  # Grafana's variables filled for one machine
        for legend in panel.legends:
            assert "{{" not in legend
    ttft = next(p for p in panels if p.title == "Time to first token")
    assert f'model=~".*"}}[{RATE_INTERVAL}]' in ttft.exprs[0]

    page = console_page(panels, "slimserve")
    assert "{{" not in page  # Prometheus would read it as a template action
    graphs = [p for p in panels if not p.row]
    assert page.count("new PromConsole.Graph(") == len(graphs)
    for p in panels:
        assert p.title.replace("&", "&amp;") in page


def test_prometheus_scrapes_the_given_targets():
    cfg = prometheus_config(["127.0.0.1:1234"])
    (job,) = cfg["scrape_configs"]
    assert job["static_configs"] == [{"targets": ["127.0.0.1:1234"]}]
