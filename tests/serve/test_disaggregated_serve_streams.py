"""Disaggregated with `delta_channel: serve` (every delta a Serve stream item, for clusters
where replicas cannot reach the ingress's node): a prompt through the prefill replica and
one prefilled on its decode replica, unary and streamed, give the offline engine's text.
The default (`socket`) is covered by disaggregated/test_disaggregation.py."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from app import LLM, SamplingParams
from serve.apps import running_app, tiny_serve_args

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return checkpoint_factory("llama")


def text(url: str, prompt: list[int], stream: bool) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    out = ""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
    return out


def test_serve_streams_match_offline_through_both_paths(ray_session, model):
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 300, n)] for n in (70, 12)]  # remote, local
    offline = LLM(model, dtype="float32", device="cpu", kv_cache_dtype="fp8_e4m3")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want = [o.text for o in offline.generate(prompts, params)]
    args = tiny_serve_args(model, delta_channel="serve", engine={"dtype": "float32"})
    with running_app(ray_session, args) as url:
        for prompt, expected in zip(prompts, want):
            assert text(url, prompt, stream=False) == expected
            assert text(url, prompt, stream=True) == expected
