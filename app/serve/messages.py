"""Frozen messages between the ingress, the router and the engine replicas (same trust zone)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from app.engine.request import Request, RequestDelta
from app.engine.sampling_params import SamplingParams
from app.kv.keys import chain_keys, make_salt
from app.kvstore.store import StoredChunk

# Finish reasons that end a choice; a prefill's first delta has none (decode follows).
DONE_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True, slots=True)
class RoutingInfo:
    """What the token-aware router reads off a request (app/serve/routing/router.py)."""

    num_tokens: int  # prompt tokens this request will make its replica compute or hold
    chunk_keys: tuple[int, ...] = ()  # short (8-byte) forms of the prompt's chunk keys
    hint: int | None = None  # forced replica index; set only when the operator allows it


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One completion choice to generate (the ingress splits n > 1 into n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    routing: RoutingInfo = field(default_factory=lambda: RoutingInfo(0))

    def engine_request(self) -> Request:
        """The engine request that runs this choice whole, its prompt prefilled there (a
        colocated engine, or a decode replica given a short prompt)."""
        params = dataclasses.replace(self.params, n=1)
        return Request(self.request_id, self.prompt_token_ids, params, cache_salt=self.cache_salt)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    request_id: str
    first: RequestDelta  # the first sampled token (finished if it already ends the choice)
    # the prompt's KV, in order, store-owned: full + partial last; after an overlapped
    # hand-off's parts (`HandOffPart`), only the chunks after them
    chunks: list[StoredChunk]
    replica: str
    num_store_tokens: int = 0  # prompt tokens whose KV came from the shared store
    store_failures: int = 0
    # True: the result (chunk refs included) was posted to the hand-off box, and these
    # chunks left out; False: it is whole here, its KV in-band (no Ray ref)
    posted: bool = False
    chunks_start: int = 0  # the prompt position of chunks[0] (after the parts posted)

    @property
    def in_band(self) -> bool:
        """Every chunk travels inside the result (its bytes, no Ray ref): it may cross
        Serve's by-value transport, which pickles outside Ray."""
        return all(c.in_band for c in self.chunks)


@dataclass(frozen=True, slots=True)
class HandOffPart:
    """Chunks of the prompt's KV published before the prefill's result (an overlapped
    hand-off: the prefill replica posts each as soon as its engine has computed them, under
    the result's key): the decode replica fetches and imports them while the rest of the
    prompt is computed. ``start``: the prompt position of the first chunk."""

    start: int
    chunks: list[StoredChunk]


@dataclass(frozen=True, slots=True)
class HandOffStarted:
    """On the prefill stream before the first token: the first part of the choice's
    overlapped hand-off is in the box, so its decode call may be placed now (it imports the
    parts while the rest of the prompt is computed). No Ray ref: it crosses Serve."""

    request_id: str


@dataclass(frozen=True, slots=True)
class HandOff:
    """Where the decode replica finds the prefill's result: posted under ``key`` to the
    store's hand-off box (app/kvstore/handoff.py), by the prefill replica (its KV has chunk
    refs) or by the ingress (in-band KV)."""

    key: str


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    request: GenerateRequest
    # The prefill's result, or where the decode replica takes it; None: the decode replica
    # prefills the prompt itself (a short prompt: ServeArgs.local_prefill_max_tokens)
    prefill: PrefillResult | HandOff | None
    routing: RoutingInfo = field(default_factory=lambda: RoutingInfo(0))
    # prefilled here only because the prefill replicas' queue was long: the tokens a prefill
    # replica would have computed (Placement.spilled_tokens), reported until the first token
    spilled_tokens: int = 0


def short_key(key: bytes) -> int:
    """A chunk key's first 8 bytes: enough to tell prefixes apart in routing stats."""
    return int.from_bytes(key[:8], "little")


def prompt_chunk_keys(
    prompt: list[int],
    salt_base: tuple[str, str, str] | list[str],
    cache_salt: str | None,
    block_size: int,
    chunk_tokens: int,
) -> list[bytes]:
    """Key of every full chunk of ``prompt``: the block key of the chunk's last block."""
    salt = make_salt(*salt_base, cache_salt)
    per_chunk = chunk_tokens // block_size
    block_keys = chain_keys(prompt, block_size, salt)
    return block_keys[per_chunk - 1 :: per_chunk]
