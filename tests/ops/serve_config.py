"""Checks for Serve config files (deploy/*.yaml, serveConfigV2): strict keys, Ray's own overrides.

Ray's ``ServeDeploySchema`` keeps unknown keys (forward compatibility) and types
``autoscaling_config`` as a plain dict, so a typo such as ``max_replica`` would deploy
silently with a default. ``unknown_keys`` walks the config against the pydantic models that
Serve (and our builder, ``ServeArgs``) apply to each part and names every key none of them
declares.
"""

from __future__ import annotations

import inspect
from typing import Any, get_args, get_origin
from unittest import mock

import yaml
from pydantic import BaseModel
from ray.serve._private.application_state import override_deployment_info
from ray.serve._private.build_app import build_app as ray_build_app
from ray.serve._private.deployment_info import DeploymentInfo
from ray.serve.config import AutoscalingPolicy
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from app.serve.config import ServeArgs


def load(path_or_text: str, *, text: bool = False) -> dict[str, Any]:
    if text:
        return yaml.safe_load(path_or_text)
    with open(path_or_text) as f:
        return yaml.safe_load(f)


def _models_in(annotation) -> list[type[BaseModel]]:
    """Pydantic models an annotation admits (free-form dicts admit none)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) is dict or annotation is dict:
        return []
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def unknown_keys(data: Any, model: type[BaseModel], path: str = "") -> list[str]:
    """Dotted paths of keys in ``data`` that ``model`` (recursively) does not declare."""
    if not isinstance(data, dict):
        return []
    fields = {}
    for name, info in model.model_fields.items():
        fields[name] = info
        if info.alias:
            fields[info.alias] = info
    bad = []
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            bad.append(where)
            continue
        bad += _special(model, key, value, where)
        models = _models_in(fields[key].annotation)
        if not models or (model, key) in _SPECIAL:
            continue
        if isinstance(value, list):
            for i, item in enumerate(value):
                bad += unknown_keys(item, models[0], f"{where}[{i}]")
        else:
            bad += unknown_keys(value, models[0], where)
    return bad


def _special(model, key: str, value, where: str) -> list[str]:
    """The builder's ``args`` are a free-form dict to Serve; ours are ``ServeArgs``."""
    if (model, key) == (ServeApplicationSchema, "args"):
        return unknown_keys(value, ServeArgs, where)
    return []


_SPECIAL = {(ServeApplicationSchema, "args")}


def policy_kwargs_fit(app: ServeApplicationSchema) -> list[str]:
    """Each custom policy class accepts its configured kwargs (exact check per class)."""
    bad = []
    for dep in app.deployments:
        auto = dep.autoscaling_config
        policy = auto.get("policy") if isinstance(auto, dict) else None
        if not isinstance(policy, dict):
            continue
        cls = AutoscalingPolicy(**policy).get_policy()
        if inspect.isclass(cls):
            params = set(inspect.signature(cls.__init__).parameters) - {"self"}
            extra = set(policy.get("policy_kwargs") or {}) - params
            bad += [f"{dep.name}.policy_kwargs.{k}" for k in sorted(extra)]
    return bad


def deployment_infos(app: ServeApplicationSchema) -> dict[str, DeploymentInfo]:
    """What Serve would deploy: our builder's graph with the config's overrides applied by
    Serve's own ``override_deployment_info`` (no cluster needed; the KV store is not made)."""
    import app.serve.build as build

    with mock.patch.object(build, "ensure_store", lambda cfg: None):
        application = build.build_app(app.args)
    built = ray_build_app(
        application, name=app.name, make_deployment_handle=lambda dep, _app: f"<{dep.name}>"
    )
    infos = {
        d.name: DeploymentInfo(
            deployment_config=d._deployment_config,
            replica_config=d._replica_config,
            start_time_ms=0,
            deployer_job_id="config-test",
        )
        for d in built.deployments
    }
    return override_deployment_info(infos, app)


def all_problems(config: dict) -> list[str]:
    """Every problem we can find without a cluster; [] when the config is sound."""
    schema = ServeDeploySchema.model_validate(config)
    bad = unknown_keys(config, ServeDeploySchema)
    for app in schema.applications:
        ServeArgs(**app.args)
        bad += policy_kwargs_fit(app)
        deployment_infos(app)  # raises on an unknown deployment name or a bad option value
    return bad
