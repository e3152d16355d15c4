"""The peer benchmarks' own side, without vLLM: bench/vs_vllm.py's slimserve side on a tiny
model, the SSE client's counting against a fake server, and the prompt generator."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from bench.peer import random_prompts
from bench.sse_client import closed_loop
from bench.vs_vllm import main as vs_vllm_main


def test_vs_vllm_slimserve_side_runs(llama_path, tmp_path):
    args = ["--no-peer", "--model", llama_path, "--batches", "1,3", "--gen", "4"]
    args += ["--repeats", "2", "--out", str(tmp_path)]
    result = vs_vllm_main(args)
    assert set(result["results"]) == {
        "1 greedy",
        "1 T=0.8 top_p=0.9",
        "3 greedy",
        "3 T=0.8 top_p=0.9",
    }
    for key, row in result["results"].items():
        batch = int(key.split()[0])
        runs = row["runs"]["slimserve"]
        assert len(runs) == 2
        assert all(r["tokens"] == batch * 4 for r in runs)  # ignore_eos: every token counted
        assert row["slimserve_tok_s"] > 0
    on_disk = json.loads((tmp_path / "vs_vllm.json").read_text())
    assert on_disk["results"].keys() == result["results"].keys()
    assert os.path.exists(tmp_path / "vs_vllm.png")


def test_prompts_are_fresh_per_seed_and_in_range():
    a, b = random_prompts(1, 8, 4096), random_prompts(2, 8, 4096)
    assert random_prompts(1, 8, 4096) == a  # reproducible
    assert not {tuple(p) for p in a} & {tuple(p) for p in b}
    assert all(32 <= len(p) <= 64 and min(p) >= 4 and max(p) < 4096 for p in a + b)


async def _fake_server(tokens_per_event: int, gen: int, fail_every: int):
    """An OpenAI-like SSE server packing tokens_per_event tokens per event; every
    fail_every-th request gets a 429."""
    from aiohttp import web

    seen = {"n": 0}

    async def completions(request):
        seen["n"] += 1
        body = await request.json()
        if fail_every and seen["n"] % fail_every == 0:
            return web.json_response({"error": {"message": "busy"}}, status=429)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(body["max_tokens"] // tokens_per_event):
            event = {"choices": [{"index": 0, "text": "ab" * tokens_per_event}]}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("tokens_per_event", [1, 4])
def test_client_counts_tokens_from_usage_not_events(tokens_per_event):
    """Seen failing: with `tokens = len(stamps)` in one_request, output_tokens was a quarter
    of the truth for 4 tokens per event; with errors not filtered, summarize raised."""

    async def go():
        runner, url = await _fake_server(tokens_per_event, 16, fail_every=5)
        try:
            prompts = [[5, 6, 7]] * 10
            return await closed_loop(url, "m", prompts, concurrency=3, gen=16, limit_s=60)
        finally:
            await runner.cleanup()

    out = asyncio.run(go())
    assert out["requests"] == 10 and out["errors"] == 2
    assert "429" in out["first_error"] or "busy" in out["first_error"]
    assert out["output_tokens"] == 8 * 16
    assert out["tokens_per_event"] == tokens_per_event
    assert out["ttft_p50_s"] > 0 and out["output_tok_s"] > 0
