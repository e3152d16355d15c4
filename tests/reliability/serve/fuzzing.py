"""Run a fuzz strategy against a served app; tally the answers (docs/reliability.md)."""

from __future__ import annotations

import json
from collections import Counter

import grpc
import httpx
from hypothesis import HealthCheck, given, settings

from reliability.serve.fuzz import encode

# What a caller's mistake may get over gRPC; INTERNAL, UNKNOWN or UNAVAILABLE may not.
CALLER_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.ALREADY_EXISTS,
}


def fuzz(strategy, check, examples: int, seed: int = 0) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(x):
        check(x)

    run._hypothesis_internal_use_seed = seed
    run()


def http_check(client: httpx.Client, tally: Counter):
    """-> check((path, raw_body)): the answer is 2xx/4xx; 4xx carry OpenAI error JSON; a
    200 stream carries no server_error event."""

    def check(case):
        path, body = case
        data = body if isinstance(body, bytes) else encode(body)
        headers = {"content-type": "application/json"}
        with client.stream("POST", path, content=data, headers=headers) as r:
            text = r.read().decode("utf-8", "replace")
        tally[r.status_code] += 1
        assert r.status_code < 500, (r.status_code, text[:300], data[:300])
        if r.status_code >= 400:
            message = json.loads(text)["error"]["message"]
            tally[f"why: {message[:48]}"] += 1
        else:
            assert '"server_error"' not in text, (text[:300], data[:300])

    return check


def grpc_check(stub, md, tally: Counter):
    def check(case):
        req, unary = case
        try:
            if unary:
                stub.Complete(req, metadata=md, timeout=60)
            else:
                for _ in stub.Generate(req, metadata=md, timeout=60):
                    pass
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
            details = e.details() or ""
            tally[f"why: {details[:48]}"] += 1
        tally[code.name] += 1
        assert code in CALLER_CODES, (code, details, req)

    return check


def grpc_raw_check(channel, md, tally: Counter):
    """Bytes that are not a valid GenerateRequest go to the method as they are."""
    call = channel.unary_stream("/slimserve.v1.Generation/Generate")

    def check(data: bytes):
        try:
            for _ in call(data, metadata=md, timeout=60):
                pass
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
        tally[code.name] += 1
        assert code in CALLER_CODES, (code, details, data)

    return check
