"""Disaggregated serving: store hits across prefill replicas, corruption, replica death,
client disconnects. Two prefill replicas, one decode replica, one store shard."""

import json
import time

import httpx
import pytest
import ray
from polling import eventually
from ray import serve

from app import SamplingParams
from app.kvstore.handoff import WAIT_S, HandOffs
from app.kvstore.transfer import fetch_verified
from app.serve.messages import DecodeRequest, GenerateRequest, HandOff, RoutingInfo
from app.serve.replicas.replica import prompt_chunk_keys
from serve.disaggregated.app_helpers import (
    LOCAL_LIMIT,
    MAX_TOKENS,
    all_stored,
    asyncio_run,
    complete,
    corrupt,
    expectation,
    prompt_ids,
    stats,
    stored,
    want_text,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_prefix_from_one_prefill_replica_is_a_store_hit_on_the_other(url, store, info, offline):
    cold, hit = [], []
    for seed in range(3):
        prompt = prompt_ids(seed)
        cold.append(complete(url, prompt, replica=0, stream=True))
        assert all_stored(store, info, prompt)
        before = stats(store)["hits"]
        hit.append(complete(url, prompt, replica=1, stream=True))
        assert eventually(lambda b=before: stats(store)["hits"] - b == 11)  # all usable chunks
        a, b = complete(url, prompt, replica=0), complete(url, prompt, replica=1)
        assert a["choices"][0]["text"] == b["choices"][0]["text"] == want_text(offline, prompt)
        where = (a["slimserve"]["choices"][0], b["slimserve"]["choices"][0])
        assert where[0]["prefill_replica"] != where[1]["prefill_replica"]
        assert where[1]["store_tokens"] == 0  # replica 1 now has it locally: no refetch
    print(f"TTFT cold {sorted(cold)} store-hit {sorted(hit)}")
    assert sorted(hit)[1] < sorted(cold)[1]  # medians


def test_a_client_that_leaves_after_the_first_token_leaves_the_prompt_kv_in_the_store(
    url, store, info
):
    """complete(stream=True) closes the connection at the first token, which goes out
    before the prefill replica publishes the KV: the Serve proxy cancels the ingress's
    call and Ray its child tasks, the prefill call among them, mid-publish. The computed
    prefix is still published. Seen failing (the 4th prompt: 3 of its 11 chunks stored;
    the race is lost for some prompts, hence eight) with PrefillServer._prefill awaiting
    the publish unshielded."""
    for seed in range(40, 48):
        prompt = prompt_ids(seed)
        complete(url, prompt, replica=0, stream=True)
        assert all_stored(store, info, prompt), (seed, stored(store, info, prompt))


@pytest.mark.parametrize("how", ["payload", "header"])
def test_corrupted_chunk_is_detected_counted_and_recomputed(url, store, info, offline, how):
    prompt = prompt_ids({"payload": 10, "header": 11}[how])
    complete(url, prompt, replica=0)  # publishes 11 chunks
    keys = prompt_chunk_keys(
        prompt, info["salt_base"], None, info["block_size"], info["chunk_tokens"]
    )
    corrupt(store, keys[4], how)
    before = stats(store)["integrity_failures"]
    r = complete(url, prompt, replica=1)
    assert r["choices"][0]["text"] == want_text(offline, prompt)
    assert stats(store)["integrity_failures"] == before + 1
    where = r["slimserve"]["choices"][0]
    assert where["store_failures"] == 1 and where["store_tokens"] == 4 * 32
    # The bad chunk was dropped and replica 1 published the one it recomputed: healed.
    healed = asyncio_run(store.match_prefix(keys))
    got = asyncio_run(fetch_verified(store, healed, expectation(info), prompt))
    assert not got.failures and len(got.chunks) == len(keys) == 11


def test_the_prefill_result_reaches_the_decode_replica_through_the_box(url, offline):
    """Disaggregated, the prefill's result (with the KV's chunk refs) reaches the decode
    replica through the store's hand-off box; no Ray ref crosses the ingress (Serve's
    by-value transport would pin it). The texts match offline, and every hand-off was
    taken: the box holds nothing after. Seen failing (prefill_posted False, the refs in the
    prefill's answer) with the prefill replica returning its result unposted."""
    prompts = [prompt_ids(40 + i, n=70) for i in range(4)]
    for prompt in prompts:
        got = complete(url, prompt)
        assert got["choices"][0]["text"] == want_text(offline, prompt)
        assert got["slimserve"]["choices"][0]["prefill_via"] == "remote"
        assert got["slimserve"]["choices"][0]["prefill_posted"]  # its chunks have refs
    box = HandOffs("slimserve-kvstore")
    # Earlier tests' clients left at the first token: their decode calls' takes end within
    # WAIT_S in the box (their keys discarded, so nothing stays held).
    assert eventually(lambda: asyncio_run(box.stats())["waiting"] == 0, WAIT_S + 5)
    after = asyncio_run(box.stats())
    assert after["held"] == 0 and after["taken"] >= len(prompts), after


def test_a_short_prompts_in_band_result_is_posted_by_the_ingress(url, offline):
    """A prompt shorter than a chunk sent to a prefill replica (a routing hint): its KV is
    one small partial chunk, in-band, so the prefill's result comes back whole to the
    ingress, which posts it for the decode call: one post and one take each, nothing held.
    The texts match offline. Seen failing (the decode call waited for the box until its
    timeout) without the ingress's post."""
    prompts = [prompt_ids(60 + i, n=20) for i in range(4)]  # chunk_tokens 32
    box = HandOffs("slimserve-kvstore")
    assert eventually(lambda: asyncio_run(box.stats())["waiting"] == 0, WAIT_S + 5)
    before = asyncio_run(box.stats())
    for prompt in prompts:
        got = complete(url, prompt, replica=0)
        assert got["choices"][0]["text"] == want_text(offline, prompt)
        assert got["slimserve"]["choices"][0]["prefill_posted"] is False
    after = asyncio_run(box.stats())
    assert after["posted"] - before["posted"] == after["taken"] - before["taken"] == len(prompts)
    assert after["held"] == 0, after


def streamed_text(url, prompt, **extra) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, **extra}
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
    return text


def test_a_prompt_under_the_local_limit_prefills_on_its_decode_replica(url, offline):
    """Conditional disaggregation: a prompt of at most `local_prefill_max_tokens` tokens
    (16 here) goes to one decode call, whose replica prefills it: no prefill replica, no
    hand-off (the box sees no post or take). Its text, unary and streamed, matches offline;
    a seeded sampled choice draws the same tokens prefilled locally and through a prefill
    replica (named by a routing hint), the noise being keyed by (seed, position). Seen
    failing (prefill_via "remote") with the ingress's limit at 0."""
    prompts = [prompt_ids(80 + i, n=16 - i) for i in range(3)]
    box = HandOffs("slimserve-kvstore")
    assert eventually(lambda: asyncio_run(box.stats())["waiting"] == 0, WAIT_S + 5)
    before = asyncio_run(box.stats())
    for prompt in prompts:
        got = complete(url, prompt)
        assert got["choices"][0]["text"] == want_text(offline, prompt)
        assert got["slimserve"]["choices"][0]["prefill_via"] == "local"
        assert streamed_text(url, prompt, temperature=0) == want_text(offline, prompt)
    after = asyncio_run(box.stats())
    assert (after["posted"], after["taken"]) == (before["posted"], before["taken"]), after
    sampled = {"temperature": 1.0, "seed": 11, "max_tokens": 12}
    local = complete(url, prompts[0], **sampled)
    remote = complete(url, prompts[0], replica=1, **sampled)
    assert remote["slimserve"]["choices"][0]["prefill_via"] != "local"
    assert local["choices"][0]["text"] == remote["choices"][0]["text"]


def test_decode_completes_after_the_prefill_replica_dies(url, store, offline):
    prompt = prompt_ids(20, n=90)  # chunks of 32 + 32 + 26 (the last one travels uncached)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    gen = GenerateRequest("kill-test", prompt, params, routing=RoutingInfo(len(prompt)))
    prefill = serve.get_deployment_handle("PrefillServer", "slimserve").options(stream=True)
    *_, result = list(prefill.prefill.remote(gen))  # the token, then the result
    assert result.posted  # its 3 chunks wait in the hand-off box under the choice's key
    victim = ray.get_actor(result.replica, namespace="serve")
    ray.kill(victim, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until Ray knows it is gone
        try:
            ray.get(victim.__ray_ready__.remote(), timeout=2)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            break
        time.sleep(0.2)
    decode = serve.get_deployment_handle("DecodeServer", "slimserve").options(stream=True)
    deltas = list(decode.generate.remote(DecodeRequest(gen, HandOff(gen.request_id), gen.routing)))
    tokens = result.first.new_token_ids + [t for d in deltas for t in d.new_token_ids]
    want = offline.generate([prompt], params)[0]
    assert tokens == want.token_ids
    # The two full chunks are store-owned and outlive their producer; the partial last one
    # (26 tokens of this model: a few KiB) travels in-band in the result (`in_transit`), so
    # it outlives its producer too: all 80 imported. (Put in the object store by the killed
    # replica, as before in-band, it was read only until Ray marked its owner dead: 64 or
    # 80 then, seen 64 once in five loaded full-suite runs on 2026-12-05.)
    assert deltas[0].num_cached_tokens == 80


@pytest.mark.parametrize("n", [40, 12], ids=["prefilled", "local"])
def test_client_disconnect_frees_decode_blocks(url, n):
    """A client that leaves mid-stream frees the decode replica's blocks, whether its prompt
    went through a prefill replica (40 tokens) or was prefilled on the decode replica (12:
    under the limit). Seen failing (local_prefills 0 for 12) with the ingress's limit
    check always false."""
    decode = serve.get_deployment_handle("DecodeServer", "slimserve")
    local_before = decode.stats.remote().result()["local_prefills"]
    body = {
        "model": "tiny",
        "prompt": prompt_ids(30, n=n),
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = [line for line, _ in zip(lines, range(6)) if line.startswith("data: {")]
        during = decode.stats.remote().result()
    assert len(seen) >= 3 and during["num_running"] == 1
    assert during["kv_blocks_free"] < during["kv_blocks_total"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after = decode.stats.remote().result()
        if after["num_running"] == 0 and after["kv_blocks_free"] == after["kv_blocks_total"]:
            break
        time.sleep(0.2)
    assert after["num_running"] == 0 and after["num_waiting"] == 0
    assert after["kv_blocks_free"] == after["kv_blocks_total"]  # no leaked blocks
    assert httpx.get(url + "/health").status_code == 200
    assert after["local_prefills"] - local_before == (n <= LOCAL_LIMIT)
