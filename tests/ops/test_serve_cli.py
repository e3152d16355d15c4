"""`slimserve serve`'s dashboard and config flags, parsed without starting anything."""

from __future__ import annotations

import socket

import yaml

from app.cli import build_parser
from app.serve.cli import DASHBOARD_PORT, application, dashboard_port, dashboard_sign_in


def parse(*argv: str):
    parser, _ = build_parser(["serve", *argv])
    return parser.parse_args(["serve", *argv])


def test_dashboard_is_on_by_default_on_loopback():
    args = parse()
    assert args.dashboard and args.dashboard_host == "127.0.0.1"
    assert not args.metrics
    with socket.socket() as holder:  # 8265 free: that one; taken: a free one, never a clash
        try:
            holder.bind(("127.0.0.1", DASHBOARD_PORT))
        except OSError:
            pass  # someone else's dashboard holds it
        else:
            holder.listen()
        port = dashboard_port(args)
        assert port != DASHBOARD_PORT and port > 0
    assert DASHBOARD_PORT == 8265
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
