"""`slimserve serve`'s dashboard and config flags, parsed without starting anything."""

from __future__ import annotations

import yaml

from app.cli import build_parser
from app.serve.cli import DASHBOARD_PORT, application, dashboard_sign_in


def parse(*argv: str):
    parser, _ = build_parser(["serve", *argv])
    return parser.parse_args(["serve", *argv])


def test_dashboard_is_on_by_default_on_loopback():
    args = parse()
    assert args.dashboard and args.dashboard_host == "127.0.0.1"
    assert args.dashboard_port == DASHBOARD_PORT == 8265
    assert not args.metrics
    off = parse("--no-dashboard", "--dashboard-port", "9999", "--metrics")
    assert not off.dashboard and off.dashboard_port == 9999 and off.metrics


def test_the_config_files_deployment_overrides_are_deployed(tmp_path):
    override = {"name": "PrefillServer", "autoscaling_config": {"min_replicas": 1}}
    path = tmp_path / "serve.yaml"
    cfg = {"applications": [{"args": {"mode": "disaggregated"}, "deployments": [override]}]}
    path.write_text(yaml.safe_dump(cfg))
    app = application(parse("--config", str(path), "--num-decode-replicas", "2"))
    assert app["deployments"] == [override]
    assert app["args"]["mode"] == "disaggregated" and app["args"]["num_decode_replicas"] == 2
    assert app["import_path"] == "app.serve.build:build_app"


def test_sign_in_names_where_the_token_is(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    assert "token in ~/.ray/auth_token" in dashboard_sign_in()
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/etc/ray-token")
    assert "token in /etc/ray-token" in dashboard_sign_in()
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    assert "token in $RAY_AUTH_TOKEN" in dashboard_sign_in()
    assert "secret" not in dashboard_sign_in()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert dashboard_sign_in().startswith("no sign-in")
