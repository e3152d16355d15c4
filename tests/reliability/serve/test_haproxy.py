"""`slimserve serve --proxy haproxy` (the default): HAProxy in front of the Ingress replica's
own HTTP and gRPC servers (Ray Serve's direct ingress), in its own process and Ray.

The OpenAI client and a grpcio client get the undisturbed (offline) greedy text; a gRPC
cancel, a gRPC deadline alone (no `timeout_s`) and an HTTP disconnect each free every block
within ABORT_BOUND_S of a request that would run for tens of seconds; and a crowd of short
deadlines and cancels, which leaves requests running behind Serve's Python gRPC proxy
(`--proxy serve`, docs/reliability.md), leaves none. `-m long` repeats the module with
`--proxy serve`, where the crowd is expected to leak (it xfails then, naming the proxy).
"""

from __future__ import annotations

import time
from collections import Counter

import grpc
import httpx
import openai
import pytest
from serve.apps import tiny_serve_args

from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb
from reliability.conftest import LONG_TOKENS
from reliability.serve.apps import offline_texts, prompts
from reliability.serve.cli_server import cli_server
from reliability.serve.clients import run_all

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ABORT_BOUND_S = 10.0
TOKENS = 24  # the equality checks
CROWD, CROWD_WORKERS = 36, 6


@pytest.fixture(scope="module", params=["haproxy", pytest.param("serve", marks=pytest.mark.long)])
def server(request, long_model):
    args = tiny_serve_args(long_model, mode="colocated", engine={"dtype": "float32"})
    # stopped as `timeout` stops a command: HAProxy, whose actor dies with the group's
    # raylet, must not outlive it (app/serve/reaper.py)
    with cli_server(args, request.param, group_stop=True) as s:
        s.proxy = request.param
        yield s


@pytest.fixture(scope="module")
def want(long_model):
    return offline_texts(long_model, prompts(2, seed=3), TOKENS)


def wait_idle(server, timeout_s: float = ABORT_BOUND_S) -> pb.HealthResponse:
    """Nothing runs or waits on the engine replica and every KV block is free."""
    end = time.monotonic() + timeout_s
    while True:
        s = server.engine_stats()
        if s.num_running == s.num_waiting == 0 and s.kv_blocks_free == s.kv_blocks_total:
            return s
        assert time.monotonic() < end, f"still held {timeout_s} s later: {s}"
        time.sleep(0.1)


def long_request(prompt: list[int], max_tokens: int = LONG_TOKENS) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


def test_openai_client_gets_the_offline_text(server, want):
    """Compared with the offline LLM (same FP8 KV, greedy), which the rest of the suite
    shows the default-proxy app equals; streamed and not."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kw = {"model": "tiny", "max_tokens": TOKENS, "temperature": 0}
    kw["extra_body"] = {"ignore_eos": True}
    for prompt, text in zip(prompts(2, seed=3), want):
        got = client.completions.create(prompt=prompt, **kw)
        assert (got.choices[0].text, got.choices[0].finish_reason) == (text, "length")
        chunks = client.completions.create(prompt=prompt, stream=True, **kw)
        assert "".join(c.choices[0].text for c in chunks) == text


def test_grpc_client_gets_the_offline_text(server, want):
    req = long_request(prompts(2, seed=3)[1], TOKENS)
    msgs = list(server.stub.Generate(req, timeout=60))
    assert "".join(m.text for m in msgs) == want[1]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    wait_idle(server)


def started_long_call(server, **kw):
    """A 6,000-token gRPC stream that has produced 3 messages; the engine holds its blocks."""
    call = server.stub.Generate(long_request(prompts(1, seed=7)[0]), **kw)
    for _ in range(3):
        next(call)
    busy = server.engine_stats()
    assert busy.num_running == 1 and busy.kv_blocks_free < busy.kv_blocks_total
    return call


def test_grpc_cancel_frees_blocks(server):
    """Seen failing with AsyncEngine's abort command made a no-op (blocks held 10 s later),
    as were the deadline and disconnect tests run alone, and the crowd (held 120 s later).
    Behind Serve's Python proxy the same cancel is not always passed on (the crowd below)."""
    call = started_long_call(server, timeout=120)
    call.cancel()
    assert call.code() == grpc.StatusCode.CANCELLED
    wait_idle(server)


def test_grpc_deadline_alone_frees_blocks(server):
    """The gRPC deadline only (no GenerateRequest.timeout_s). Seen failing with
    AsyncEngine's abort command made a no-op (blocks held 10 s later)."""
    call = started_long_call(server, timeout=3.0)
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(server)


def test_http_disconnect_frees_blocks(server):
    """Seen failing with AsyncEngine's abort command made a no-op (blocks held 10 s later)."""
    body = {"model": "tiny", "prompt": prompts(1, seed=8)[0], "max_tokens": LONG_TOKENS}
    body |= {"ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        events = (line for line in r.iter_lines() if line.startswith("data: {"))
        for _ in range(3):
            next(events)
        busy = server.engine_stats()
    assert busy.num_running == 1 and busy.kv_blocks_free < busy.kv_blocks_total
    wait_idle(server)


def crowd_call(server, i: int) -> str:
    """Half cancelled after 1-3 messages, half cut by a 0.2 / 0.5 s gRPC deadline only."""
    req = long_request(prompts(1, seed=100 + i)[0], 2000)
    try:
        if i % 2:
            for _ in server.stub.Generate(req, timeout=(0.2, 0.5)[i % 4 == 1]):
                pass
            return "finished"
        call = server.stub.Generate(req, timeout=120)
        for _ in range(1 + i % 3):
            next(call)
        call.cancel()
        return "cancelled"
    except grpc.RpcError as e:
        return e.code().name


def test_a_crowd_of_cancels_and_deadlines_leaves_nothing_running(server):
    """36 calls for 2,000 ignore_eos tokens, 6 at a time, each cancelled or cut by a short
    deadline; nothing may run 10 s after the last. Behind Serve's Python gRPC proxy this
    leaked (the `serve` param, and by hand: 60 calls left 3, 6 and 22 requests running for
    20-30 s); through HAProxy the cancel reaches the Ingress replica's own gRPC server."""
    got = Counter(run_all([lambda i=i: crowd_call(server, i) for i in range(CROWD)], 6))
    assert set(got) <= {"cancelled", "DEADLINE_EXCEEDED"}, got
    try:
        wait_idle(server)
    except AssertionError:
        wait_idle(server, 120)  # what leaked ends on its own; the module ends clean
        if server.proxy == "serve":
            pytest.xfail("Serve's Python gRPC proxy dropped cancels (docs/reliability.md)")
        raise
