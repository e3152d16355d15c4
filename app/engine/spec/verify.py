"""Exact verification of proposed tokens: pure functions (over tensors; the point-mass rule
over the host lists of the target's tokens).

Shapes: B sequences, K proposal slots (rows with fewer proposals are padded; num_proposed
says how many are real), V vocabulary. Row j of the target's output is its distribution for
the token after proposal j-1 (row 0: after the last verified token), so K proposals are
checked by K + 1 target rows and at least one token is always produced.

Two rules, both exact:
- point-mass proposals (n-gram, greedy drafts: q is one-hot): the target samples each row
  exactly as without speculation (argmax for greedy, the position-keyed sampler otherwise);
  a proposal is accepted while it equals the target's token. For one-hot q this *is*
  rejection sampling (accept x with p(x); on reject the target's token is distributed as
  p restricted to y != x, i.e. norm(max(0, p - q))), and seeded output is token-for-token
  the output without speculation.
- proposals drawn from a distribution q (sampled drafts): accept x with min(1, p(x)/q(x));
  at the first rejection sample from norm(max(0, p - q)); if all K are accepted, sample a
  bonus token from the last row (Leviathan et al. 2023, Chen et al. 2023).
"""

from __future__ import annotations

import torch


def verify_point_mass(
    target: list[list[int]], proposals: list[list[int]]
) -> tuple[list[list[int]], list[int]]:
    """Per sequence: the target's token of each of its len(proposals) + 1 rows and its
    proposals -> (tokens each sequence emits, accepted proposals per sequence).

    Accepted proposals equal the target's tokens, so the emitted tokens are the target's
    first accepted + 1: the agreed prefix plus the target's correction or bonus token.
    Plain lists: the target's tokens are already on the host (one sync for the step), and
    for a few short rows a loop is cheaper than building [B, K] tensors.
    """
    emitted, accepted = [], []
    for row, proposed in zip(target, proposals):
        a = 0
        while a < len(proposed) and proposed[a] == row[a]:
            a += 1
        emitted.append(row[: a + 1])
        accepted.append(a)
    return emitted, accepted


def acceptance_probs(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) for proposals x drawn from q (q(x) > 0 by construction)."""
    return (p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)).clamp(max=1.0)


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim. Where p <= q everywhere (then p == q, and a
    rejection has probability 0) p itself is returned, so the result is always a
    distribution."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(p.dtype).tiny), p)


def rejection_sample(
    p: torch.Tensor,  # [B, K+1, V] target probabilities (filtered, temperature applied)
    q: torch.Tensor,  # [B, K, V] the proposer's probabilities
    proposals: torch.Tensor,  # [B, K] int64, drawn from q
    num_proposed: torch.Tensor,  # [B] int64
    uniform: torch.Tensor,  # [B, K] in [0, 1): the accept/reject coins
    gumbel: torch.Tensor,  # [B, K+1, V] Gumbel(0, 1) noise for the replacement tokens
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (tokens [B, K+1] int64, accepted [B] int64); sequence b emits tokens[b, :a_b + 1].

    Slots past num_proposed count as rejected with q = 0 there, so their row is sampled
    from p itself (a sequence with no proposal samples exactly as without speculation).
    """
    k = proposals.shape[1]
    slot = torch.arange(k, device=p.device)
    valid = slot < num_proposed.unsqueeze(1)  # [B, K]
    p_x = p[:, :k].gather(-1, proposals.unsqueeze(-1)).squeeze(-1)  # [B, K]
    q_x = q.gather(-1, proposals.unsqueeze(-1)).squeeze(-1)
    accept = (uniform < acceptance_probs(p_x, q_x)) & valid
    accepted = accept.long().cumprod(1).sum(1)  # [B]
    q_real = torch.where(valid.unsqueeze(-1), q, torch.zeros_like(q))
    replace = torch.cat([residual_probs(p[:, :k], q_real), p[:, k:]], 1)  # [B, K+1, V]
    samples = (replace.log() + gumbel).argmax(-1)  # Gumbel-max: one draw per row
    keep = torch.cat([slot, slot.new_tensor([k])]) < accepted.unsqueeze(1)  # [B, K+1]
    padded = torch.cat([proposals, proposals.new_zeros(len(proposals), 1)], 1)
    return torch.where(keep, padded, samples), accepted
