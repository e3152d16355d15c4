"""`slimserve serve --metrics`: a local Prometheus that scrapes this Ray, for the Ray dashboard
and for slimserve's panels.

Ray exports every metric (its own, Serve's, slimserve's) in Prometheus' format on each node's
metrics agent; Prometheus (Debian's ``prometheus`` package) scrapes it every few seconds and
keeps the series in a scratch folder that goes when the server stops. The Ray dashboard finds
it through ``RAY_PROMETHEUS_HOST``, set before Ray starts.

The Ray dashboard draws its Metrics tab with Grafana iframes, and no Grafana server is
packaged for Debian or PyPI. So the panels of ``deploy/grafana/slimserve.json`` (still the one
source of panels: import it into a Grafana where there is one) are also rendered as a
Prometheus console page, ``/consoles/slimserve.html``, one graph per Grafana panel with the
same PromQL (``$model`` = every model, ``$__rate_interval`` = 1m).
"""

from __future__ import annotations

import html
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

PROMETHEUS_HOST_ENV = "RAY_PROMETHEUS_HOST"  # read by the dashboard's metrics module
GRAFANA_JSON = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "slimserve.json"
CONSOLE = "slimserve.html"
SCRAPE_INTERVAL_S = 5
RANGE_S = 900  # the panels' default time range
RATE_INTERVAL = "1m"  # Grafana's $__rate_interval, at least 4 scrape intervals
READY_S = 30.0
# Grafana's unit names that read as a unit on an axis ("short", "percentunit" are formats).
GRAFANA_UNITS = {"s": "s", "Bps": "B/s", "bytes": "B"}


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    exprs: tuple[str, ...]  # PromQL, Grafana's variables substituted
    legends: tuple[str, ...]  # Prometheus console names: [[label]] for Grafana's {{label}}
    unit: str
    row: bool = False  # a row heading: no graph


def promql(expr: str) -> str:
    """A Grafana target's expression with the dashboard's variables filled for one machine."""
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$model", ".*")


def grafana_panels(path: Path = GRAFANA_JSON) -> list[Panel]:
    """The dashboard's rows and panels in order."""
    with open(path) as f:
        board = json.load(f)
    out = []
    for p in board["panels"]:
        if p.get("type") == "row":
            out.append(Panel(p["title"], (), (), "", row=True))
            continue
        targets = [t for t in p.get("targets", []) if t.get("expr")]
        legends = [
            t.get("legendFormat", "").replace("{{", "[[").replace("}}", "]]") for t in targets
        ]
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit") or ""
        unit = GRAFANA_UNITS.get(unit, "")
        out.append(
            Panel(p["title"], tuple(promql(t["expr"]) for t in targets), tuple(legends), unit)
        )
    return out


def _console_name(legend: str) -> str:
    """Grafana's ``{{label}}`` as Prometheus consoles spell it, ``[[label]]``."""
    return legend.replace("{{", "[[").replace("}}", "]]")


def console_page(panels: list[Panel], title: str) -> str:
    """A Prometheus console template drawing each panel with Prometheus' own console graphs.
    Nothing here is a Go template action: every value is escaped and carries no '{{'."""
    static = "/classic/static"
    head = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        "<meta http-equiv='refresh' content='30'>",
        f"<title>{html.escape(title)}</title>",
        f"<link rel='stylesheet' href='{static}/rickshaw/rickshaw.min.css'>",
        f"<link rel='stylesheet' href='{static}/bootstrap4/css/bootstrap.min.css'>",
        f"<link rel='stylesheet' href='{static}/css/prom_console.css'>",
    ]
    for js in ("d3/d3.min.js", "vendor/rickshaw/vendor/d3.layout.min.js"):
        head.append(f"<script src='{static}/{js}'></script>")
    for js in ("rickshaw/rickshaw.min.js", "jquery/jquery.min.js", "js/prom_console.js"):
        head.append(f"<script src='{static}/{js}'></script>")
    # The time range: the URL's #pctc{"duration":<s>,...} (Prometheus' own), else RANGE_S.
    body = [
        f"<script>var PATH_PREFIX = ''; if (location.hash.indexOf('#pctc') !== 0) "
        f"PromConsole.graphDefaults.duration = {RANGE_S};</script>",
        "</head><body><div class='container-fluid'>",
    ]
    body.append(f"<h1>{html.escape(title)}</h1><p>From deploy/grafana/slimserve.json.</p>")
    for i, p in enumerate(panels):
        if p.row:
            body.append(f"<h2>{html.escape(p.title)}</h2>")
            continue
        params = {"expr": list(p.exprs), "name": list(p.legends)}
        if p.unit:
            params["yUnits"] = p.unit
        body.append(f"<h4>{html.escape(p.title)}</h4><div id='panel{i}'></div>")
        body.append(
            f"<script>new PromConsole.Graph(Object.assign({json.dumps(params)}, "
            f"{{node: document.querySelector('#panel{i}')}}));</script>"
        )
    page = "\n".join(head + body + ["</div></body></html>"])
    assert "{{" not in page, "a panel would be read as a Go template action"
    return page


def prometheus_config(targets: list[str]) -> dict:
    return {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s"},
        "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": targets}]}],
    }


def ray_metrics_targets() -> list[str]:
    """host:port of every live node's metrics agent (this process' Ray)."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")]
    return [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in nodes]


def find_prometheus() -> str:
    found = shutil.which("prometheus")
    if found is None:
        raise RuntimeError(
            "--metrics needs Prometheus: `apt-get install prometheus` (Debian), "
            "or put a prometheus binary on PATH"
        )
    return found


class Prometheus:
    """A Prometheus server on 127.0.0.1:<port>, scraping ``targets``; ``stop()`` ends it and
    removes its data."""

    def __init__(self, port: int, targets: list[str], binary: str | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.console_url = f"{self.url}/consoles/{CONSOLE}"
        self.dir = tempfile.mkdtemp(prefix="slimserve-prometheus-")
        config = os.path.join(self.dir, "prometheus.yml")
        with open(config, "w") as f:
            yaml.safe_dump(prometheus_config(targets), f)
        consoles = os.path.join(self.dir, "consoles")
        os.makedirs(consoles)
        if GRAFANA_JSON.exists():  # absent from a non-editable install: no console page
            with open(os.path.join(consoles, CONSOLE), "w") as f:
                f.write(console_page(grafana_panels(), "slimserve"))
        cmd = [binary or find_prometheus(), f"--config.file={config}"]
        cmd += [f"--web.listen-address=127.0.0.1:{port}", f"--storage.tsdb.path={self.dir}/data"]
        cmd += [f"--web.console.templates={consoles}", f"--web.console.libraries={consoles}"]
        self.log_path = os.path.join(self.dir, "prometheus.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        end = time.monotonic() + READY_S
        while True:
            if self.proc.poll() is not None:
                with open(self.log_path) as f:
                    raise RuntimeError(f"prometheus exited: {f.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"prometheus not ready on {self.url} in {READY_S} s")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
