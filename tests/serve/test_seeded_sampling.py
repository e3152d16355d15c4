"""Seeded sampling gives the same tokens offline, colocated and disaggregated (issue 14).

The noise is keyed by (seed, position), the ingress picks a seed when the client gives none,
and the decode replica counts the prefill replica's first token as an output (penalties).
The two apps run one after the other on the session's Ray (they share the port)."""

import httpx
import pytest

from app import LLM, SamplingParams
from serve.apps import running_app, tiny_serve_args

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 19, 200, 31]
PENALTIES = {"presence_penalty": 1.0, "frequency_penalty": 1.0}
CASES = [
    {"temperature": 0.8, "top_p": 0.9, "seed": 1234, **PENALTIES},
    {"temperature": 0, **PENALTIES},
    {"temperature": 1.0, "top_k": 20, "seed": 5, "n": 2},
]


def _served(url: str) -> list[list[str]]:
    out = []
    for case in CASES:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "ignore_eos": True, **case}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        out.append([c["text"] for c in choices])
    return out


def _offline(model: str) -> list[list[str]]:
    llm = LLM(model, dtype="float32", device="cpu", kv_cache_dtype="fp8_e4m3")
    out = []
    for case in CASES:
        case = dict(case)
        n, seed = case.pop("n", 1), case.pop("seed", None)
        texts = []
        for i in range(n):  # choice i of a seeded request uses seed + i
            p = SamplingParams(max_tokens=10, ignore_eos=True, seed=seed and seed + i, **case)
            texts.append(llm.generate([PROMPT], p)[0].text)
        out.append(texts)
    return out


def test_offline_colocated_and_disaggregated_sample_the_same_tokens(ray_session, tiny_model):
    """Offline, colocated and disaggregated runs give the same texts for the same seed.

    Limit: with the decode replica counting the first token as prompt (the penalty hand-off
    broken) this test still passed on the tiny model (its 10 tokens never revisit the first
    one); that hand-off is proven by tests/engine/test_sampling.py::
    test_handoff_from_another_replica_continues_the_same_tokens, which fails then."""
    want = _offline(tiny_model)
    engine = {"dtype": "float32"}
    # Every prompt through the prefill replica, which samples the first token (a prompt
    # prefilled on its decode replica: tests/serve/disaggregated/test_disaggregation.py)
    args = tiny_serve_args(tiny_model, local_prefill_max_tokens=0, engine=engine)
    with running_app(ray_session, args) as url:
        disaggregated = _served(url)
        unseeded = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 1.0}
        assert httpx.post(url + "/v1/completions", json=unseeded, timeout=120).status_code == 200
    with running_app(
        ray_session, tiny_serve_args(tiny_model, mode="colocated", engine=engine)
    ) as url:
        colocated = _served(url)
    assert disaggregated == want
    assert colocated == want
