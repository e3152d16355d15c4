"""Overload and soak drivers shared by the fast slices and the long runs."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import Counter

import grpc
import httpx
import psutil

from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb
from reliability.serve.clients import Outcome, grpc_stream, http_stream, refused, run_all


def cluster_rss() -> int:
    """Bytes resident in this process's descendants: the local Ray cluster, Serve included."""
    total = 0
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def label(o: Outcome, want: str) -> str:
    """correct / rejected-429 (before any token) / in-band-overload / other-clean / wrong."""
    kind = o.kind(want)
    if kind != "clean_error":
        return kind
    if o.error.startswith(("HTTP 429", "RESOURCE_EXHAUSTED")):
        return "rejected"
    return "in_band_overload" if "overloaded" in o.error else "unavailable"


def overload(app, batch, wants, tokens: int, clients: int, seconds: float) -> dict:
    """`clients` callers loop for `seconds` (half HTTP, half gRPC) -> tally + rejection times."""
    end = time.monotonic() + seconds
    tally: Counter = Counter()
    reject_s: list[float] = []
    lock = threading.Lock()

    def caller(i: int):
        n = 0
        while time.monotonic() < end:
            j = (i + n) % len(batch)
            start = time.monotonic()
            if i % 2:
                o = grpc_stream(app["stub"], batch[j], tokens, app["md"])
            else:
                o = http_stream(app["url"], batch[j], tokens)
            kind = label(o, wants[j])
            with lock:
                tally[kind] += 1
                if kind == "wrong":
                    tally[f"detail: {(o.error or repr(o.text[-40:]))[:60]}"] += 1
                if kind == "rejected":
                    reject_s.append(time.monotonic() - start)
            if kind == "rejected":
                time.sleep(0.05)  # a polite client would honour Retry-After; be impolite
            n += 1

    run_all([lambda i=i: caller(i) for i in range(clients)], workers=clients)
    reject_s.sort()
    pct = lambda q: round(reject_s[int(q * (len(reject_s) - 1))], 3) if reject_s else None
    return {"tally": dict(tally), "reject_p50_s": pct(0.5), "reject_p99_s": pct(0.99)}


KINDS = ("http", "grpc", "cancel", "deadline", "n2", "long")


def soak_one(
    app, rng, batch, wants, long_prompt, tokens: int, kinds=KINDS, timeout_s: bool = False
) -> str:
    """One mixed request -> its outcome label. `long_prompt` is a token list or a function
    of `rng` giving one (fresh chunks for the store); `timeout_s` also sends each gRPC
    deadline as GenerateRequest.timeout_s (the open defect, docs/reliability.md)."""
    kind = rng.choice(kinds)
    j = rng.randrange(len(batch))
    if kind in ("http", "grpc"):
        if kind == "http":
            o = http_stream(app["url"], batch[j], tokens)
        else:
            o = grpc_stream(app["stub"], batch[j], tokens, app["md"])
        got = label(o, wants[j])
        return got if got != "wrong" else f"wrong {(o.error or repr(o.text[-40:]))[:60]}"
    if kind == "cancel":
        return _http_cancel(app, batch[j], rng.randrange(1, 4))
    if kind == "deadline":
        return grpc_deadline(app, batch[j], rng.choice([0.05, 0.2, 0.5]), timeout_s)
    if kind == "n2":
        body = {"model": "tiny", "prompt": batch[j], "max_tokens": tokens, "n": 2}
        body |= {"temperature": 0.8, "seed": j}
        r = httpx.post(app["url"] + "/v1/completions", json=body, timeout=120)
        if r.status_code == 200 and len(r.json()["choices"]) == 2:
            return "n2_ok"
        return "rejected" if refused(r) else f"wrong n2: {r.status_code} {r.text[:40]}"
    prompt = long_prompt(rng) if callable(long_prompt) else long_prompt
    r = httpx.post(
        app["url"] + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
        timeout=120,
    )
    return "long_ok" if r.status_code == 200 else f"long_{r.status_code}"


def _http_cancel(app, prompt, after: int) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2000, "ignore_eos": True}
    with httpx.stream(
        "POST", app["url"] + "/v1/completions", json=body | {"stream": True}, timeout=120
    ) as r:
        if refused(r):
            return "rejected"
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen >= after:
                return "cancelled"
    return f"wrong cancel: {r.status_code}, the stream ended after {seen} events"


def grpc_deadline(app, prompt, timeout: float, in_request: bool = False) -> str:
    """A 2,000-token call with a gRPC deadline (and, `in_request`, the same as timeout_s)."""
    sampling = pb.SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)
    if in_request:
        req.timeout_s = timeout
    try:
        for _ in app["stub"].Generate(req, metadata=app["md"], timeout=timeout):
            pass
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "deadline"
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "clean_error"
        return f"wrong deadline: {e.code().name} {(e.details() or '')[:40]}"
    return "wrong deadline: the call ended before its deadline"


def soak(
    app,
    batch,
    wants,
    long_prompt,
    tokens: int,
    total: int,
    workers: int = 12,
    kinds=KINDS,
    timeout_s: bool = False,
) -> Counter:
    tally: Counter = Counter()
    lock = threading.Lock()
    todo = iter(range(total))

    def worker(seed: int):
        rng = random.Random(seed)
        while True:
            with lock:
                if next(todo, None) is None:
                    return
            kind = soak_one(app, rng, batch, wants, long_prompt, tokens, kinds, timeout_s)
            with lock:
                if kind.startswith("wrong "):
                    tally[f"detail: {kind[6:]}"] += 1
                    kind = "wrong"
                tally[kind] += 1

    run_all([lambda s=s: worker(s) for s in range(workers)], workers=workers)
    return tally
