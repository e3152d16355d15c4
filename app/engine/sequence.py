"""One output sequence: its tokens, progress and KV block table (no tensors here)."""

from __future__ import annotations

import enum
import itertools

from app.engine.detokenizer import IncrementalDetokenizer
from app.engine.request import Request, TokenLogprob
from app.engine.sampling_params import SamplingParams, random_seed
from app.kv.keys import BlockHash

_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self, request: Request, index: int, salt: bytes, detok: IncrementalDetokenizer | None
    ):
        self.seq_id = next(_ids)
        self.request = request
        self.request_id = request.request_id
        self.index = index
        self.params: SamplingParams = request.sampling_params
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        # The prompt as penalties see it: outputs sampled on another replica (a prefill
        # replica's first token, sent as the prompt's tail) count as outputs.
        prior = min(len(request.prior_output_ids), self.num_prompt_tokens)
        self.num_sampling_prompt_tokens = self.num_prompt_tokens - prior
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from a cache (local or imported)
        self.block_table: list[int] = []
        self.block_hashes: list[BlockHash] = []  # of the full blocks, in order
        self.salt = salt
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.detok = detok
        # Sampling noise is keyed by (seed, position): no generator state to carry between
        # replicas. The i-th of n sequences uses seed + i, as the ingress does when it splits n.
        seed = self.params.seed
        self.seed = random_seed() if seed is None else seed + index
        self.pending_logprobs: list[TokenLogprob] = []
        self.wait_for: Sequence | None = None  # n > 1: siblings wait for the prompt's KV
        self.kv_hold = None  # ImportHold: imported blocks pinned until admission
        self.num_exported_tokens = 0  # prompt tokens exported early (Request.export_early)
        self.kv_rejected: list | None = None  # [(chunk key, why)]: imported, failed its tag
        self.grammar = None  # SequenceGrammar (app/engine/structured) when constrained
        # Speculative decoding: this step's proposed tokens (not yet part of token_ids; they
        # become tokens only once verified) and the proposer's per-sequence state.
        self.spec_tokens: list[int] = []
        self.spec_state = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens and self.num_uncomputed == 1

    @property
    def prompt_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preempted: drop the KV; prompt and outputs so far are recomputed as one prefill."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.block_hashes = []
        self.spec_tokens = []
        self.status = SeqStatus.WAITING
