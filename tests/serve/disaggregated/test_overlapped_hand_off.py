"""The overlapped hand-off, served (docs/serving.md): a long prompt's KV handed to the decode
replica in parts while it is computed, a damaged chunk inside a part, and clients that leave
mid-prefill. The app of conftest.py."""

import asyncio

import httpx
import pytest
from polling import eventually
from ray import serve

from app import SamplingParams
from app.kvstore.handoff import WAIT_S, HandOffs
from app.serve.messages import GenerateRequest, HandOff, RoutingInfo
from app.serve.replicas.replica import prompt_chunk_keys
from serve.disaggregated.app_helpers import (
    MAX_TOKENS,
    all_stored,
    asyncio_run,
    complete,
    corrupt,
    prompt_ids,
    stats,
    want_text,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def replica_stats(deployment: str) -> list[dict]:
    """Every replica's stats (Serve's `broadcast`)."""
    handle = serve.get_deployment_handle(deployment, "slimserve")
    return list(handle.broadcast("stats").results())


def test_a_long_prompts_kv_is_handed_off_in_parts_as_it_is_computed(url, offline):
    """The overlapped hand-off: a 380-token prompt is computed in steps of 128 tokens; the
    prefill replica posts the chunks of its first two steps as parts while it computes the
    rest, and the decode replica, called with the prefill, imports each part before the
    result comes. The text matches offline and the box holds nothing after. Seen failing
    (hand_off_parts unchanged) with the prefill's `export_early` off."""
    decode = serve.get_deployment_handle("DecodeServer", "slimserve")
    before = decode.stats.remote().result()["hand_off_parts"]
    for replica, seed in enumerate((91, 92)):
        prompt = prompt_ids(seed)
        got = complete(url, prompt, replica=replica)  # remote: the placement may go local
        assert got["choices"][0]["text"] == want_text(offline, prompt)
    assert decode.stats.remote().result()["hand_off_parts"] - before == 4
    box = HandOffs("slimserve-kvstore")
    assert eventually(lambda: asyncio_run(box.stats())["held"] == 0, WAIT_S + 5)


def test_a_corrupted_chunk_in_a_part_is_rejected_and_recomputed(url, store, info, offline):
    """A middle chunk (the 6th of 11) handed off in a part is damaged: the decode replica's
    import rejects it by its tag, drops it from the store, and recomputes from there; the
    text matches offline. Set up so that only the hand-off can carry the damage: the
    prompt's chunks are published by prefill replica 0 (a direct call: no decode replica
    sees them), chunk 6 is replaced in the store by a damaged copy and chunk 1 dropped (so
    the next prefill finds no stored prefix to verify); replica 1 then computes the prompt
    and its publish of chunk 6 returns the store's damaged entry. Seen failing (no
    integrity failure counted: the damaged chunk was used) with the import's tag check
    skipped."""
    prompt = prompt_ids(93)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    gen = GenerateRequest("publish-only", prompt, params, routing=RoutingInfo(len(prompt), hint=0))
    prefill = serve.get_deployment_handle("PrefillServer", "slimserve").options(stream=True)
    list(prefill.prefill.remote(gen))  # the token, then the result (posted: parts and all)
    HandOffs("slimserve-kvstore").discard(HandOff(gen.request_id).key)  # no decode call
    assert all_stored(store, info, prompt)
    keys = prompt_chunk_keys(
        prompt, info["salt_base"], None, info["block_size"], info["chunk_tokens"]
    )
    corrupt(store, keys[5], "payload")
    asyncio_run(store.drop(keys[0], "test"))
    before = stats(store)["integrity_failures"]
    r = complete(url, prompt, replica=1)
    assert r["choices"][0]["text"] == want_text(offline, prompt)
    assert eventually(lambda: stats(store)["integrity_failures"] == before + 1)
    assert r["slimserve"]["choices"][0]["store_tokens"] == 0  # computed, not fetched


def test_cancelling_mid_prefill_frees_both_replicas_blocks(url):
    """Clients that leave while their long prompts are being prefilled (the decode calls
    already placed and importing parts): every block of both prefill replicas and of the
    decode replica is free after, and the box holds nothing. Four prompts at once keep the
    prefill replica busy, so the clients leave before their first token. An end-to-end
    check that nothing is lost; the guards themselves (an aborted prefill's early exports
    and an aborted import give their blocks back) are pinned, each seen failing, in
    tests/engine/test_early_export.py."""

    async def leave_early(prompt: list[int]) -> bool:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "stream": True}
        async with httpx.AsyncClient(timeout=60) as client:
            try:
                async with asyncio.timeout(0.05):
                    async with client.stream("POST", url + "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                return True  # a token came first
            except TimeoutError:
                return False
        return True

    async def burst() -> list[bool]:
        return await asyncio.gather(*(leave_early(prompt_ids(100 + i)) for i in range(4)))

    got_token = asyncio_run(burst())
    assert not all(got_token), "every client saw a token: none left mid-prefill"

    def all_free() -> bool:
        replicas = replica_stats("PrefillServer") + replica_stats("DecodeServer")
        return len(replicas) == 3 and all(  # a prefill replica killed earlier is back
            s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_running"] == 0 for s in replicas
        )

    assert eventually(all_free, 60)
    box = HandOffs("slimserve-kvstore")
    assert eventually(lambda: asyncio_run(box.stats())["held"] == 0, WAIT_S + 5)
    assert httpx.get(url + "/health").status_code == 200
