"""The delta channel's message schemas (msgpack arrays, led by their kind):

    ["deltas", [row, ...]]               row: the RequestDelta fields below, in order
    ["claim", request_id, claim]         binds request_id to the sending connection
    ["ping"]                             a side that sent nothing else for a while
    ["hello", VERSION, nonce_i]          inbox -> replica, the challenge
    ["prove", nonce_r, mac_r]            replica -> inbox
    ["proof", mac_i]                     inbox -> replica

A row is [request_id, index, new_token_ids, text_delta, finished, finish_reason,
logprobs, num_prompt_tokens, num_cached_tokens, error], logprobs None or a list of
[token_id, logprob, [[token_id, logprob], ...]]. The decoder checks every type and shape
and raises DeltaChannelError on anything else (the reader then closes that connection).
`exported_chunks` and `kv_rejected` stay in the replica: a delta carrying them is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from app.engine.request import RequestDelta, TokenLogprob
from app.serve.channel.delta_wire import MAX_FRAME_BYTES, DeltaChannelError, frame_of

VERSION = 1
NONCE_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256
CLAIM_BYTES = 16
MAX_ID_CHARS = 512
_MAX_TOKEN_ID = 1 << 32
_MAX_COUNT = 1 << 62
_NUMBERS = (float, int)  # exact types: a bool is neither here
MAX_REASON_CHARS = 32  # "stop", "length", "abort", "error"
_PACKED_KIND = msgpack.packb("deltas")
# The row budget of one frame: its own bytes plus the frame's array headers
MAX_ROW_BYTES = MAX_FRAME_BYTES - 64


@dataclass(frozen=True, slots=True)
class Claim:
    request_id: str
    claim: bytes


def pack_delta(delta: RequestDelta) -> bytes:
    """One delta's row, packed (the link packs each delta once, as it comes). ValueError or
    TypeError if the delta cannot travel."""
    if delta.exported_chunks is not None or delta.kv_rejected is not None:
        raise ValueError("exported_chunks and kv_rejected never leave the replica")
    logprobs = None
    if delta.logprobs is not None:
        logprobs = [[lp.token_id, lp.logprob, lp.top] for lp in delta.logprobs]
    row = [
        delta.request_id,
        delta.index,
        delta.new_token_ids,
        delta.text_delta,
        delta.finished,
        delta.finish_reason,
        logprobs,
        delta.num_prompt_tokens,
        delta.num_cached_tokens,
        delta.error,
    ]
    packed = msgpack.packb(row, use_bin_type=True)
    if len(packed) > MAX_ROW_BYTES:
        raise ValueError(f"a delta of {len(packed)} bytes is over the frame limit")
    return packed


def deltas_frames(rows: list[bytes]) -> list[bytes]:
    """Frames of packed rows in order, as few as the frame limit allows (one, normally)."""
    frames, start, size = [], 0, 0
    for i, row in enumerate(rows):
        if size + len(row) > MAX_ROW_BYTES:
            frames.append(_deltas_frame(rows[start:i]))
            start, size = i, 0
        size += len(row)
    if start < len(rows):
        frames.append(_deltas_frame(rows[start:]))
    return frames


def _deltas_frame(rows: list[bytes]) -> bytes:
    packer = msgpack.Packer()
    head = packer.pack_array_header(2) + _PACKED_KIND + packer.pack_array_header(len(rows))
    return frame_of(head + b"".join(rows))


def decode_deltas(message: list) -> list[RequestDelta]:
    _check(len(message) == 2 and type(message[1]) is list, "deltas")
    return [_delta(row) for row in message[1]]


def decode_claim(message: list) -> Claim:
    _check(len(message) == 3 and _is_id(message[1]) and _is_bytes(message[2], CLAIM_BYTES), "claim")
    return Claim(message[1], message[2])


def decode_ping(message: list) -> None:
    _check(len(message) == 1, "ping")


def decode_hello(message: list) -> bytes:
    _check(_is_kind(message, "hello", 3) and message[1] == VERSION, "hello")
    _check(_is_bytes(message[2], NONCE_BYTES), "hello")
    return message[2]


def decode_prove(message: list) -> tuple[bytes, bytes]:
    _check(_is_kind(message, "prove", 3) and _is_bytes(message[1], NONCE_BYTES), "prove")
    _check(_is_bytes(message[2], MAC_BYTES), "prove")
    return message[1], message[2]


def decode_proof(message: list) -> bytes:
    _check(_is_kind(message, "proof", 2) and _is_bytes(message[1], MAC_BYTES), "proof")
    return message[1]


def _delta(row: object) -> RequestDelta:
    _check(type(row) is list and len(row) == 10, "delta row")
    rid, index, ids, text, finished, reason, logprobs, n_prompt, n_cached, error = row
    _check(_is_id(rid) and _is_count(index) and _is_token_ids(ids), "delta")
    _check(type(text) is str and type(finished) is bool, "delta")
    _check(reason is None or (type(reason) is str and len(reason) <= MAX_REASON_CHARS), "delta")
    _check(_is_count(n_prompt) and _is_count(n_cached), "delta")
    _check(error is None or type(error) is str, "delta")
    lps = None if logprobs is None else _logprobs(logprobs)
    return RequestDelta(
        rid, index, ids, text, finished, reason, lps, n_prompt, n_cached, None, error
    )


def _logprobs(items: object) -> list[TokenLogprob]:
    _check(type(items) is list, "logprobs")
    out = []
    for item in items:
        _check(type(item) is list and len(item) == 3, "logprob")
        token_id, logprob, top = item
        _check(_is_token_id(token_id) and _is_number(logprob) and type(top) is list, "logprob")
        _check(all(map(_is_pair, top)), "top logprob")
        pairs = tuple((t, float(v)) for t, v in top)
        out.append(TokenLogprob(token_id, float(logprob), pairs))
    return out


def _is_pair(pair: object) -> bool:
    return (
        type(pair) is list
        and len(pair) == 2
        and type(pair[0]) is int
        and 0 <= pair[0] < _MAX_TOKEN_ID
        and type(pair[1]) in _NUMBERS
    )


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise DeltaChannelError(f"a malformed {what} message on the delta channel")


def _is_kind(message: list, kind: str, length: int) -> bool:
    return len(message) == length and message[0] == kind


def _is_id(value: object) -> bool:
    return type(value) is str and 0 < len(value) <= MAX_ID_CHARS


def _is_bytes(value: object, length: int) -> bool:
    return type(value) is bytes and len(value) == length


def _is_count(value: object) -> bool:
    return type(value) is int and 0 <= value < _MAX_COUNT


def _is_token_id(value: object) -> bool:
    return type(value) is int and 0 <= value < _MAX_TOKEN_ID


def _is_token_ids(value: object) -> bool:
    return type(value) is list and all(_is_token_id(t) for t in value)


def _is_number(value: object) -> bool:
    return type(value) in _NUMBERS
