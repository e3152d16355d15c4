"""Position-keyed random numbers: a counter-based hash of (seed, position, token id).

Sampling noise must not live in a per-request generator whose state stays on the replica that
sampled: the token at position p of a seeded request depends only on (seed, p, logits), so the
prefill replica, the decode replica, an offline run and a preempted run all draw the same
token. The noise is a pure function of its key, computed in int64 tensor ops (no Python loop
over the batch or the vocabulary), keyed by token id (never by sorted rank), so the noise of a
candidate subset equals the full-vocabulary noise restricted to it.

The mixer is splitmix64's finalizer. torch int64 arithmetic wraps modulo 2**64 (two's
complement) on CPU and CUDA, which is what the hash needs; right shifts are arithmetic on int64,
so each one is masked back to a logical shift. `tests/engine/test_sampling_noise.py` checks the
tensor version bit for bit against a pure-Python uint64 reference.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_TOKEN_STRIDE = _signed(0xD1B54A32D192ED03)  # odd: token ids map to distinct lanes
_POS_STRIDE = _signed(0xAEF17502108EF2D9)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _xor_shr_(z: torch.Tensor, tmp: torch.Tensor, s: int) -> torch.Tensor:
    """z ^= z >>> s in place (tmp: a scratch tensor of z's shape)."""
    torch.bitwise_right_shift(z, s, out=tmp)
    tmp &= (1 << (64 - s)) - 1
    return z.bitwise_xor_(tmp)


def mix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer over int64 bits, in place (over [B, V] a copy per step is
    ~300 MB: the hash reuses two buffers)."""
    tmp = torch.empty_like(z)
    z += GOLDEN
    _xor_shr_(z, tmp, 30).mul_(_M1)
    _xor_shr_(z, tmp, 27).mul_(_M2)
    return _xor_shr_(z, tmp, 31)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer over int64 bits (any shape)."""
    return mix64_(x.clone())


def seed_to_int64(seed: int) -> int:
    """Any Python int seed -> the int64 with its low 64 bits."""
    return _signed(seed)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """seeds, positions: [B] int64 -> [B] int64 keys; stream separates independent draws
    at the same position (e.g. a speculative acceptance test vs the Gumbel noise)."""
    return mix64(mix64(seeds ^ _signed(stream * GOLDEN)) + positions * _POS_STRIDE)


def uniform(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """keys: [B] int64, token_ids: [B, K] int64 -> [B, K] float32 uniform in (0, 1).

    23 random bits: (bits + 0.5) / 2**23 is exact in float32 (24-bit significand) and never
    0 or 1, so log(-log(u)) is finite.
    """
    h = token_ids * _TOKEN_STRIDE
    h += keys[:, None]
    mix64_(h)
    h >>= 41
    h &= (1 << 23) - 1  # the top 23 bits, in [0, 2**23)
    u = h.to(torch.float32)
    return u.add_(0.5).mul_(1.0 / (1 << 23))


def gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[B, K] float32 standard Gumbel noise: -log(-log(u)), finite (|g| < 17)."""
    return uniform(keys, token_ids).log_().neg_().log_().neg_()
