"""Exact verification: the emitted tokens keep the target's distribution.

Chi-square tests over a small vocabulary and many independent rows. Each broken variant of
the rule (monkeypatched into the real module) must push the same statistic far past the
bound; that is how these tests were seen to fail: accept-always, accepting with p(x)
instead of min(1, p(x)/q(x)), and resampling a rejected slot from p instead of
norm(max(0, p - q)) gave statistics of 210k, 168k and 31k against bounds of 82-301
(the correct rule: 216 with 215 degrees of freedom).
(Dropping the renormalisation of max(0, p - q) is *not* a bug here: Gumbel-max sampling
is invariant to scaling, so that variant is not listed.)
"""

import math

import pytest
import torch

from app.engine.spec import verify
from app.engine.spec.verify import rejection_sample, verify_point_mass

V, K, N = 6, 2, 200_000


def chi2_bound(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at 1 - 1e-4 (z = 3.719)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi2(observed: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * observed.sum()
    return float(((observed - expected) ** 2 / expected).sum())


def random_dists(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Distributions over V with no tiny entries (every expected count stays large)."""
    x = torch.rand(*shape, V, generator=g) + 0.15
    return x / x.sum(-1, keepdim=True)


@pytest.fixture(scope="module")
def tables():
    g = torch.Generator().manual_seed(0)
    # Row j of the target depends on the proposals before j, as in a real model.
    return dict(
        p0=random_dists(g),
        p1=random_dists(g, V),  # [x0] -> dist
        p2=random_dists(g, V, V),  # [x0, x1] -> dist
        q0=random_dists(g),
        q1=random_dists(g, V),
    )


def draw(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs.reshape(-1, V), 1, generator=g).reshape(probs.shape[:-1])


def run_rejection(t, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x0 = draw(t["q0"].expand(N, V), g)
    x1 = draw(t["q1"][x0], g)
    p = torch.stack([t["p0"].expand(N, V), t["p1"][x0], t["p2"][x0, x1]], 1)  # [N, 3, V]
    q = torch.stack([t["q0"].expand(N, V), t["q1"][x0]], 1)  # [N, 2, V]
    proposals = torch.stack([x0, x1], 1)
    uniform = torch.rand(N, K, generator=g)
    gumbel = -torch.log(-torch.log(torch.rand(N, K + 1, V, generator=g)))
    return rejection_sample(p, q, proposals, torch.full((N,), K), uniform, gumbel)


def statistics(tokens: torch.Tensor, accepted: torch.Tensor, t) -> tuple[float, int]:
    """Summed chi-square of every emitted position against its conditional target; df."""
    first = tokens[:, 0]
    stat, df = chi2(torch.bincount(first, minlength=V).double(), t["p0"].double()), V - 1
    for x0 in range(V):  # second token, given the first was emitted as x0 and accepted
        rows = (accepted >= 1) & (first == x0)
        counts = torch.bincount(tokens[rows, 1], minlength=V).double()
        if counts.sum() >= 500:  # point-mass proposals: only one x0 is ever accepted
            stat, df = stat + chi2(counts, t["p1"][x0].double()), df + V - 1
    both = accepted >= 2
    pair = tokens[both, 0] * V + tokens[both, 1]
    for x in pair.unique().tolist():
        counts = torch.bincount(tokens[both][pair == x, 2], minlength=V).double()
        if counts.sum() >= 500:
            stat, df = stat + chi2(counts, t["p2"][x // V, x % V].double()), df + V - 1
    return stat, df


def test_rejection_sampling_keeps_the_target_distribution(tables):
    tokens, accepted = run_rejection(tables)
    stat, df = statistics(tokens, accepted, tables)
    assert stat < chi2_bound(df), (stat, df)
    assert 0 < accepted.float().mean() < K  # both branches ran


BROKEN = {
    "accept_always": ("acceptance_probs", lambda p_x, q_x: torch.ones_like(p_x)),
    "accept_with_p": ("acceptance_probs", lambda p_x, q_x: p_x),
    "resample_from_p": ("residual_probs", lambda p, q: p),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_statistic_catches_a_wrong_rule(tables, monkeypatch, name):
    attr, wrong = BROKEN[name]
    monkeypatch.setattr(verify, attr, wrong)
    stat, df = statistics(*run_rejection(tables), tables)
    assert stat > 3 * chi2_bound(df), (name, stat, df)


def test_point_mass_proposals_keep_the_target_distribution(tables):
    """n-gram-like proposals: fixed tokens (one likely, one not); the target's own Gumbel-max
    samples decide. Accept-always (emit the proposals) fails the same statistic."""
    g = torch.Generator().manual_seed(2)
    t = tables
    x0 = torch.full((N,), int(t["p0"].argmax()))
    x1 = torch.full((N,), int(t["p1"][x0[0]].argmin()))
    p = torch.stack([t["p0"].expand(N, V), t["p1"][x0], t["p2"][x0, x1]], 1)
    gumbel = -torch.log(-torch.log(torch.rand(N, K + 1, V, generator=g)))
    target = (p.log() + gumbel).argmax(-1)  # what decoding without speculation samples
    proposals = torch.stack([x0, x1], 1)
    emitted, accepted = verify_point_mass(target.tolist(), proposals.tolist())
    accepted = torch.tensor(accepted)
    tokens = torch.tensor([row + [0] * (K + 1 - len(row)) for row in emitted])
    stat, df = statistics(tokens, accepted, t)
    assert stat < chi2_bound(df), (stat, df)
    always = torch.cat([proposals, target[:, K:]], 1)
    stat_bad, _ = statistics(always, torch.full((N,), K), t)
    assert stat_bad > 3 * chi2_bound(df)


def test_accepted_lengths_stop_at_first_mismatch_and_padding():
    target = torch.tensor([[3, 4, 5, 6], [3, 9, 5, 6], [3, 4, 5, 6], [1, 1, 1, 1]])
    proposals = torch.tensor([[3, 4, 5], [3, 4, 5], [3, 4, 5], [0, 0, 0]])
    num = torch.tensor([3, 3, 2, 0])
    rows = [row[: n + 1] for row, n in zip(target.tolist(), num.tolist())]
    mine = [row[:n] for row, n in zip(proposals.tolist(), num.tolist())]
    emitted, accepted = verify_point_mass(rows, mine)
    assert emitted == [[3, 4, 5, 6], [3, 9], [3, 4, 5], [1]]
    assert accepted == [3, 1, 2, 0]


def test_equal_draft_and_target_accept_everything():
    p = torch.softmax(torch.randn(4, K + 1, V), -1)
    proposals = torch.multinomial(p[:, :K].reshape(-1, V), 1).reshape(4, K)
    uniform = torch.rand(4, K) * 0.999
    gumbel = torch.zeros(4, K + 1, V)
    tokens, accepted = rejection_sample(
        p, p[:, :K], proposals, torch.full((4,), K), uniform, gumbel
    )
    assert accepted.tolist() == [K] * 4
    assert torch.equal(tokens[:, :K], proposals)
    assert torch.equal(tokens[:, K], p[:, K].argmax(-1))
