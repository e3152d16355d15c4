"""The Ray dashboard a user opens after `make serve`, in a real (headless) Chromium.

One `slimserve serve --metrics` (dashboard on by default; autoscaling on PrefillServer from
the config file's `deployments:`) serves the module. The browser signs in through the
dashboard's own token dialog with the token where the server's printed line says it is, then
reads the Serve page as a user would: every slimserve deployment with its status and replica
count (screenshot: bench/results/dashboard_serve.png), the KV store actors on the Actors page,
and PrefillServer's count going 1 -> 2 under a burst of long prompts, with the policy's
decision in the controller log. Prometheus (`--metrics`) then answers the Grafana JSON's own
panel queries with data and its console page draws them (bench/results/dashboard_panels.png).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import json
import math
import os
import re
import threading
import time
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from serve.apps import tiny_serve_args

from app.serve.metrics_stack import grafana_panels
from ops.browser import chromium
from ops.dashboard_server import dashboard_server
from ops.test_autoscaling_ray import autoscaled

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results")
SCREENSHOT = os.path.join(RESULTS, "dashboard_serve.png")
SCALED_SCREENSHOT = os.path.join(RESULTS, "dashboard_serve_scaled.png")
PANELS_SCREENSHOT = os.path.join(RESULTS, "dashboard_panels.png")
DEPLOYMENTS = ("Ingress", "PrefillServer", "DecodeServer")
SCALE_OUT_S = 120.0

# The Serve page's applications/deployments table, by its header: name -> {status, replicas}.
SERVE_TABLE = """(() => {
  const rows = [...document.querySelectorAll('table tr')]
    .map(r => [...r.cells].map(c => c.innerText.trim()));
  const head = rows.find(r => r.includes('Name') && r.includes('Replicas'));
  if (!head) return null;
  const [n, s, k] = ['Name', 'Status', 'Replicas'].map(h => head.indexOf(h));
  const out = {};
  for (const r of rows)
    if (r !== head && r.length === head.length) out[r[n]] = {status: r[s], replicas: r[k]};
  return out;
})()"""


def config(model: str) -> dict:
    policy = "app.serve.routing.autoscaling:PrefillTokenPolicy"
    prefill = {"name": "PrefillServer", **autoscaled(policy, {"target_tokens_per_replica": 64})}
    args = tiny_serve_args(model)
    return {"applications": [{"args": args, "deployments": [prefill]}]}


@pytest.fixture(scope="module")
def server(checkpoint_factory):
    with dashboard_server(config(checkpoint_factory("llama"))) as s:
        yield s


@pytest.fixture(scope="module")
def page(server):
    """A browser signed in to the dashboard through its token dialog, on the Serve page."""
    with chromium() as page:
        page.goto(server.dashboard_url)
        dialog = "document.body.innerText.includes('Authentication Token Required')"
        page.wait_for(dialog, 60, "the dashboard's sign-in dialog")
        _submit_token(page, "not-the-token")
        page.wait_for(
            "document.body.innerText.includes('Invalid authentication token')",
            30,
            "a wrong token refused",
        )
        _submit_token(page, server.token())
        page.wait_for(f"!{dialog} && {SERVE_TABLE}", 60, "the Serve page after sign-in")
        yield page


def _submit_token(page, token: str) -> None:
    page.eval("(e => { e.focus(); e.select(); })(document.querySelector('input[type=password]'))")
    page.insert_text(token)  # replaces the selection, as a user's paste would
    page.eval(
        "[...document.querySelectorAll('button')]"
        ".find(b => b.textContent.trim() === 'Submit').click()"
    )


# Clicks the deployment's "View config" on the Serve page (a dialog with its config).
VIEW_CONFIG = """(name => {
  const row = [...document.querySelectorAll('table tr')]
    .find(r => [...r.cells].some(c => c.innerText.trim() === name));
  [...row.querySelectorAll('a, button')]
    .find(e => e.textContent.trim() === 'View config').click();
  return true;
})"""
DIALOG_TEXT = "(document.querySelector('[role=dialog]') || {innerText: ''}).innerText"


def serve_table(page) -> dict:
    return page.eval(SERVE_TABLE) or {}


def screenshot(page, path: str) -> None:
    """The Serve page down to its deployments table (the docs' picture)."""
    os.makedirs(RESULTS, exist_ok=True)
    bottom = page.eval("document.querySelector('table').getBoundingClientRect().bottom")
    page.screenshot(path, height=int(bottom) + 24)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def wait_table(page, ok, timeout_s: float, what: str) -> dict:
    end = time.monotonic() + timeout_s
    while True:
        table = serve_table(page)
        if ok(table):
            return table
        assert time.monotonic() < end, f"{what}: Serve page shows {table}\n{page.text()}"
        time.sleep(0.5)


def test_serve_page_shows_every_deployment_with_its_replicas(server, page):
    def ready(t):
        apps = t.get("slimserve", {}).get("status") == "RUNNING"
        return apps and all(t.get(d, {}).get("status") == "HEALTHY" for d in DEPLOYMENTS)

    table = wait_table(page, ready, 60, "slimserve RUNNING, every deployment HEALTHY")
    for name in DEPLOYMENTS:
        assert table[name]["replicas"] == "1", f"{name}: {table[name]}"
    screenshot(page, SCREENSHOT)

    # PrefillServer's autoscaling bounds and policy, behind its "View config".
    page.eval(f"{VIEW_CONFIG}('PrefillServer')")
    config = page.wait_for(f"{DIALOG_TEXT}.includes('max_replicas') && {DIALOG_TEXT}", 30, "config")
    for key, value in (("min_replicas", 1), ("max_replicas", 2)):
        assert re.search(rf"{key}\W+{value}\b", config), config
    assert "app.serve.routing.autoscaling:PrefillTokenPolicy" in config, config

    page.goto(server.dashboard_root + "/#/actors")
    for actor in ("slimserve-kvstore-0", "slimserve-kvstore-handoff"):
        page.wait_for(f"document.body.innerText.includes({json.dumps(actor)})", 60, actor)
    page.goto(server.dashboard_url)
    page.wait_for(SERVE_TABLE, 30, "the Serve page again")


def test_prefill_scale_out_shows_on_the_serve_page(server, page):
    stop = threading.Event()

    def burst(seed: int):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            prompt = [int(t) for t in rng.integers(3, 300, 350)]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
            r = httpx.post(server.api_url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text

    assert serve_table(page)["PrefillServer"]["replicas"] == "1"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(burst, i) for i in range(4)]
        try:
            wait_table(
                page,
                lambda t: t.get("PrefillServer", {}).get("replicas") == "2" or _failed(clients),
                SCALE_OUT_S,
                "PrefillServer scaled to 2 replicas",
            )
        finally:
            stop.set()
        for c in clients:
            c.result()  # a failed request fails the test
    table = serve_table(page)
    assert table["PrefillServer"]["replicas"] == "2", table
    assert table["DecodeServer"]["replicas"] == "1", table
    screenshot(page, SCALED_SCREENSHOT)

    logs = glob.glob(os.path.join(server.ray_logs, "serve", "controller_*.log"))
    text = "".join(_read(p) for p in logs)
    line = r"slimserve autoscaling: PrefillServer \(slimserve\) wants (\d+) replicas.* by (\w+) "
    decisions = re.findall(line + r"\[PrefillTokenPolicy\] .*prefill_tokens_demand=", text)
    assert any(int(n) >= 2 and basis == "prefill_tokens" for n, basis in decisions), (
        f"no scale-out decision by prompt tokens in the controller log {logs}: {decisions}"
    )


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _failed(futures) -> bool:
    return any(f.done() for f in futures)  # a client only ends early by failing


def test_metrics_show_slimserve_panels_with_data(server, page):
    """The dashboard sees Prometheus; Prometheus answers the Grafana JSON's own TTFT panel
    query (rates: requests keep coming meanwhile) and holds the replicas and policy series;
    the panels page draws that panel."""
    assert page.eval("fetch('/api/prometheus_health').then(r => r.json())")["result"]
    ttft = next(p for p in grafana_panels() if p.title == "Time to first token")
    queries = (
        ttft.exprs[1],  # p95 by role, as the panel asks it
        'ray_serve_deployment_replica_healthy{application="slimserve"}',
        'ray_slimserve_autoscaling_desired_replicas{deployment="PrefillServer"}',
    )
    with trickle(server):
        end = time.monotonic() + 90
        for query in queries:
            while not _has_value(server, query):
                assert time.monotonic() < end, f"Prometheus has no value for {query}"
                time.sleep(1)

    # Prometheus' console page of deploy/grafana's panels, over the last 2 minutes.
    page.goto(server.panels_url + "#pctc" + quote(json.dumps({"duration": 120, "endTime": 0})))
    drawn = """[...document.querySelectorAll('h4')]
      .find(h => h.innerText === 'Time to first token')
      .nextElementSibling.querySelectorAll('.rickshaw_graph path').length"""
    assert page.wait_for(drawn, 30, "the TTFT panel drawn with data") > 0
    page.screenshot(PANELS_SCREENSHOT, height=1600)


def _has_value(server, query: str) -> bool:
    got = httpx.get(server.prometheus_url + "/api/v1/query", params={"query": query}).json()
    return any(math.isfinite(float(r["value"][1])) for r in got["data"]["result"])


@contextlib.contextmanager
def trickle(server):
    """Short requests, one at a time, until the block ends."""
    stop = threading.Event()

    def send():
        body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0}
        while not stop.is_set():
            r = httpx.post(server.api_url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sender = pool.submit(send)
        try:
            yield
        finally:
            stop.set()
        sender.result()
