"""Per-token bookkeeping after sampling: stop conditions, detokenization, deltas."""

from __future__ import annotations

from app.engine.request import RequestDelta, TokenLogprob
from app.engine.sequence import SeqStatus, Sequence


class OutputProcessor:
    def __init__(self, max_model_len: int, eos_ids: tuple[int, ...] = ()):
        self.max_model_len = max_model_len
        self.eos_ids = frozenset(eos_ids)

    def process(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestDelta:
        """seq already has token appended; decides whether it finished and what to stream."""
        p = seq.params
        reason = None
        stop_token = (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids
        if stop_token or (seq.grammar is not None and seq.grammar.terminated):
            reason = "stop"  # a finished grammar ends the sequence like a stop token
        elif seq.detok is not None:
            seq.detok.add([token])
            cut = seq.detok.find_stop()
            if cut is not None:
                seq.detok.truncate(cut)
                reason = "stop"
        if reason is None and (
            seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        text = seq.detok.take(final=seq.finished) if seq.detok is not None else ""
        return RequestDelta(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=[token],
            text_delta=text,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            logprobs=[logprob] if logprob is not None else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def final_delta(self, seq: Sequence) -> RequestDelta:
        """The closing delta of a sequence that ends without a new token (abort)."""
        return RequestDelta(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=[],
            text_delta="",
            finished=True,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )
