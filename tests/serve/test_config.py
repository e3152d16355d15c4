"""ServeArgs validation and the configs that ship (no cluster needed)."""

import argparse
import os

import pydantic
import pytest
import yaml

from app.serve.cli import serve_args
from app.serve.config import ServeArgs
from app.serve.routing.prefill_placement import PlacementConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOCAL = os.path.join(ROOT, "deploy", "local.yaml")


def test_local_yaml_args_validate():
    with open(LOCAL) as f:
        app = yaml.safe_load(f)["applications"][0]
    assert app["import_path"] == "app.serve.build:build_app"
    cfg = ServeArgs(**app["args"])
    assert cfg.mode == "disaggregated" and cfg.engine.kv_cache_dtype == "fp8_e4m3"
    assert cfg.num_prefill_replicas == cfg.num_decode_replicas == 1
    # A served step takes whole long prompts (SERVE_DEFAULTS: TTFT under a queue of them)
    scheduler = cfg.engine.engine_config("m").scheduler
    assert scheduler.max_num_batched_tokens == scheduler.long_prefill_chunk == 2048
    assert scheduler.light_load_step_tokens == 512  # short prompts keep small steps
    # long prompts prefill on a decode replica that shares the prefill replica's cores
    assert cfg.prefill_on_shared_compute == "local"
    assert cfg.prefill_max_itl_slowdown is None  # the batch cap alone guards ITL


@pytest.mark.parametrize(
    "bad",
    [
        {"mode": "both"},
        {"prefill_on_shared_compute": "remote"},
        {"prefill_max_itl_slowdown": 1.0},  # a cap of 1x would forbid every local prefill
        {"num_prefil_replicas": 2},  # typo: unknown fields are errors
        {"engine": {"chunk_tokens": 100, "block_size": 16}},
        {"max_queued_requests": 0},
        {"engine": {"kv_cache_memory_bytes": -1}},
        {"engine": {"torch_threads": 0}},
        {"engine": {"torch_threads": "all"}},
        {"engine": {"threaded_step_min_tokens": 0}},
        {"local_prefill_max_tokens": -1},
    ],
)
def test_bad_serve_args_are_rejected(bad):
    with pytest.raises(pydantic.ValidationError):
        ServeArgs(**bad)


def test_auto_threads_are_the_cpus_the_replica_may_use(monkeypatch):
    from app.engine import step_threads

    monkeypatch.setattr(step_threads, "available_cpus", lambda: 3)
    assert ServeArgs().engine.step_threads() == 3
    assert ServeArgs(engine={"torch_threads": 2}).engine.step_threads() == 2
    assert ServeArgs(engine={"torch_threads": None}).engine.step_threads() is None


def test_short_prompts_prefill_locally_below_one_chunk():
    """Conditional disaggregation's limit: by default every prompt shorter than one KV
    chunk; 0 turns it off; a limit that reaches a chunk is refused, naming both fields
    (such a prompt has a chunk for the store, which only a prefill replica publishes)."""
    assert ServeArgs(engine={"chunk_tokens": 64, "block_size": 16}).local_prefill_tokens == 63
    assert ServeArgs(local_prefill_max_tokens=0).local_prefill_tokens == 0
    assert ServeArgs(local_prefill_max_tokens=100).local_prefill_tokens == 100
    with pytest.raises(pydantic.ValidationError, match="local_prefill_max_tokens.*chunk_tokens"):
        ServeArgs(local_prefill_max_tokens=256)


def test_the_placement_policy_takes_its_settings_from_serve_args():
    """Seen failing with `prefill_max_itl_slowdown` not passed on (the cap stayed None)."""
    args = ServeArgs(
        local_prefill_max_tokens=100, prefill_on_shared_compute="load",
        prefill_max_itl_slowdown=3.0, max_ongoing_requests=12,
        engine={"max_num_batched_tokens": 1024},
    )  # fmt: skip
    config = PlacementConfig.from_args(args)
    assert (config.short_prompt_tokens, config.step_prefill_tokens) == (100, 1024)
    assert config.max_decode_running == 12 and config.max_itl_slowdown == 3.0
    assert not config.local_on_shared_compute
    default = PlacementConfig.from_args(ServeArgs())
    assert default.local_on_shared_compute and default.max_itl_slowdown is None


def test_cli_flags_override_the_config_file():
    ns = argparse.Namespace(
        config=LOCAL,
        model="/models/x",
        kv_cache_dtype="bf16",
        mode="colocated",
        num_prefill_replicas=None,
        num_decode_replicas=3,
        local_prefill_max_tokens=None,
    )
    cfg = ServeArgs(**serve_args(ns))
    assert cfg.engine.model == "/models/x" and cfg.engine.kv_cache_dtype == "bf16"
    assert cfg.mode == "colocated" and cfg.num_decode_replicas == 3
    assert cfg.engine.chunk_tokens == 256  # the rest comes from the file


def test_proxy_is_fixed_before_ray_serve_is_imported(monkeypatch):
    """`slimserve serve --proxy` sets Ray's switch for the Ray it starts; once Ray Serve's
    constants are imported (they copy the switch) the other proxy is refused, not ignored."""
    from ray.serve._private import constants

    from app.serve.cli import HAPROXY_ENV, proxy_env, use_proxy

    assert proxy_env("haproxy") == {HAPROXY_ENV: "1"} and proxy_env("serve") == {HAPROXY_ENV: "0"}
    with pytest.raises(ValueError, match="proxy must be one of"):
        proxy_env("nginx")
    monkeypatch.delenv(HAPROXY_ENV, raising=False)  # restored after the test
    imported = "haproxy" if constants.RAY_SERVE_ENABLE_HA_PROXY else "serve"
    other = "serve" if imported == "haproxy" else "haproxy"
    with pytest.raises(RuntimeError, match="imported with the other proxy"):
        use_proxy(other)
    use_proxy(imported)
    assert os.environ[HAPROXY_ENV] == proxy_env(imported)[HAPROXY_ENV]


def test_the_clis_ray_drains_an_ingress_replica_for_2_s_unless_told(monkeypatch):
    """Ray's 30 s window for load balancers in front of HAProxy has none to wait for in the
    CLI's own Ray; a value the user exported is kept."""
    from ray.serve._private import constants

    from app.serve.cli import DRAIN_ENV, use_proxy

    proxy = "haproxy" if constants.RAY_SERVE_ENABLE_HA_PROXY else "serve"
    monkeypatch.setenv(DRAIN_ENV, "")  # records the session's value, restored after
    monkeypatch.delenv(DRAIN_ENV)
    use_proxy(proxy)
    assert os.environ[DRAIN_ENV] == "2"
    monkeypatch.setenv(DRAIN_ENV, "45")
    use_proxy(proxy)
    assert os.environ[DRAIN_ENV] == "45"


def test_the_cli_stops_quietly_on_its_signals_only():
    """A stop signal handled inside Ray's core surfaces as a SystemError caused by it: that
    one stops quietly too; any other error still surfaces."""
    from app.serve.cli import Stopped, until_stopped

    def raised_in_ray(cause: BaseException) -> None:
        raise SystemError("returned a result with an exception set") from cause

    for stop in (Stopped(), KeyboardInterrupt()):
        with until_stopped():
            raise stop
        with until_stopped():
            raised_in_ray(stop)
    with pytest.raises(SystemError), until_stopped():
        raised_in_ray(ValueError("not a stop"))
    with pytest.raises(ValueError), until_stopped():
        raise ValueError("not a stop")
