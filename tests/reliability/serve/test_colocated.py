"""Colocated serving (one EngineServer) under abort and at volume of bad input.

Abort: requests that cannot end on their own (ignore_eos, 6,000 max_tokens) must free every
block within ABORT_BOUND_S of a disconnect, cancel or deadline. Fuzz: malformed and extreme
requests over HTTP and gRPC get only 2xx/4xx (INVALID_ARGUMENT-class) answers; the server is
healthy and holds no block afterwards. `make test` runs a slice; `-m long` runs >= 10,000.
"""

from collections import Counter

import grpc
import httpx
import pytest
from hypothesis import strategies as st

from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb
from reliability.conftest import LONG_TOKENS
from reliability.serve.apps import offline_texts, prompts, served_app
from reliability.serve.clients import idle_after_grpc_cancel, run_all, wait_idle
from reliability.serve.fuzz import RAW_BODIES, chat_body, completion_body, grpc_request
from reliability.serve.fuzzing import fuzz, grpc_check, grpc_raw_check, http_check
from reliability.serve.load import KINDS, cluster_rss, grpc_deadline, overload, soak
from reliability.serve.schema_fuzz import schema_fuzz

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "rel-colocated"
ABORT_BOUND_S = 10.0
# Examples per fuzz test: (make test, make test-long); the long run totals >= 10,000.
FAST, LONG = 60, 2500
# schemathesis cases per generation mode (positive, negative) against /openapi.json.
SCHEMA_FAST, SCHEMA_LONG = 100, 2500


# Small admission limits, so that overload is reachable on two cores: what Serve admits per
# replica (running + queued) is the sustainable concurrency here.
LIMITS = {"max_ongoing_requests": 8, "max_queued_requests": 8}
SUSTAINABLE = 8
LOAD_TOKENS = 16


@pytest.fixture(scope="module")
def app(ray_session, long_model):
    with served_app(
        ray_session, long_model, APP, ("EngineServer",), mode="colocated", **LIMITS
    ) as a:
        yield a


@pytest.fixture(scope="module")
def load_set(long_model):
    batch = prompts(8, seed=5)
    return batch, offline_texts(long_model, batch, LOAD_TOKENS)


def idle(app):
    return wait_idle(app["EngineServer"], ABORT_BOUND_S)


def test_http_disconnect_frees_blocks(app):
    """Seen failing with AsyncEngine's abort command made a no-op (blocks held 10 s later)."""
    body = {"model": "tiny", "prompt": prompts(1)[0], "max_tokens": LONG_TOKENS}
    body |= {"ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", app["url"] + "/v1/completions", json=body, timeout=60) as r:
        events = (line for line in r.iter_lines() if line.startswith("data: {"))
        for _ in range(3):
            next(events)
        busy = app["EngineServer"].stats.remote().result()
    assert busy["num_running"] == 1 and busy["kv_blocks_free"] < busy["kv_blocks_total"]
    idle(app)


def long_call(app, timeout_s: float = 0.0, **kw):
    sampling = pb.SamplingParams(max_tokens=LONG_TOKENS, temperature=0, ignore_eos=True)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts(1)[0]), sampling=sampling)
    req.timeout_s = timeout_s  # 0: none
    return app["stub"].Generate(req, metadata=app["md"], **kw)


def test_grpc_deadline_frees_blocks(app):
    """Seen failing with AsyncEngine's abort command made a no-op (blocks held 10 s later).

    The deadline is also sent as `GenerateRequest.timeout_s`, the documented way to get a
    guaranteed abort: with the gRPC deadline alone, Serve's gRPC proxy sometimes does not
    cancel the ingress (open defect, docs/reliability.md; `-m long -k crowd` reproduces it),
    which made this test intermittent under load."""
    with pytest.raises(grpc.RpcError) as e:
        for _ in long_call(app, timeout_s=1.5, timeout=1.5):
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    idle(app)


HTTP_CASES = st.one_of(
    st.tuples(st.just("/v1/completions"), completion_body()),
    st.tuples(st.just("/v1/chat/completions"), chat_body()),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), RAW_BODIES),
)
GRPC_CASES = st.tuples(grpc_request(), st.booleans())


def after_fuzz(app, tally: Counter) -> None:
    answers = {k: v for k, v in tally.items() if not str(k).startswith("why")}
    reasons = sorted(((v, k) for k, v in tally.items() if str(k).startswith("why")), reverse=True)
    print(f"fuzz answers: {answers}; top 4xx reasons: {reasons[:6]}")  # docs/reliability.md
    assert httpx.get(app["url"] + "/health", timeout=10).status_code == 200
    idle(app)


def run_http(app, examples):
    tally: Counter = Counter()
    with httpx.Client(base_url=app["url"], timeout=60) as client:
        fuzz(HTTP_CASES, http_check(client, tally), examples)
    after_fuzz(app, tally)


def run_grpc(app, examples):
    tally: Counter = Counter()
    fuzz(GRPC_CASES, grpc_check(app["stub"], app["md"], tally), examples)
    fuzz(st.binary(max_size=80), grpc_raw_check(app["channel"], app["md"], tally), examples // 4)
    after_fuzz(app, tally)


def test_http_fuzz_slice(app):
    run_http(app, FAST)


def test_grpc_fuzz_slice(app):
    run_grpc(app, FAST)


@pytest.mark.long
def test_http_fuzz_long(app):
    run_http(app, 3 * LONG)


@pytest.mark.long
def test_grpc_fuzz_long(app):
    run_grpc(app, LONG)


def run_schema(app, examples):
    tally = schema_fuzz(app["url"], "tiny", examples)
    after_fuzz(app, tally)
    for route in ("POST /v1/completions", "POST /v1/chat/completions"):
        assert tally[("positive", route, 200)] > 0, tally  # schema-made bodies reached the engine


def test_openapi_schemathesis_slice(app):
    """Seen failing without the routes' bodies in the schema (schemathesis: ST103
    undocumented status code, for the 400s the bodiless cases got)."""
    run_schema(app, SCHEMA_FAST)


@pytest.mark.long
def test_openapi_schemathesis_long(app):
    run_schema(app, SCHEMA_LONG)


def check_overload(app, load_set, seconds: float) -> dict:
    batch, wants = load_set
    rss0 = cluster_rss()
    got = overload(app, batch, wants, LOAD_TOKENS, 4 * SUSTAINABLE, seconds)
    idle(app)
    got["rss_growth_mib"] = round((cluster_rss() - rss0) / 2**20, 1)
    print(f"overload 4x for {seconds} s: {got}")  # docs/reliability.md quotes these
    tally = got["tally"]
    assert tally.get("wrong", 0) == 0 and tally.get("correct", 0) > 0, got
    return got


def test_overload_slice(app, load_set):
    """4x the admitted concurrency for a few seconds: admitted requests are correct, the rest
    are refused cleanly, nothing is held afterwards."""
    check_overload(app, load_set, 5)


@pytest.mark.long
def test_overload_60s(app, load_set):
    check_overload(app, load_set, 60)


def check_soak(app, load_set, total: int, kinds=KINDS) -> dict:
    batch, wants = load_set
    long_prompt = prompts(1, length=380, seed=99)[0]
    soak(app, batch[:2], wants[:2], long_prompt, LOAD_TOKENS, 8, workers=4)  # warm up
    rss0 = cluster_rss()
    tally = soak(app, batch, wants, long_prompt, LOAD_TOKENS, total, workers=6, kinds=kinds)
    print(f"soak {total}: {dict(tally)}")  # docs/reliability.md
    try:
        idle(app)
    except AssertionError as e:  # report what was held, let it drain, then fail
        drained = wait_idle(app["EngineServer"], 120)
        print(f"soak {total}: {e}; all free after draining: {drained}")
        raise
    finally:
        growth = round((cluster_rss() - rss0) / 2**20, 1)
        print(f"soak {total}: rss +{growth} MiB")
    counted = sum(v for k, v in tally.items() if not k.startswith("detail"))
    assert tally.get("wrong", 0) == 0 and counted == total, tally
    return {"tally": tally, "rss_growth_mib": growth}


def test_soak_slice(app, load_set):
    """Mixed requests (both APIs, streaming, cancelled, n=2, long prompts): none wrong,
    every block free after. Without gRPC deadlines: those sometimes leave a request running
    (open defect, docs/reliability.md), which the long soak and the long crowd test expose."""
    check_soak(app, load_set, 40, kinds=tuple(k for k in KINDS if k != "deadline"))


@pytest.mark.long
def test_soak_2000(app, load_set):
    """RSS bound: the whole local cluster may grow by at most 256 MiB over 2,000 requests."""
    got = check_soak(app, load_set, 2000)
    assert got["rss_growth_mib"] < 256


@pytest.mark.long
@pytest.mark.parametrize("in_request", [False, True], ids=["grpc_deadline", "timeout_s"])
@pytest.mark.parametrize("deadline_s", [0.2, 0.5])
def test_grpc_deadlines_in_a_crowd_free_blocks(app, deadline_s, in_request):
    """60 gRPC calls (6 at a time) for 2,000 ignore_eos tokens, each with a short deadline:
    every one ends DEADLINE_EXCEEDED and nothing may run 10 s later.

    With only the gRPC deadline this is known to fail (open defect, found by the 2,000-request
    soak, docs/reliability.md): a few requests run until they end on their own (~20-30 s)
    because Serve's gRPC proxy did not cancel the ingress's Generate at the deadline. With
    the deadline also sent as GenerateRequest.timeout_s the ingress ends the call itself."""
    batch = prompts(8, seed=5)
    calls = [
        lambda i=i: grpc_deadline(app, batch[i % 8], deadline_s, in_request) for i in range(60)
    ]
    assert set(run_all(calls, workers=6)) == {"deadline"}
    try:
        idle(app)
    finally:  # whatever leaked ends on its own; let the tests after this one start clean
        wait_idle(app["EngineServer"], 120)


def test_grpc_cancel_frees_blocks(app):
    """Last in the module: a cancel that does not abort leaves a request running for long.
    Seen failing before serve's gRPC cancel fix (cd335e4: the colocated request kept its
    blocks 10 s after the cancel) and with AsyncEngine's abort command made a no-op. Where
    Serve's gRPC proxy dropped the cancel (upstream, intermittent) it xfails saying so."""
    call = long_call(app)
    for _ in range(3):
        next(call)
    call.cancel()
    assert call.code() == grpc.StatusCode.CANCELLED
    idle_after_grpc_cancel(APP, [app["EngineServer"]], ABORT_BOUND_S)
