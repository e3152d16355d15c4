"""Disaggregated serving (Ingress -> PrefillServer -> DecodeServer + KV store) under abort
and faults. One app for the module; the destructive fault tests run last.

Abort tests use requests that cannot end on their own while the test waits: ignore_eos
and 6,000 max_tokens (the tiny model streams a few hundred tokens a second here, so the
request would run for tens of seconds), and require every block free within ABORT_BOUND_S.
"""

import asyncio
import threading

import grpc
import httpx
import numpy as np
import pytest
import ray

from app.kv.chunk import KVChunk
from app.kvstore.store import KVStoreClient
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb
from app.serve.replicas.replica import prompt_chunk_keys
from reliability.conftest import LONG_TOKENS
from reliability.serve.apps import kill_replica, offline_texts, prompts, served_app, wait_until
from reliability.serve.clients import (
    grpc_stream,
    http_stream,
    idle_after_grpc_cancel,
    run_all,
    tally,
    wait_idle,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "rel-disagg"
STORE = "rel-disagg-kv"
ABORT_BOUND_S = 10.0
STREAMS = 16  # in flight when a fault strikes: half HTTP, half gRPC
FAULT_TOKENS = 160
PHASES = ("PrefillServer", "DecodeServer")


STORE_BYTES = 16 << 20


@pytest.fixture(scope="module")
def app(ray_session, long_model):
    with served_app(
        ray_session,
        long_model,
        APP,
        PHASES,
        store_name=STORE,
        store_capacity_bytes=STORE_BYTES,
    ) as a:
        yield a


@pytest.fixture(scope="module")
def fault_load(long_model):
    batch = prompts(STREAMS, seed=7)
    return batch, offline_texts(long_model, batch, FAULT_TOKENS)


def all_idle(app):
    """Every phase idle within ABORT_BOUND_S; if not, the failure is reported after whatever
    is still running has ended, so that the tests after this one start clean."""
    try:
        for name in PHASES:
            wait_idle(app[name], ABORT_BOUND_S)
    except AssertionError:
        for name in PHASES:
            wait_idle(app[name], 180)
        raise


def test_http_disconnect_frees_blocks(app):
    """Seen failing: with AsyncEngine's abort command made a no-op, the decode replica still
    ran the request and held its blocks 10 s after the client left (as did the two below)."""
    body = {"model": "tiny", "prompt": prompts(1)[0], "max_tokens": LONG_TOKENS}
    body |= {"ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", app["url"] + "/v1/completions", json=body, timeout=60) as r:
        events = (line for line in r.iter_lines() if line.startswith("data: {"))
        for _ in range(3):
            next(events)
        busy = app["DecodeServer"].stats.remote().result()
    assert busy["num_running"] == 1 and busy["kv_blocks_free"] < busy["kv_blocks_total"]
    all_idle(app)


def long_grpc_call(app, timeout_s: float = 0.0, **kw):
    sampling = pb.SamplingParams(max_tokens=LONG_TOKENS, temperature=0, ignore_eos=True)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts(1)[0]), sampling=sampling)
    req.timeout_s = timeout_s  # 0: none
    return app["stub"].Generate(req, metadata=app["md"], **kw)


def test_grpc_deadline_frees_blocks(app):
    """Seen failing with the engine abort removed (blocks held 10 s past the deadline).

    The deadline is also sent as `GenerateRequest.timeout_s`, the documented way to get a
    guaranteed abort: with the gRPC deadline alone, Serve's gRPC proxy sometimes does not
    cancel the ingress (open defect, docs/reliability.md; `-m long -k crowd` reproduces it),
    which made this test intermittent under load."""
    with pytest.raises(grpc.RpcError) as e:
        for _ in long_grpc_call(app, timeout_s=1.5, timeout=1.5):
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    all_idle(app)


def tamper(store: KVStoreClient, victim: bytes, other: bytes, how: str) -> None:
    """Rewrite the stored chunk `victim` through the store's API, using the sound chunk
    `other` (faults as in tests/reliability/kvstore/faults.py, also proven there at the
    engine level)."""
    a, b = asyncio.run(store.get(victim)), asyncio.run(store.get(other))
    buf_a, buf_b = bytes(ray.get(a.ref)), bytes(ray.get(b.ref))
    tag, ids = a.tag, list(a.token_ids)  # the store's record stays as it was...
    if how == "flip":
        bad = bytearray(buf_a)
        bad[-7] ^= 0x10
    elif how == "truncate":
        bad = buf_a[: len(buf_a) // 2]
    elif how == "swap":  # A's valid header (its tag too) over B's payload of the same size
        payload = KVChunk.decode(buf_a).payload
        bad = buf_a[: len(buf_a) - len(payload)] + bytes(KVChunk.decode(buf_b).payload)
    else:  # "other_key": ...except here: a sound chunk and its record, filed under A's key
        bad, tag, ids = buf_b, b.tag, list(b.token_ids)
    asyncio.run(store.drop(victim, "test"))
    asyncio.run(store.put(victim, np.frombuffer(bytes(bad), dtype=np.uint8), tag, ids))


@pytest.mark.parametrize("how", ["flip", "truncate", "swap", "other_key"])
def test_chunk_fault_is_detected_counted_and_recomputed(app, long_model, how):
    """Served end to end: a damaged or misfiled chunk in the store is caught before use
    (by whichever replica fetches it first), dropped, counted as an integrity failure, and
    recomputed: the answer is the undisturbed text. Chunk 1 of 3 is damaged; swap uses
    chunk 2, other_key chunk 1 of a prompt with another first chunk (same tokens and
    position, other KV and key).

    Seen failing: with the tag comparison in KVChunk.decode skipped, flip and swap (not
    counted); with fetch_verified not passing `expected_key`, other_key (not counted; the
    decode engine's own key check then refused it). Truncation is caught by the payload
    length check and the tag alike (tests/reliability/kvstore/test_chunk_faults.py)."""
    seed = {"flip": 1, "truncate": 2, "swap": 3}.get(how, 4)
    prompt, head = prompts(1, length=100, seed=seed)[0], prompts(1, length=32, seed=seed + 9)[0]
    (want, other_want) = offline_texts(long_model, [prompt, head + prompt[32:]], 8)
    info = app["PrefillServer"].describe.remote().result()
    keys, other_keys = (
        prompt_chunk_keys(p, info["salt_base"], None, 16, 32) for p in (prompt, head + prompt[32:])
    )
    assert http_stream(app["url"], prompt, 8).kind(want) == "correct"  # publishes 3 chunks
    if how == "other_key":
        assert http_stream(app["url"], head + prompt[32:], 8).kind(other_want) == "correct"
    store = KVStoreClient.from_name(STORE, 1)
    tamper(store, keys[1], other_keys[1] if how == "other_key" else keys[2], how)
    before = asyncio.run(store.stats())["integrity_failures"]
    assert http_stream(app["url"], prompt, 8).kind(want) == "correct"
    assert asyncio.run(store.stats())["integrity_failures"] == before + 1
    all_idle(app)


def under_fault(app, fault_load, strike):
    """STREAMS streams; `strike()` once most are decoding -> tally of their outcomes."""
    batch, wants = fault_load
    calls = [
        (lambda p=p: http_stream(app["url"], p, FAULT_TOKENS))
        if i % 2 == 0
        else (lambda p=p: grpc_stream(app["stub"], p, FAULT_TOKENS, app["md"]))
        for i, p in enumerate(batch)
    ]
    result = {}
    runner = threading.Thread(target=lambda: result.update(out=run_all(calls)))
    runner.start()
    decode = app["DecodeServer"]

    def decoding():
        s = decode.stats.remote().result(timeout_s=30)
        return s["num_running"] + s["num_waiting"] >= STREAMS // 2

    wait_until(decoding, 60, "streams decoding")
    strike()
    runner.join(180)
    assert not runner.is_alive(), "a stream hung after the fault"
    counts = tally(result["out"], wants)
    print(f"fault outcomes: {dict(counts)}")  # docs/reliability.md quotes these
    return counts


def recovered(app, fault_load, n: int = 4):
    """The next requests (both APIs) succeed with the undisturbed text, within 120 s."""
    batch, wants = fault_load
    wait_until(lambda: http_stream(app["url"], batch[0], 4).error is None, 120, "first success")
    calls = [lambda i=i: http_stream(app["url"], batch[i], FAULT_TOKENS) for i in range(n)]
    calls += [
        lambda i=i: grpc_stream(app["stub"], batch[i], FAULT_TOKENS, app["md"]) for i in range(n)
    ]
    outs = run_all(calls)
    assert tally(outs, wants[:n] * 2) == {"correct": 2 * n}, [o.error for o in outs]


@pytest.mark.long
@pytest.mark.parametrize("deployment", ["DecodeServer", "PrefillServer"])
def test_replica_killed_mid_stream(app, fault_load, deployment):
    """Every stream ends with the undisturbed text or a clean retriable error; Serve
    replaces the replica and the next requests are correct."""
    counts = under_fault(app, fault_load, lambda: kill_replica(APP, deployment))
    assert counts["wrong"] == 0 and sum(counts.values()) == STREAMS
    recovered(app, fault_load)
    all_idle(app)


def test_store_shard_killed_mid_stream_is_recreated(app, fault_load):
    """Seen failing before the fix (app/kvstore/store.py recreates a dead shard): every
    request after the kill was a 503 'unavailable' for as long as we waited."""
    shard = ray.get_actor(f"{STORE}-0", namespace="slimserve")
    counts = under_fault(app, fault_load, lambda: ray.kill(shard, no_restart=True))
    assert counts["wrong"] == 0 and sum(counts.values()) == STREAMS
    recovered(app, fault_load)
    stats = KVStoreClient.from_name(STORE, 1)
    assert ray.get(stats.shards[0].stats.remote())["puts"] > 0  # the new shard is in use
    all_idle(app)


def test_grpc_cancel_frees_blocks(app):
    """Last in the module: a cancel that does not abort leaves a request running for long.
    Seen failing with the engine abort removed (the request ran on, blocks held). Where
    Serve's gRPC proxy dropped the cancel (upstream, intermittent) it xfails saying so."""
    call = long_grpc_call(app)
    for _ in range(3):
        next(call)
    call.cancel()
    assert call.code() == grpc.StatusCode.CANCELLED
    idle_after_grpc_cancel(APP, [app[name] for name in PHASES], ABORT_BOUND_S)
