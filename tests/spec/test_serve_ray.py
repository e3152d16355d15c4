"""Speculation in both Serve modes: the decode (or colocated) replica speculates with the
n-gram proposer given in EngineArgs.speculative_config, the prefill replica does not, and
the served output is exactly what an offline engine without speculation makes: greedy
text and logprobs, and seeded sampled text. The two apps run one after the other on the
session's Ray (they share the port)."""

import httpx
import pytest
from ray import serve
from serve.apps import running_app, tiny_serve_args

from app import LLM, SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = [[7, 8, 9, 7, 8, 9, 7, 8], [5, 17, 42, 99, 3, 250, 7, 8, 19, 200, 31]]
CASES = [  # (request fields, SamplingParams fields beyond the request's)
    {"temperature": 0, "max_tokens": 24, "logprobs": 1},
    {"temperature": 0.8, "top_p": 0.9, "seed": 1234, "max_tokens": 16},
]
# Its own app name: the metrics test (tests/ops) reads the series of the app "slimserve".
APP = "slimserve-spec"
# cost_aware off: the cost policy could pause speculation on a slow machine
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "cost_aware": False,
}


def _served(url: str) -> list[dict]:
    out = []
    for case in CASES:
        for prompt in PROMPTS:
            body = {"model": "tiny", "prompt": prompt, "ignore_eos": True, **case}
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            logprobs = choice["logprobs"]["token_logprobs"] if case.get("logprobs") else None
            out.append({"text": choice["text"], "logprobs": logprobs})
    return out


def _offline(model: str) -> list[dict]:
    llm = LLM(model, dtype="float32", device="cpu", kv_cache_dtype="fp8_e4m3")
    out = []
    for case in CASES:
        p = SamplingParams(ignore_eos=True, **case)
        for o in llm.generate(PROMPTS, p):
            logprobs = [x.logprob for x in o.logprobs] if case.get("logprobs") else None
            out.append({"text": o.text, "logprobs": logprobs})
    return out


def _same(got: list[dict], want: list[dict]) -> None:
    assert [g["text"] for g in got] == [w["text"] for w in want]
    for g, w in zip(got, want):
        if w["logprobs"] is not None:
            assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4)


def _stats(deployment: str) -> dict:
    return serve.get_deployment_handle(deployment, APP).stats.remote().result()


def test_decode_replica_speculates_and_output_equals_plain_decoding(ray_session, llama_path):
    """Seen failing: with the replicas' engine config dropping speculative_config
    (app/serve/replicas/replica.py), the decode stats had no spec counters (KeyError) although the
    texts still matched."""
    want = _offline(llama_path)
    engine = {"dtype": "float32", "speculative_config": NGRAM}
    # Every prompt through the prefill replica: the decode replica speculates from the
    # prefill's first token (a short prompt prefilled locally runs as colocated does)
    args = tiny_serve_args(llama_path, local_prefill_max_tokens=0, engine=engine)
    with running_app(ray_session, args, APP) as url:
        _same(_served(url), want)
        decode, prefill = _stats("DecodeServer"), _stats("PrefillServer")
    assert 0 < decode["spec_accepted_tokens"] < decode["spec_proposed_tokens"]
    assert prefill["spec_proposed_tokens"] == 0  # prefill-only requests never speculate
    args = tiny_serve_args(llama_path, mode="colocated", engine=engine)
    with running_app(ray_session, args, APP) as url:
        _same(_served(url), want)
        colocated = _stats("EngineServer")
    assert 0 < colocated["spec_accepted_tokens"] < colocated["spec_proposed_tokens"]
