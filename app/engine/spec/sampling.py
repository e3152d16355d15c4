"""The target's token for every verification row, sampled as decoding without speculation
would sample it: row j of a sequence with proposals d_1..d_k is the distribution after
d_1..d_j, so its penalties see those tokens as already generated."""

from __future__ import annotations

import torch

from app.engine.request import TokenLogprob
from app.engine.sampler import SamplingBatch, sample
from app.engine.sequence import Sequence


def target_tokens(
    logits: torch.Tensor, seqs: list[Sequence]
) -> tuple[list[list[int]], list[list[TokenLogprob | None]]]:
    """logits: [R, V] float32, 1 + len(spec_tokens) rows per sequence -> (tokens, logprobs)
    per row, grouped per sequence.

    Row j samples position num_tokens + j with the noise keyed by (seed, that position): the
    token plain decoding would sample there (one batched call, one host sync)."""
    sizes = [1 + len(s.spec_tokens) for s in seqs]
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
    tokens, logprobs, start = [], [], 0
    for size in sizes:
        tokens.append(result.token_ids[start : start + size])
        logprobs.append(result.logprobs[start : start + size])
        start += size
    return tokens, logprobs
