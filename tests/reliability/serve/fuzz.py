"""Hypothesis strategies for malformed and extreme requests, HTTP (OpenAI JSON) and gRPC.

Values are drawn around every validation edge (0, negatives, denormals, 1e-300, huge, NaN
and infinities, wrong types, unicode edge cases, deep nesting) while generation stays short:
a well-formed request asks for at most MAX_GEN tokens so a run of thousands stays cheap.
"""

from __future__ import annotations

import json
import math

from hypothesis import strategies as st

from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb

MAX_GEN = 4
EDGE_FLOATS = [0.0, -0.0, 1e-300, 1e-45, 5e-324, -1e-300, 1e-7, 0.5, 1.0, 2.0, 2.0000001,
               -1.0, 1e300, math.inf, -math.inf, math.nan]  # fmt: skip
EDGE_INTS = [0, 1, -1, 2, 16, 17, MAX_GEN, 2**31 - 1, 2**31, 2**63 - 1, 2**64, -(2**63)]
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40) | st.sampled_from(
    ["", " ", "\x00", "\ud800", "\udfff", "<|end|>", "<|system|>", "\u202e", "é" * 50, "🦙"]
)
ANY_SCALAR = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EDGE_INTS), st.sampled_from(EDGE_FLOATS), TEXT
)
JSONISH = st.recursive(ANY_SCALAR, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
    TEXT, kids, max_size=3), max_leaves=8)  # fmt: skip


# Each field: a value the API accepts, or (in "bad" mode) an edge value or a wrong type.
FLOAT_01 = st.floats(0.05, 1.0)
GOOD = {
    "max_tokens": st.integers(1, MAX_GEN),
    "temperature": st.floats(0.0, 2.0) | st.sampled_from(EDGE_FLOATS[:7]),
    "top_p": FLOAT_01 | st.sampled_from([1e-300, 1e-7, 1.0]),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0.0, 1.0),
    "n": st.integers(1, 3),
    "stop": st.lists(TEXT, max_size=3) | TEXT,
    "stop_token_ids": st.lists(st.integers(0, 319), max_size=3),
    "seed": st.integers(0, 2**63 - 1),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(1e-300, 5.0) | st.sampled_from([1e-300, 5e-324]),
    "stream": st.booleans(),
    "logprobs": st.integers(0, 3),
    "ignore_eos": st.booleans(),
    "model": st.just("tiny"),
}
BAD = {name: st.one_of(ANY_SCALAR, JSONISH) for name in [*GOOD, "cache_salt", "junk_field"]}


@st.composite
def sampling_fields(draw) -> dict:
    """All good (half), one bad field (a quarter), or every field anything (a quarter)."""
    mode = draw(st.sampled_from(["good", "good", "one_bad", "chaos"]))
    pick = GOOD if mode == "good" else {**GOOD, **BAD} if mode == "chaos" else GOOD
    body = draw(st.fixed_dictionaries({}, optional=pick))
    if mode == "one_bad":
        name = draw(st.sampled_from(sorted(BAD)))
        body[name] = draw(BAD[name])
    return body


def _value(good):
    return st.one_of(good, good, ANY_SCALAR, JSONISH)


IDS = st.lists(st.integers(0, 319), min_size=1, max_size=8)
PROMPT = st.one_of(TEXT, TEXT, TEXT, IDS, IDS, st.lists(st.sampled_from(EDGE_INTS + [320])),
                   ANY_SCALAR, JSONISH)  # fmt: skip
MESSAGE = st.fixed_dictionaries(
    {"role": _value(st.sampled_from(["user", "system", "assistant", "tool", "nobody"]))},
    optional={"content": _value(TEXT)},
)


@st.composite
def completion_body(draw) -> dict:
    body = {"model": "tiny", **draw(sampling_fields())}
    if draw(st.integers(0, 9)):  # a prompt nine times in ten
        body["prompt"] = draw(PROMPT)
    body.setdefault("max_tokens", MAX_GEN)  # an unset max_tokens may run to the context
    if isinstance(body["max_tokens"], int) and body["max_tokens"] > MAX_GEN:
        body["max_tokens"] = draw(st.sampled_from([MAX_GEN, 10**9, -5]))
    return body


@st.composite
def chat_body(draw) -> dict:
    body = draw(completion_body())
    body.pop("prompt", None)
    body["messages"] = draw(_value(st.lists(MESSAGE, max_size=3)))
    return body


def encode(body) -> bytes:
    """JSON as a careless client writes it: NaN/Infinity literals, lone surrogates escaped."""
    return json.dumps(body, allow_nan=True).encode()


RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b"[]", b"null", b'{"prompt": "x"' * 3, b"[" * 5000 + b"]" * 5000,
                     b'{"a":' * 2000 + b"1" + b"}" * 2000, b"\xff\xfe{}"]),
)  # fmt: skip


UINT = st.sampled_from([0, 1, 2, 3, MAX_GEN, 5, 319, 320, 2**31, 2**32 - 1])
FLOATS = st.floats(0.0, 1.0) | st.sampled_from(EDGE_FLOATS)


GRPC_GOOD = {
    "max_tokens": st.integers(1, MAX_GEN),
    "temperature": st.floats(0.0, 2.0), "top_p": st.floats(0.05, 1.0),
    "min_p": st.floats(0.0, 1.0), "top_k": st.integers(-1, 50), "n": st.integers(1, 3),
    "stop": st.lists(st.text(max_size=5), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 319), max_size=2),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "presence_penalty": st.floats(-2.0, 2.0), "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.1, 5.0), "ignore_eos": st.booleans(),
    "logprobs": st.integers(0, 3),
}  # fmt: skip
GRPC_EDGE = {
    "max_tokens": UINT, "temperature": FLOATS, "top_p": FLOATS, "min_p": FLOATS,
    "top_k": st.sampled_from([-2, 0, 2**31 - 1]), "n": st.sampled_from([0, 17, 2**32 - 1]),
    "stop_token_ids": st.lists(UINT, max_size=2), "presence_penalty": FLOATS,
    "frequency_penalty": FLOATS, "repetition_penalty": FLOATS, "logprobs": UINT,
}  # fmt: skip


@st.composite
def grpc_request(draw) -> pb.GenerateRequest:
    """Valid sampling (half), one edge value (a quarter), edges anywhere (a quarter)."""
    mode = draw(st.sampled_from(["good", "good", "one_bad", "chaos"]))
    pick = {**GRPC_GOOD, **GRPC_EDGE} if mode == "chaos" else GRPC_GOOD
    sampling = draw(st.fixed_dictionaries({}, optional=pick))
    if mode == "one_bad":
        name = draw(st.sampled_from(sorted(GRPC_EDGE)))
        sampling[name] = draw(GRPC_EDGE[name])
    mt = sampling.get("max_tokens", MAX_GEN)
    sampling["max_tokens"] = mt if mt <= MAX_GEN else draw(st.sampled_from([MAX_GEN, 2**32 - 1]))
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling))
    which = draw(st.sampled_from(["text", "text", "token_ids", "token_ids", "chat", "none"]))
    if which == "text":
        req.text = draw(st.text(min_size=1, max_size=40) | st.text(max_size=40))
    elif which == "token_ids":
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, 319) | UINT, max_size=6)))
    elif which == "chat":
        roles = st.sampled_from(["user", "system", "assistant"]) | st.text(max_size=8)
        for role, content in draw(st.lists(st.tuples(roles, st.text(max_size=20)), max_size=3)):
            req.chat.messages.add(role=role, content=content)
    req.request_id = draw(st.sampled_from(["", "", "same-id", "x" * 129, "a b", "\x7f"]))
    req.model = draw(st.sampled_from(["", "", "tiny", "other"]))
    return req
