"""The position-keyed noise: bit-exact against a pure-Python uint64 splitmix64."""

import math

import torch

from app.engine.sampling import noise

M64 = (1 << 64) - 1


def _mix_ref(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _uniform_ref(seed: int, pos: int, token: int) -> float:
    key = _mix_ref(_mix_ref(seed & M64) + pos * 0xAEF17502108EF2D9)
    h = _mix_ref(key + token * 0xD1B54A32D192ED03)
    return ((h >> 41) + 0.5) / (1 << 23)


def test_tensor_hash_matches_python_uint64_reference():
    """Wrapping int64 multiply and masked (logical) shifts give splitmix64's bits; seen failing
    with `_shr` replaced by a plain `>>` (arithmetic shift): values differ for negative lanes."""
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 123456789123456789, 2**70 + 5]
    positions = [0, 1, 7, 4096, 2**31 + 3, 10**12, 99]
    tokens = torch.tensor([[0, 1, 2, 151_999, 2**20 + 17]] * len(seeds))
    keys = noise.row_keys(
        torch.tensor([noise.seed_to_int64(s) for s in seeds]), torch.tensor(positions)
    )
    got = noise.uniform(keys, tokens)
    for r, (s, p) in enumerate(zip(seeds, positions)):
        for c, t in enumerate(tokens[r].tolist()):
            assert float(got[r, c]) == _uniform_ref(s, p, t)


def test_uniform_is_uniform_and_gumbel_finite():
    keys = noise.row_keys(torch.tensor([5, 6]), torch.tensor([0, 1]))
    ids = torch.arange(200_000).expand(2, -1)
    u = noise.uniform(keys, ids)
    assert float(u.min()) > 0 and float(u.max()) < 1
    counts = torch.histc(u[0], bins=10, min=0, max=1)
    assert (counts - 20_000).abs().max() < 5 * math.sqrt(20_000)  # ~5 sigma
    assert not torch.equal(u[0], u[1])
    assert torch.isfinite(noise.gumbel(keys, ids)).all()


def test_streams_and_neighbouring_positions_are_independent():
    ids = torch.arange(50_000)[None]
    a = noise.uniform(noise.row_keys(torch.tensor([9]), torch.tensor([3])), ids)[0]
    b = noise.uniform(noise.row_keys(torch.tensor([9]), torch.tensor([4])), ids)[0]
    c = noise.uniform(noise.row_keys(torch.tensor([9]), torch.tensor([3]), stream=1), ids)[0]
    for other in (b, c):
        assert abs(float(torch.corrcoef(torch.stack([a, other]))[0, 1])) < 0.02
