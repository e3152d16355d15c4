"""Messages at the engine's boundary: what goes in (Request) and what comes out (deltas)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.engine.sampling_params import SamplingParams


class OverloadedError(RuntimeError):
    """The waiting queue is full; the caller should retry later (HTTP 429 / RESOURCE_EXHAUSTED)."""


class RequestError(RuntimeError):
    """One request failed inside the engine (e.g. its KV transfer); others carry on."""


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None  # tenant isolation: part of every block key
    kv_import: list[Any] | None = None  # KVChunks to load before computing the rest
    # Stop after the first token and export the KV: the token's delta comes first (not
    # final), then a final one with `exported_chunks` and no token (app/engine/transfers.py)
    prefill_only: bool = False
    # prefill_only: also export each chunk of ``chunk_tokens`` as soon as a step has computed
    # it, before the token (token-less, non-final deltas with `exported_chunks`), so the
    # reader can fetch and import those while the rest of the prompt is computed; the final
    # delta then has only the chunks after them
    export_early: bool = False
    # Only write kv_import into the prefix cache and end (a final delta, no token): a decode
    # replica imports a prompt's chunks as they come, before the request that uses them
    # (its own kv_import repeats them; the prefix match finds them cached)
    import_only: bool = False
    # Output tokens sampled by another replica (a prefill replica's first token): they end
    # prompt_token_ids, and a structured output's grammar replays them before sampling.
    prior_output_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) best first


@dataclass(slots=True)
class RequestDelta:
    """What one step produced for one output sequence (index) of a request."""

    request_id: str
    index: int
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    exported_chunks: list[Any] | None = None
    error: str | None = None  # finish_reason "error": why this request failed (only it)
    # [(chunk key, why)]: kv_import chunks whose tag failed in the import (recomputed); the
    # replica drops them from the store
    kv_rejected: list[tuple[bytes, str]] | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    # The first completion's fields, for the common n == 1 case.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    def apply(self, delta: RequestDelta) -> None:
        out = self.outputs[delta.index]
        out.token_ids.extend(delta.new_token_ids)
        out.text += delta.text_delta
        if delta.logprobs is not None:
            out.logprobs = (out.logprobs or []) + delta.logprobs
        if delta.finished:
            out.finish_reason = delta.finish_reason
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
