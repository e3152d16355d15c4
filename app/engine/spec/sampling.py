"""The target's token for every verification row, sampled as decoding without speculation
would sample it: row j of a sequence with proposals d_1..d_k is the distribution after
d_1..d_j, so its penalties see those tokens as already generated."""

from __future__ import annotations

import torch

from app.engine.request import TokenLogprob
from app.engine.sampler import GREEDY_EPS, SamplingBatch, greedy_tokens, sample
from app.engine.sampling_params import SamplingParams
from app.engine.sequence import Sequence


def plain_greedy(p: SamplingParams) -> bool:
    """Greedy with no penalties and no logprobs: the token is the logits' argmax (what
    sample() does, minus the [B] tensors it builds; plain decoding takes the same path)."""
    return p.temperature < GREEDY_EPS and not p.has_penalties and p.logprobs is None


def target_tokens(
    logits: torch.Tensor, seqs: list[Sequence]
) -> tuple[list[list[int]], list[list[TokenLogprob | None]]]:
    """logits: [R, V] float32, 1 + len(spec_tokens) rows per sequence -> (tokens, logprobs)
    per row, grouped per sequence.

    Row j samples position num_tokens + j with the noise keyed by (seed, that position): the
    token plain decoding would sample there (one batched call, one host sync)."""
    sizes = [1 + len(s.spec_tokens) for s in seqs]
    if all(plain_greedy(s.params) for s in seqs):
        flat = greedy_tokens(logits).tolist()  # the plain-greedy path's own op
        return _split(flat, sizes), _split([None] * len(flat), sizes)
    rows = [(seq, j) for seq, size in zip(seqs, sizes) for j in range(size)]
    batch = SamplingBatch.build(
        [seq.params for seq, _ in rows],
        seeds=[seq.seed for seq, _ in rows],
        positions=[seq.num_tokens + j for seq, j in rows],
        prompts=[seq.token_ids[: seq.num_sampling_prompt_tokens] for seq, _ in rows],
        outputs=[
            seq.token_ids[seq.num_sampling_prompt_tokens :] + seq.spec_tokens[:j] for seq, j in rows
        ],
        vocab_size=logits.shape[-1],
        device=logits.device,
    )
    result = sample(logits, batch)
    return _split(result.token_ids, sizes), _split(result.logprobs, sizes)


def _split(rows: list, sizes: list[int]) -> list[list]:
    out, start = [], 0
    for size in sizes:
        out.append(rows[start : start + size])
        start += size
    return out
