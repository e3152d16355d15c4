"""The target's token for every verification row, sampled as decoding without speculation
would sample it: row j of a sequence with proposals d_1..d_k is the distribution after
d_1..d_j, so its penalties see those tokens as already generated."""

from __future__ import annotations

import torch

from app.engine.sampler import sample_one
from app.engine.sequence import Sequence


def target_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> list[list[int]]:
    """logits: [R, V] float32, 1 + len(spec_tokens) rows per sequence -> tokens per row."""
    sizes = [1 + len(s.spec_tokens) for s in seqs]
    if all(s.params.greedy and not s.params.has_penalties for s in seqs):
        flat = logits.argmax(-1).tolist()  # one host sync for the batch
    else:
        flat, row = [], 0
        for seq, size in zip(seqs, sizes):
            prompt, output = seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids
            for j in range(size):
                history = output + seq.spec_tokens[:j]
                flat.append(
                    sample_one(logits[row + j].clone(), seq.params, prompt, history, seq.generator)
                )
            row += size
    out, start = [], 0
    for size in sizes:
        out.append(flat[start : start + size])
        start += size
    return out
