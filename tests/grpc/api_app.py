"""What the gRPC API tests share: the app's name and keys, prompts, and small helpers.

The fixtures that serve it are in tests/grpc/conftest.py.
"""

import grpc
import pytest
from grpc_app import wait_until_idle as wait_idle

from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb

APP = "slimserve-grpc"
PROMPT = "the quick brown fox jumps over the lazy dog " * 3
KEY_A = (("application", APP), ("authorization", "Bearer key-tenant-a"))
KEY_B = (("application", APP), ("authorization", "Bearer key-tenant-b"))
ENGINE_ONGOING, ENGINE_QUEUED = 8, 16  # per engine replica; ingress takes 4x the first
# An 8k context and 6,000 tokens: a LONG request cannot end on its own while a test waits
# for its abort (the tiny model streams a few hundred tokens a second here).
LONG_CONTEXT = 8192
LONG = pb.SamplingParams(max_tokens=6000, temperature=0, ignore_eos=True)
ABORT_BOUND_S = 10.0


def engine_stats(served) -> dict:
    return served["engine"].stats.remote().result(timeout_s=30)


def wait_until_idle(served, timeout_s: float = 30) -> dict:
    return wait_idle(served["engine"], timeout_s)


def greedy(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def code_of(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value
