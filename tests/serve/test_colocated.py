"""Colocated mode (one EngineServer) and backpressure: 429 + Retry-After when full."""

import asyncio

import httpx
import openai
import pytest

from app import LLM, SamplingParams
from serve.apps import running_app, tiny_serve_args

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def url(ray_session, tiny_model):
    args = tiny_serve_args(
        tiny_model,
        mode="colocated",
        engine={"dtype": "float32"},
        max_ongoing_requests=1,
        max_queued_requests=1,
        retry_after_s=2,
    )
    with running_app(ray_session, args) as u:
        yield u


def test_colocated_matches_offline_llm(url, tiny_model):
    llm = LLM(tiny_model, dtype="float32", device="cpu", kv_cache_dtype="fp8_e4m3")
    prompt = "hello world, the quick brown fox"
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == len(want.token_ids)


def test_overload_gets_429_with_retry_after_and_recovers(url):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 300, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            posts = [client.post(url + "/v1/completions", json=body) for _ in range(6)]
            return await asyncio.gather(*posts)

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
    busy = next(r for r in responses if r.status_code == 429)
    assert busy.headers["retry-after"] == "2"
    assert busy.json()["error"]["type"] == "rate_limit_error"
    ok = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # the rejected requests left nothing behind
