"""Sampling: pure functions from logits and per-sequence parameters to next tokens."""

from __future__ import annotations

import torch

from app.engine.request import TokenLogprob
from app.engine.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt, output) -> torch.Tensor:
    """logits: [V]. Repetition over prompt+output (as HF), presence/frequency over output."""
    if p.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.tensor(list(set(prompt) | set(output)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
        )
    if output and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)
    return logits


def filter_probs(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """probs: [V] -> renormalized after top-k, top-p and min-p."""
    if p.top_k > 0 and p.top_k < probs.shape[-1]:
        kth = probs.topk(p.top_k).values[-1]
        probs = torch.where(probs < kth, 0.0, probs)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        sorted_p = torch.where(before >= p.top_p, 0.0, sorted_p)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    if p.min_p > 0:
        probs = torch.where(probs < p.min_p * probs.max(), 0.0, probs)
    return probs / probs.sum()


def sample_one(
    logits: torch.Tensor, p: SamplingParams, prompt, output, generator: torch.Generator
) -> int:
    """logits: [V] float32 (modified in place) -> one token id."""
    if p.has_penalties:
        apply_penalties(logits, p, prompt, output)
    if p.greedy:
        return int(logits.argmax())
    probs = filter_probs((logits / p.temperature).softmax(-1), p)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """logprobs: [V] log-softmax of the raw logits."""
    top = ()
    if k > 0:
        vals, ids = logprobs.topk(k)
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(token, float(logprobs[token]), top)


def sample_batch(logits: torch.Tensor, seqs) -> list[tuple[int, TokenLogprob | None]]:
    """logits: [S, V] float32 -> (token, logprob or None) per sequence."""
    want_lp = [s.params.logprobs is not None for s in seqs]
    raw_lp = logits.log_softmax(-1) if any(want_lp) else None
    if all(s.params.greedy and not s.params.has_penalties for s in seqs):
        tokens = logits.argmax(-1).tolist()
    else:
        tokens = [
            sample_one(
                logits[i].clone(),
                s.params,
                s.token_ids[: s.num_prompt_tokens],
                s.output_token_ids,
                s.generator,
            )
            for i, s in enumerate(seqs)
        ]
    return [
        (t, token_logprobs(raw_lp[i], t, s.params.logprobs) if want_lp[i] else None)
        for i, (t, s) in enumerate(zip(tokens, seqs))
    ]
