"""The direct call channel served on a real Ray cluster: a colocated stream placed over it
outlives its engine replica's replacement (Serve's graceful drain does not see direct
calls; the replica's `__del__` drains them)."""

import threading
import time

import httpx
import pytest
from ray import serve

from app.serve.build import build_app
from serve.apps import running_app, tiny_serve_args

pytestmark = [pytest.mark.ray, pytest.mark.slow]
APP = "slimserve-drain"
TOKENS = 3000  # a few seconds of tokens: the replacement lands mid-stream


def _stream(url: str, out: dict) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        out["lines"] = [line for line in r.iter_lines() if line.startswith("data: ")]


def test_a_direct_stream_outlives_its_replicas_replacement(ray_session, checkpoint_factory):
    """Seen failing (the stream ended with an in-band server error) without the drain."""
    model = checkpoint_factory("llama", max_position_embeddings=8192)
    args = tiny_serve_args(model, mode="colocated")
    with running_app(ray_session, args, name=APP) as url:
        engine = serve.get_deployment_handle("EngineServer", APP)
        before = engine.stats.remote().result()
        out: dict = {}
        client = threading.Thread(target=_stream, args=(url, out))
        client.start()
        time.sleep(1.0)  # streaming by now
        assert engine.stats.remote().result()["direct_calls"] == before["direct_calls"] + 1
        # New args replace every replica; the old engine replica is stopped while it streams.
        serve.run(build_app({**args, "served_model_name": "tiny-v2"}), name=APP, route_prefix="/")
        client.join(timeout=120)
        new = serve.get_deployment_handle("EngineServer", APP).stats.remote().result()
    lines = out["lines"]
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    usage = httpx.Response(200, content=lines[-2][6:]).json()["usage"]
    assert usage["completion_tokens"] == TOKENS
    assert new["name"] != before["name"]  # the replica was replaced meanwhile
