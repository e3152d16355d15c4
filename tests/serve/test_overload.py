"""Overload in disaggregated mode: refusals come as HTTP 429 / RESOURCE_EXHAUSTED before the
first byte, never as a 200 stream that ends in an in-band rate-limit error.

Two prefill replicas, one decode replica, each taking one request and queueing one: prefill
admits four streams, decode only two, so a burst overloads the decode phase *after* the
first token exists, where the refusal used to go in-band.
"""

import os
import sys
import threading

import grpc
import httpx
import pytest

from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2_grpc
from serve.apps import tiny_serve_args

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "grpc"))
from grpc_app import grpc_app, wait_until_idle  # noqa: E402
from reliability.serve.clients import idle_after_grpc_cancel  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "slimserve-overload"
MD = (("application", APP),)
BURST = 8
LONG = 4000  # tokens: nothing admitted ends while the burst is being answered


@pytest.fixture(scope="module")
def served(ray_session, checkpoint_factory):
    from ray import serve

    model = checkpoint_factory("llama", max_position_embeddings=8192)
    args = tiny_serve_args(
        model,
        engine={"dtype": "float32"},
        num_prefill_replicas=2,
        num_decode_replicas=1,
        local_prefill_max_tokens=0,  # every prompt through prefill, then decode admission
        max_ongoing_requests=1,
        max_queued_requests=1,
        retry_after_s=3,
        store_name="slimserve-overload-kv",
    )
    with grpc_app(ray_session, args, APP, MD) as (channel, url):
        decode = serve.get_deployment_handle("DecodeServer", APP)
        yield {"url": url, "channel": channel, "decode": decode}


def http_outcome(url: str, i: int, ready: threading.Barrier, out: dict) -> None:
    body = {"model": "tiny", "prompt": f"burst {i} hello world", "max_tokens": LONG}
    body |= {"ignore_eos": True, "stream": True, "temperature": 0}
    ready.wait()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            out[i] = (r.status_code, r.headers.get("retry-after"), r.text)
            return
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 3:  # three tokens: the decode replica is streaming it
                break
        out[i] = (200, None, "\n".join(events))  # leaving closes the stream: abort


def test_http_overload_is_429_before_the_stream(served):
    """Seen failing before the ingress waited for the decode replica's admission: some
    answers were 200 streams whose second event was {"error": {"type": "rate_limit_error"}}."""
    out: dict[int, tuple] = {}
    ready = threading.Barrier(BURST)
    threads = [
        threading.Thread(target=http_outcome, args=(served["url"], i, ready, out))
        for i in range(BURST)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(status for status, _, _ in out.values())
    assert len(out) == BURST and set(codes) == {200, 429}, out
    for status, retry_after, text in out.values():
        if status == 429:
            assert retry_after == "3" and "rate_limit_error" in text
        else:
            assert "error" not in text, text
    wait_until_idle(served["decode"], 10)


def test_grpc_overload_is_resource_exhausted_before_the_first_message(served):
    """Seen failing like the HTTP test: some streams sent a token, then RESOURCE_EXHAUSTED."""
    stub = generation_pb2_grpc.GenerationStub(served["channel"])
    sampling = pb.SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True)
    calls = [
        stub.Generate(pb.GenerateRequest(text=f"grpc {i} hello", sampling=sampling), metadata=MD)
        for i in range(BURST)
    ]
    outcomes = []
    try:
        for call in calls:
            received = 0
            try:
                for _ in call:
                    received += 1
                    if received == 3:
                        break
                outcomes.append(("ok", received))
            except grpc.RpcError as e:
                outcomes.append((e.code(), received))
    finally:
        for call in calls:
            call.cancel()
    refused = [n for code, n in outcomes if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert refused and all(n == 0 for n in refused), outcomes
    assert {code for code, _ in outcomes} == {"ok", grpc.StatusCode.RESOURCE_EXHAUSTED}
    # The admitted streams end only by our cancel, which Serve's gRPC proxy (this session's
    # Ray runs it) sometimes drops: xfail naming that, fail on any other leak.
    idle_after_grpc_cancel(APP, [served["decode"]], 10)
