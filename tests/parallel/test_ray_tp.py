"""A TP=2 Serve replica (worker rank as a Ray actor in the replica's placement group) serves
HTTP requests like the offline engine; killing its worker fails the health check, Serve
replaces the replica, and later requests succeed."""

import time

import httpx
import pytest
from serve.apps import running_app, tiny_serve_args

from app import LLM, SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]
PROMPT = "hello world, the quick brown fox"


def _complete(url: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def _workers(ray) -> dict[str, str]:
    named = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"]: a["namespace"] for a in named if a["name"].startswith("slimserve-tp:")}


def test_tp2_replica_serves_and_is_replaced_when_a_worker_dies(ray_session, checkpoint_factory):
    ray = ray_session
    model = checkpoint_factory("llama")
    want = (
        LLM(model, dtype="float32", device="cpu", kv_cache_dtype="fp8_e4m3")
        .generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0]
        .text
    )
    args = tiny_serve_args(
        model, mode="colocated", engine={"dtype": "float32", "tensor_parallel_size": 2}
    )
    with running_app(ray, args) as url:
        r = _complete(url)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        (name, namespace), *more = _workers(ray).items()
        assert not more
        ray.kill(ray.get_actor(name, namespace=namespace))

        deadline, replaced = time.monotonic() + 180, False
        while time.monotonic() < deadline and not replaced:
            time.sleep(2)
            names = set(_workers(ray))
            replaced = bool(names) and name not in names
        assert replaced, "Serve did not replace the replica whose worker died"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                r = _complete(url)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
