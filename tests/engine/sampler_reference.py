"""Reference semantics for the batched sampler (tests and bench/sampler.py only).

`sample_batch` is the per-sequence sampler slimserve had before the batched one (a Python
loop, a vocabulary sort per top-p row, a torch.Generator per sequence); `expected_probs` is an
independent pure-Python statement of the filters' semantics, for distribution tests.
"""

from __future__ import annotations

import math

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


def sample_one(logits, p: SamplingParams, prompt, output, generator: torch.Generator) -> int:
    """logits: [V] float32 (modified in place) -> one token id."""
    if p.has_penalties:
        apply_penalties(logits, p, prompt, output)
    if p.greedy:
        return int(logits.argmax())
    probs = filter_probs((logits / p.temperature).softmax(-1), p)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    top = ()
    if k > 0:
        vals, ids = logprobs.topk(k)
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(token, float(logprobs[token]), top)


def sample_batch(logits: torch.Tensor, seqs, generators) -> list[tuple[int, TokenLogprob | None]]:
    """logits: [S, V] float32 -> (token, logprob or None) per sequence (the old engine path)."""
    want_lp = [s.params.logprobs is not None for s in seqs]
    raw_lp = logits.log_softmax(-1) if any(want_lp) else None
    if all(s.params.greedy and not s.params.has_penalties for s in seqs):
        tokens = logits.argmax(-1).tolist()
    else:
        tokens = [
            sample_one(
                logits[i].clone(),
                s.params,
                s.token_ids[: s.num_sampling_prompt_tokens],
                s.token_ids[s.num_sampling_prompt_tokens :],
                g,
            )
            for i, (s, g) in enumerate(zip(seqs, generators))
        ]
    return [
        (t, token_logprobs(raw_lp[i], t, s.params.logprobs) if want_lp[i] else None)
        for i, (t, s) in enumerate(zip(tokens, seqs))
    ]


def expected_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """The distribution a sampled row draws from, in plain Python floats: temperature, top-k
    (ties with the k-th kept), top-p over the top-k-renormalized distribution (smallest prefix
    reaching top_p), min-p relative to the most likely token; renormalized."""
    scaled = [x / p.temperature for x in logits]
    m = max(scaled)
    w = [math.exp(x - m) for x in scaled]
    order = sorted(range(len(w)), key=lambda i: -w[i])
    keep = set(order)
    if 0 < p.top_k < len(w):
        kth = w[order[p.top_k - 1]]
        keep = {i for i in order if w[i] >= kth}
    total = sum(w[i] for i in keep)
    mass, nucleus = 0.0, set()
    for i in order:
        if i in keep and (mass < p.top_p or p.top_p >= 1.0):
            nucleus.add(i)
            mass += w[i] / total
    keep = {i for i in nucleus if w[i] >= p.min_p * w[order[0]]} | {order[0]}
    z = sum(w[i] for i in keep)
    return [w[i] / z if i in keep else 0.0 for i in range(len(w))]
