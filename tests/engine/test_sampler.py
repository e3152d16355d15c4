"""The batched sampler against the old per-sequence semantics and its own contracts."""

import random

import pytest
import torch
from sampler_reference import apply_penalties as ref_penalties
from sampler_reference import expected_probs, sample_one

from app.engine import sampler as sampler_mod
from app.engine.sampler import SamplingBatch, filtered_probs, sample
from app.engine.sampling.penalties import apply_penalties
from app.engine.sampling_params import SamplingParams as SP


def _batch(params, logits, seeds=None, positions=None, prompts=None, outputs=None):
    n = len(params)
    return SamplingBatch.build(
        params,
        seeds=seeds if seeds is not None else list(range(n)),
        positions=positions if positions is not None else [5] * n,
        prompts=prompts if prompts is not None else [[] for _ in range(n)],
        outputs=outputs if outputs is not None else [[] for _ in range(n)],
        vocab_size=logits.shape[-1],
    )


def _random_penalty_rows(rng: random.Random, n: int, vocab: int):
    params, prompts, outputs = [], [], []
    for _ in range(n):
        params.append(
            SP(
                temperature=0,
                repetition_penalty=rng.choice([1.0, 0.7, 1.3, 2.0]),
                presence_penalty=rng.choice([0.0, 0.5, -1.0, 2.0]),
                frequency_penalty=rng.choice([0.0, 0.3, -0.4, 1.5]),
            )
        )
        prompts.append([rng.randrange(vocab) for _ in range(rng.randrange(0, 12))])
        outputs.append([rng.randrange(vocab // 4) for _ in range(rng.randrange(0, 20))])
    return params, prompts, outputs


def test_penalties_and_greedy_equal_the_per_sequence_reference():
    """Seen failing with the output counts built from the prompt instead (presence rows differ)."""
    rng, vocab = random.Random(0), 64
    params, prompts, outputs = _random_penalty_rows(rng, 40, vocab)
    logits = torch.randn(40, vocab, generator=torch.Generator().manual_seed(0)) * 3
    batch = _batch(params, logits, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits.clone(), batch)
    g = torch.Generator()
    for i, p in enumerate(params):
        want = ref_penalties(logits[i].clone(), p, prompts[i], outputs[i])
        assert torch.allclose(got[i], want, rtol=1e-6, atol=1e-6)
        assert sample(logits, batch).token_ids[i] == sample_one(
            logits[i].clone(), p, prompts[i], outputs[i], g
        )


CASES = [
    SP(temperature=1.0),
    SP(temperature=0.7),
    SP(temperature=1.3, top_k=3),
    SP(temperature=0.9, top_p=0.6),
    SP(temperature=1.0, min_p=0.2),
    SP(temperature=0.8, top_k=3, top_p=0.7, min_p=0.05),
]


@pytest.mark.parametrize(
    "params", CASES, ids=lambda p: f"T{p.temperature}k{p.top_k}p{p.top_p}m{p.min_p}"
)
def test_distribution_matches_the_filter_semantics(params):
    """4000 draws over fresh (seed, position) keys: total variation to the independent
    Python statement of the semantics < 0.04, and no draw outside the kept set. Seen failing
    with top-p applied before top-k's renormalization (top_k=3, top_p=0.7 case)."""
    logits = torch.tensor([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -3.0])
    n = 4000
    batch = _batch(
        [params] * n, logits, seeds=[7 + i // 50 for i in range(n)], positions=list(range(n))
    )
    tokens = sample(logits.expand(n, -1), batch).tokens
    freq = torch.bincount(tokens, minlength=8).double() / n
    want = torch.tensor(expected_probs(logits.tolist(), params), dtype=torch.float64)
    assert float((freq - want).abs().sum() / 2) < 0.04
    assert float(freq[want == 0].sum()) == 0.0
    probs = filtered_probs(logits.expand(2, -1), batch_two := _batch([params] * 2, logits))
    assert torch.allclose(probs[0].double(), want, atol=1e-5) and batch_two.size == 2


def test_same_seed_position_logits_same_token_whatever_the_batch():
    """Row order and company never change a row's token. Seen failing with the noise keyed by
    the batch row instead of the sequence's seed."""
    gen = torch.Generator().manual_seed(1)
    vocab = 300
    target = torch.randn(vocab, generator=gen)
    mine = SP(temperature=0.9, top_p=0.95, seed=11)
    alone = sample(target[None], _batch([mine], target[None], seeds=[11], positions=[40]))
    others = [SP(temperature=0), SP(temperature=1.0, top_k=4), SP(temperature=0.5, min_p=0.1)]
    for trial in range(6):
        rows = others[: trial % 4] + [mine]
        random.Random(trial).shuffle(rows)
        logits = torch.randn(len(rows), vocab, generator=gen)
        at = rows.index(mine)
        logits[at] = target
        seeds = [100 + i for i in range(len(rows))]
        seeds[at] = 11
        positions = [3] * len(rows)
        positions[at] = 40
        got = sample(logits, _batch(rows, logits, seeds=seeds, positions=positions))
        assert got.token_ids[at] == alone.token_ids[0]


BAD = [
    SP(temperature=1e-300),
    SP(temperature=1e-45),
    SP(temperature=1.0, top_p=1e-300),
    SP(temperature=1e-4, repetition_penalty=1e-300),
    SP(temperature=2.0, repetition_penalty=1e300, presence_penalty=2, frequency_penalty=-2),
    SP(temperature=1e-5, min_p=1.0, top_k=1),
]


def test_extreme_values_never_nan_and_leave_bystanders_alone():
    """Seen failing (NaN probabilities, then a wrong bystander token through the shared
    candidate path) with GREEDY_EPS set to 0 and the penalty clamp removed."""
    gen = torch.Generator().manual_seed(2)
    vocab = 500
    logits = torch.randn(len(BAD) + 1, vocab, generator=gen) * 5
    normal = SP(temperature=0.8, top_p=0.9, seed=3)
    params = [normal] + BAD
    kw = dict(prompts=[[1, 2, 3]] * len(params), outputs=[[4, 5, 5]] * len(params))
    batch = _batch(params, logits, seeds=list(range(len(params))), **kw)
    mixed = sample(logits, batch)
    alone = sample(
        logits[:1], _batch([normal], logits[:1], seeds=[0], **{k: v[:1] for k, v in kw.items()})
    )
    assert mixed.token_ids[0] == alone.token_ids[0]
    assert all(0 <= t < vocab for t in mixed.token_ids)
    probs = filtered_probs(logits, batch)
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(-1), torch.ones(len(params)), atol=1e-4)


def test_cpu_candidates_give_the_whole_vocabulary_answer(monkeypatch):
    """The top-K shortcut equals a full sort, including rows whose nucleus reaches past K (flat
    logits). Seen failing with `covered` returning all True (the flat rows' tokens change)."""
    gen = torch.Generator().manual_seed(3)
    vocab, n = 4000, 48
    peaked = torch.randn(n // 2, vocab, generator=gen) * 6
    flat = torch.randn(n // 2, vocab, generator=gen) * 0.1
    logits = torch.cat([peaked, flat])
    params = [
        SP(temperature=0.8, top_p=0.9),
        SP(temperature=1.0, top_k=50, top_p=0.5),
        SP(temperature=1.2, min_p=0.02),
        SP(temperature=1.0, top_k=2000),
    ] * (n // 4)
    batch = _batch(params, logits, seeds=list(range(n)), positions=list(range(n)))
    monkeypatch.setattr(sampler_mod, "CPU_CANDIDATES", (64, 512))
    short = sample(logits, batch).token_ids
    monkeypatch.setattr(sampler_mod, "CPU_CANDIDATES", (vocab,))
    assert sample(logits, batch).token_ids == short


def test_logprobs_are_raw_and_allowed_mask_is_respected():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 40, generator=gen)
    params = [SP(temperature=0, logprobs=2), SP(temperature=1.0, top_p=0.9), SP(logprobs=0)]
    batch = _batch(params, logits)
    allowed = torch.zeros(3, 40, dtype=torch.bool)
    allowed[:, 30:] = True
    got = sample(logits, batch, allowed_mask=allowed)
    assert all(t >= 30 for t in got.token_ids)
    raw = logits.log_softmax(-1)
    lp = got.logprobs[0]
    assert lp.token_id == got.token_ids[0]
    assert lp.logprob == pytest.approx(float(raw[0, lp.token_id]), abs=1e-6)
    assert [t for t, _ in lp.top] == raw[0].topk(2).indices.tolist()
    assert got.logprobs[1] is None and got.logprobs[2].top == ()


def test_token_is_gumbel_max_over_filtered_probs_keyed_by_token_id():
    """The contract speculative decoding relies on: token = argmax over the kept ids of
    log q(id) + gumbel(row_keys(seed, position), id) with q = filtered_probs. Seen failing with
    the noise keyed by candidate rank instead of token id."""
    from app.engine.sampling.noise import gumbel, row_keys

    gen = torch.Generator().manual_seed(5)
    n, vocab = 64, 200
    logits = torch.randn(n, vocab, generator=gen) * 2
    params = [SP(temperature=0.7, top_p=0.9), SP(temperature=1.0), SP(top_k=7, min_p=0.01)]
    batch = _batch((params * n)[:n], logits, seeds=[3] * n, positions=list(range(n)))
    q = filtered_probs(logits, batch)
    keys = row_keys(batch.seeds, batch.positions)
    noisy = q.log() + gumbel(keys, torch.arange(vocab).expand(n, -1))
    assert sample(logits, batch).token_ids == noisy.argmax(-1).tolist()


def test_skipping_unused_filters_gives_the_general_paths_tokens():
    """A batch with no top-k (no min-p) row skips those ops (SamplingBatch.any_top_k /
    any_min_p); its tokens equal the general path's, the rows that reach past the first
    candidates (flat logits) and mixed batches (greedy + plain + filtered) included.
    Seen failing with the skipped top-k path's probabilities halved."""
    import dataclasses

    gen = torch.Generator().manual_seed(6)
    vocab, n = 4096, 24
    logits = torch.cat(
        [torch.randn(n // 2, vocab, generator=gen) * 5, torch.randn(n // 2, vocab, generator=gen)]
    )
    mixes = [
        [SP(temperature=0.8, top_p=0.9)] * n,
        [SP(temperature=0.8, top_p=0.9), SP(temperature=0), SP(temperature=1.1)] * (n // 3),
    ]
    for params in mixes:
        batch = _batch(params, logits, seeds=list(range(n)), positions=list(range(n)))
        assert not batch.any_top_k and not batch.any_min_p
        general = dataclasses.replace(batch, any_top_k=True, any_min_p=True)
        assert sample(logits, batch).token_ids == sample(logits, general).token_ids


def test_greedy_tokens_equal_argmax_with_ties_nan_and_inf():
    """greedy_tokens (max(-1) on CPU) returns argmax's index: the first maximal one, NaN
    counted as the maximum, rows of -inf included. Seen failing with the last maximal index
    (V - 1 - argmax of the flipped rows)."""
    from app.engine.sampler import greedy_tokens

    gen = torch.Generator().manual_seed(7)
    for vocab in (7, 64, 4096):
        x = torch.randint(0, 4, (9, vocab), generator=gen).float()  # many ties
        x[2, 5 % vocab] = float("nan")
        x[3] = float("-inf")
        assert torch.equal(greedy_tokens(x), x.argmax(-1))
        assert torch.equal(greedy_tokens(x.t().contiguous().t()), x.argmax(-1))
