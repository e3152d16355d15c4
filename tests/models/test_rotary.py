"""app/models/rotary.py: RoPE against the rotate-half formula written out, and the reuse of
one forward's cos/sin rows by every layer."""

from __future__ import annotations

import torch

from app.models.rotary import RotaryEmbedding

D, THETA = 16, 10000.0


def reference(positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]: pair i (< D/2) is (x[i], x[i + D/2]), turned by position * theta^(-2i/D)."""
    inv = THETA ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = positions.double()[:, None, None] * inv  # [T, 1, D/2]
    a, b = x.double()[..., : D // 2], x.double()[..., D // 2 :]
    return torch.cat((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()), -1)


def test_rotate_matches_the_formula_and_q_k_together_equal_apart():
    rope = RotaryEmbedding(D, 64, THETA)
    pos = torch.tensor([0, 5, 63])
    q, k = torch.randn(3, 4, D), torch.randn(3, 2, D)
    q_out, k_out = rope(pos, q, k)
    torch.testing.assert_close(q_out.double(), reference(pos, q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out.double(), reference(pos, k), atol=1e-5, rtol=1e-5)
    both = rope.rotate(pos, torch.cat((q, k), 1))  # how LlamaAttention rotates q and k
    assert torch.equal(both, torch.cat((q_out, k_out), 1))
    bf16 = rope.rotate(pos, q.bfloat16())
    assert bf16.dtype == torch.bfloat16


def test_a_new_positions_tensor_gets_its_own_rows():
    """The rows are reused only for the very same positions tensor (the layers of one
    forward). Seen failing: with `tables` returning the kept rows whenever there are some,
    the second call rotates by the first call's positions."""
    rope = RotaryEmbedding(D, 64, THETA)
    x = torch.randn(2, 1, D)
    first, second = torch.tensor([1, 2]), torch.tensor([30, 40])
    rope.rotate(first, x)
    tol = {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(rope.rotate(second, x).double(), reference(second, x), **tol)
    torch.testing.assert_close(rope.rotate(first, x).double(), reference(first, x), **tol)
    assert rope.tables(first)[0] is rope.tables(first)[0]  # reused within a forward
