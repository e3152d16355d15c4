"""A light closed-loop client for OpenAI `/v1/completions` streams (aiohttp), the same for
every server the benchmarks compare.

Per request it records the time of every SSE event that carries text (TTFT = the first),
and the completion tokens from the final usage chunk (`stream_options.include_usage`), so a
server that packs several tokens into one event is still counted per token:

- output tok/s: completion tokens of all requests / wall time of the level;
- TTFT p50/p99 over requests;
- ITL p50: the median gap between consecutive text events (pooled over requests);
- TPOT p50: the median over requests of (last event - first event) / (tokens - 1), which
  does not depend on how tokens are packed into events.
"""

from __future__ import annotations

import asyncio
import json
import time

from bench.peer import median, pct


async def one_request(session, url: str, model: str, prompt: list[int], gen: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": gen,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    stamps: list[float] = []
    usage = None
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            return {"status": r.status, "error": (await r.text())[:300]}
        async for raw in r.content:  # one SSE line per iteration
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            choices = event.get("choices") or []
            if choices and choices[0].get("text"):
                stamps.append(time.perf_counter() - start)
    if not stamps:
        return {"status": 200, "error": "no text events"}
    tokens = usage["completion_tokens"] if usage else len(stamps)
    return {
        "status": 200,
        "ttft": stamps[0],
        "gaps": [b - a for a, b in zip(stamps, stamps[1:])],
        "tpot": (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else None,
        "tokens": tokens,
        "events": len(stamps),
    }


async def closed_loop(
    url: str, model: str, prompts: list[list[int]], concurrency: int, gen: int, limit_s: float
) -> dict:
    """`concurrency` workers send the prompts back to back (each starts its next request when
    its last one ends) until all are sent or limit_s has passed."""
    import aiohttp

    queue = list(reversed(prompts))
    results: list[dict] = []
    deadline = time.perf_counter() + limit_s
    timeout = aiohttp.ClientTimeout(total=limit_s)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def worker() -> None:
            while queue and time.perf_counter() < deadline:
                results.append(await one_request(session, url, model, queue.pop(), gen))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return summarize(results, wall, concurrency)


def summarize(results: list[dict], wall: float, concurrency: int) -> dict:
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    gaps = [g for r in ok for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r["error"] for r in results if "error" in r), None),
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall if wall > 0 else 0.0,
        "ttft_p50_s": median(ttft),
        "ttft_p99_s": pct(ttft, 0.99),
        "itl_p50_s": median(gaps),
        # first -> second token: in disaggregated serving, the hand-off's tail
        "second_token_p50_s": median([r["gaps"][0] for r in ok if r["gaps"]]),
        "tpot_p50_s": median([r["tpot"] for r in ok if r["tpot"] is not None]),
        "tokens_per_event": tokens / max(1, sum(r["events"] for r in ok)),
    }
