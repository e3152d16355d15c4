"""SamplingBatch: the per-row sampling parameters of one step as [B] tensors.

Built once per step from the sequences being sampled (`SamplingBatch.from_seqs`), or directly
from lists by a caller that samples rows of its own (speculative decoding builds one row per
(sequence, draft position)). Values that would break the arithmetic are clamped here, once:
a temperature below `GREEDY_EPS` samples greedily, repetition penalties are kept inside
[1e-20, 1e20] so no penalized logit overflows float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.engine.sampling.noise import seed_to_int64

GREEDY_EPS = 1e-5  # temperatures below this sample greedily (1e-45 would overflow logits / T)
_REP_BOUNDS = (1e-20, 1e20)


@dataclass(slots=True)
class PenaltyTokens:
    """Token occurrences of the rows with penalties, as flat (row, token id) index pairs.

    rows index the penalty rows (0..P-1), not the batch; `batch_rows` maps them back.
    """

    batch_rows: torch.Tensor  # [P] int64: which batch rows have penalties
    prompt_rows: torch.Tensor  # [Np] int64
    prompt_ids: torch.Tensor  # [Np] int64
    output_rows: torch.Tensor  # [No] int64
    output_ids: torch.Tensor  # [No] int64


@dataclass(slots=True)
class SamplingBatch:
    temperature: torch.Tensor  # [B] float32; 1.0 where greedy (never divides by ~0)
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32; 1.0 = off
    min_p: torch.Tensor  # [B] float32; 0.0 = off
    repetition: torch.Tensor  # [B] float32; 1.0 = off
    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64: the position of the token being sampled
    logprobs: list[int | None]  # per row: top-k alternatives wanted (None = no logprobs)
    penalties: PenaltyTokens | None  # None when no row has a penalty
    greedy_rows: torch.Tensor  # [G] int64
    sampled_rows: torch.Tensor  # [R] int64: the rows that are not greedy
    filter_rows: torch.Tensor  # [Rf] int64: sampled rows with top-k, top-p or min-p
    plain_rows: torch.Tensor  # [Rp] int64: sampled rows drawing from the whole vocabulary
    any_top_k: bool = True  # False: no row has top-k (the sampler skips its ops)
    any_min_p: bool = True  # False: no row has min-p

    @property
    def size(self) -> int:
        return len(self.logprobs)

    @property
    def all_greedy(self) -> bool:
        return not len(self.sampled_rows)

    @classmethod
    def from_seqs(cls, seqs, vocab_size: int, device: torch.device | str = "cpu") -> SamplingBatch:
        """seqs: Sequence-like objects (params, seed, token_ids, num_sampling_prompt_tokens);
        each row samples the token at position len(token_ids)."""
        return cls.build(
            [s.params for s in seqs],
            seeds=[s.seed for s in seqs],
            positions=[len(s.token_ids) for s in seqs],
            prompts=[
                s.token_ids[: s.num_sampling_prompt_tokens] if s.params.has_penalties else ()
                for s in seqs
            ],
            outputs=[
                s.token_ids[s.num_sampling_prompt_tokens :] if s.params.has_penalties else ()
                for s in seqs
            ],
            vocab_size=vocab_size,
            device=device,
        )

    @classmethod
    def build(
        cls, params, seeds, positions, prompts, outputs, vocab_size: int, device="cpu"
    ) -> SamplingBatch:
        """params: SamplingParams per row; seeds: int per row; positions: int per row;
        prompts/outputs: token id lists per row (read only for rows with penalties);
        vocab_size: V of the logits (a top_k >= V is no filter)."""
        greedy = [p.temperature < GREEDY_EPS for p in params]
        temp = [1.0 if g else float(p.temperature) for g, p in zip(greedy, params)]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
        rep = [
            min(max(float(p.repetition_penalty), _REP_BOUNDS[0]), _REP_BOUNDS[1]) for p in params
        ]
        filtered = [
            not g and (k > 0 or p.top_p < 1.0 or p.min_p > 0.0)
            for g, k, p in zip(greedy, top_k, params)
        ]
        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
        sampled = [i for i, g in enumerate(greedy) if not g]

        filter_rows = [i for i in sampled if filtered[i]]
        plain_rows = [i for i in sampled if not filtered[i]]
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        n = len(params)
        # One host->device tensor per dtype, split into the [B] fields (views): a step
        # builds a batch, and each torch.tensor call costs more than its few values.
        floats = torch.tensor(
            [*temp, *(float(p.top_p) for p in params), *(float(p.min_p) for p in params), *rep]
            + [float(p.presence_penalty) for p in params]
            + [float(p.frequency_penalty) for p in params],
            dtype=torch.float32,
            device=device,
        ).split([n] * 6)
        row_sets = [greedy_rows, sampled, filter_rows, plain_rows]
        longs = torch.tensor(
            [*top_k, *(seed_to_int64(s) for s in seeds), *positions, *sum(row_sets, [])],
            dtype=torch.int64,
            device=device,
        ).split([n, n, n, *map(len, row_sets)])
        return cls(
            temperature=floats[0],
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=longs[0],
            top_p=floats[1],
            min_p=floats[2],
            repetition=floats[3],
            presence=floats[4],
            frequency=floats[5],
            seeds=longs[1],
            positions=longs[2],
            logprobs=[p.logprobs for p in params],
            penalties=_penalty_tokens(pen_rows, prompts, outputs, device) if pen_rows else None,
            greedy_rows=longs[3],
            sampled_rows=longs[4],
            filter_rows=longs[5],
            plain_rows=longs[6],
            any_top_k=any(top_k),
            any_min_p=any(p.min_p > 0.0 for p in params),
        )


def _penalty_tokens(pen_rows, prompts, outputs, device) -> PenaltyTokens:
    def flat(lists):
        rows = [r for r, i in enumerate(pen_rows) for _ in lists[i]]
        ids = [t for i in pen_rows for t in lists[i]]
        return (
            torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(ids, dtype=torch.int64, device=device),
        )

    prompt_rows, prompt_ids = flat(prompts)
    output_rows, output_ids = flat(outputs)
    return PenaltyTokens(
        torch.tensor(pen_rows, dtype=torch.int64, device=device),
        prompt_rows,
        prompt_ids,
        output_rows,
        output_ids,
    )
