"""deploy/*.yaml: parse with Serve's schema, no unknown keys, Serve's overrides apply."""

from __future__ import annotations

import copy
import glob
import importlib
import os

import pytest
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from app.serve.routing.autoscaling import DecodeKVPolicy, PrefillTokenPolicy
from tests.ops.serve_config import all_problems, deployment_infos, load, unknown_keys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "deploy", "*.yaml")))
GPU = os.path.join(ROOT, "deploy", "gpu.yaml")


def test_there_are_configs():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"local.yaml", "gpu.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_parses_and_has_only_known_keys(path):
    config = load(path)
    ServeDeploySchema.model_validate(config)
    assert all_problems(config) == []


def _gpu_app(config):
    return config["applications"][0]


def _deployment(config, name):
    return next(d for d in _gpu_app(config)["deployments"] if d["name"] == name)


TYPOS = {
    "top level": lambda c: c.update(http_option=c.pop("http_options")),
    "grpc options": lambda c: c["grpc_options"].update(prot=9000),
    "application": lambda c: _gpu_app(c).update(rout_prefix="/"),
    "builder args": lambda c: _gpu_app(c)["args"].update(num_prefil_replicas=2),
    "engine args": lambda c: _gpu_app(c)["args"]["engine"].update(kv_cache_dtyp="bf16"),
    "deployment option": lambda c: _deployment(c, "DecodeServer").update(max_ongoing=3),
    "autoscaling": lambda c: _deployment(c, "PrefillServer")["autoscaling_config"].update(
        max_replica=4
    ),
    "policy": lambda c: _deployment(c, "DecodeServer")["autoscaling_config"]["policy"].update(
        policy_kwarg={}
    ),
    "actor options": lambda c: _deployment(c, "DecodeServer")["ray_actor_options"].update(
        num_gpu=1
    ),
}


@pytest.mark.parametrize("where", sorted(TYPOS))
def test_a_typo_fails(where):
    config = copy.deepcopy(load(GPU))
    TYPOS[where](config)
    ServeDeploySchema.model_validate(config)  # Serve's own schema lets each of these pass...
    assert unknown_keys(config, ServeDeploySchema)  # ...ours does not


def test_a_policy_kwarg_typo_fails():
    config = copy.deepcopy(load(GPU))
    policy = _deployment(config, "DecodeServer")["autoscaling_config"]["policy"]
    policy["policy_kwargs"]["target_kv_usag"] = 0.5
    assert all_problems(config) == ["DecodeServer.policy_kwargs.target_kv_usag"]


def test_an_unknown_deployment_name_fails():
    config = copy.deepcopy(load(GPU))
    _deployment(config, "DecodeServer")["name"] = "DecodeServr"
    with pytest.raises(ValueError, match="DecodeServr"):
        all_problems(config)


def test_a_bad_value_fails():
    config = copy.deepcopy(load(GPU))
    _deployment(config, "PrefillServer")["autoscaling_config"]["min_replicas"] = 9  # > max
    with pytest.raises((ValidationError, ValueError)):
        all_problems(config)


def test_gpu_config_prefill_and_decode_scale_independently_on_gpus():
    app = ServeDeploySchema.model_validate(load(GPU)).applications[0]
    infos = deployment_infos(app)
    assert set(infos) == {"Ingress", "PrefillServer", "DecodeServer"}
    policies = {}
    for name in ("PrefillServer", "DecodeServer"):
        cfg = infos[name].deployment_config
        auto = cfg.autoscaling_config
        assert auto is not None and auto.max_replicas > auto.min_replicas >= 1
        assert infos[name].replica_config.ray_actor_options["num_gpus"] == 1
        policy = auto.policy.get_policy()
        policies[name] = policy(**auto.policy.policy_kwargs)
    assert isinstance(policies["PrefillServer"], PrefillTokenPolicy)
    assert isinstance(policies["DecodeServer"], DecodeKVPolicy)
    prefill = infos["PrefillServer"].deployment_config.autoscaling_config
    decode = infos["DecodeServer"].deployment_config.autoscaling_config
    assert prefill != decode


def test_gpu_config_engine_is_int4_weights_fp8_kv_and_args_agree_with_overrides():
    config = load(GPU)
    args = _gpu_app(config)["args"]
    assert args["engine"]["weight_quant"] == "int4"
    assert args["engine"]["kv_cache_dtype"] == "fp8_e4m3"
    assert args["mode"] == "disaggregated"
    for name in ("PrefillServer", "DecodeServer"):
        actor = _deployment(config, name)["ray_actor_options"]
        assert actor["num_gpus"] == args["replica_num_gpus"] == 1
        assert actor["num_cpus"] == args["replica_num_cpus"]


def test_gpu_config_serves_http_and_grpc():
    schema = ServeDeploySchema.model_validate(load(GPU))
    assert schema.http_options.port == 8000 and schema.http_options.host == "0.0.0.0"
    assert schema.grpc_options.port == 9000
    assert len(schema.grpc_options.grpc_servicer_functions) >= 1


def test_grpc_servicer_functions_import():
    """Serve's gRPC proxy imports these when it starts; a wrong path fails every deploy."""
    schema = ServeDeploySchema.model_validate(load(GPU))
    for path in schema.grpc_options.grpc_servicer_functions:
        module, _, attr = path.rpartition(".")
        fn = getattr(importlib.import_module(module), attr, None)
        assert callable(fn), f"deploy/gpu.yaml grpc_servicer_functions: {path} not found"
