"""Published INT4 checkpoint layouts <-> our canonical `Int4Weight` (pure tensor code).

- compressed-tensors `pack-quantized` (4 bit): `weight_packed [N, K/8] int32`, nibble i of
  word j = column 8j + i, stored as `q + 8` with signed q in -8..7 (so the stored nibble *is*
  our unsigned code); `weight_scale [N, K/g]`; asymmetric `weight_zero_point [N/8, K/g]`
  int32 packed the same way along N (dim 0); `weight_shape = [N, K]`; optional
  `weight_g_idx [K]` (activation order). `W = (q - zp) * s`.
- GPTQ (AutoGPTQ / GPTQModel, `checkpoint_format` gptq): `qweight [K/8, N]` packed along K,
  `qzeros [K/g, N/8]` packed along N and stored as `z - 1` (v1; `gptq_v2` stores z),
  `scales [K/g, N]`, `g_idx [K]` (group of each input column). `W[k,n] = (q - z) * s`.
- AWQ GEMM: `qweight [K, N/8]` packed along N with nibble i of word c holding column
  `8c + AWQ_ORDER[i]`, `qzeros [K/g, N/8]` interleaved the same way, `scales [K/g, N]`.
"""

from __future__ import annotations

import torch

from app.quant.int4 import SYM_ZERO, Int4Weight, pack_int4
from slimserve_kernels.reference import unpack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its 8
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in nibble AWQ_REVERSE[j]


def group_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """Input permutation that makes g_idx's groups contiguous; None if already contiguous.

    Raises if the groups do not each hold exactly `group_size` columns.
    """
    k = g_idx.numel()
    contiguous = torch.arange(k, device=g_idx.device) // group_size
    g_idx = g_idx.long()
    if torch.equal(g_idx, contiguous):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], contiguous):
        raise ValueError(f"g_idx does not assign exactly {group_size} input columns per group")
    return perm


def _permute_columns(qw: Int4Weight, perm: torch.Tensor | None) -> Int4Weight:
    if perm is None:
        return qw
    codes = qw.codes()[:, perm]
    return Int4Weight(pack_int4(codes), qw.scales, qw.zeros, qw.group_size)


def _unpack_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """[ceil(R/8), C] int32 packed along dim 0 -> [R, C] uint8."""
    return unpack_int4(packed.T.contiguous()).T[:rows].contiguous()


def _symmetric_or_zeros(zeros: torch.Tensor, symmetric: bool, what: str) -> torch.Tensor | None:
    if not symmetric:
        return zeros
    if not bool((zeros == SYM_ZERO).all()):
        raise ValueError(f"{what}: config says symmetric but zero points are not all 8")
    return None


def from_compressed_tensors(
    parts: dict[str, torch.Tensor], group_size: int, symmetric: bool
) -> tuple[Int4Weight, torch.Tensor | None]:
    """compressed-tensors pack-quantized parts -> (Int4Weight, input permutation or None)."""
    n, k = (int(v) for v in parts["weight_shape"].tolist())
    if k % 8:
        raise ValueError(f"pack-quantized in_features={k} is not a multiple of 8")
    qweight = parts["weight_packed"][:, : k // 8].contiguous()
    scales = parts["weight_scale"]
    zeros = None
    if "weight_zero_point" in parts:
        zeros = _unpack_rows(parts["weight_zero_point"], n)
    if not symmetric and zeros is None:
        raise ValueError("asymmetric pack-quantized weight has no weight_zero_point")
    qw = Int4Weight(qweight, scales, zeros, group_size)
    perm = group_perm(parts["weight_g_idx"], group_size) if "weight_g_idx" in parts else None
    return _permute_columns(qw, perm), perm


def from_gptq(
    parts: dict[str, torch.Tensor], group_size: int, symmetric: bool, zeros_offset: int = 1
) -> tuple[Int4Weight, torch.Tensor | None]:
    """GPTQ parts (qweight, qzeros, scales, g_idx) -> (Int4Weight, input permutation)."""
    qweight = parts["qweight"].T.contiguous()  # [N, K/8]: word j of row n = k in 8j..8j+7
    n = qweight.shape[0]
    zeros = (unpack_int4(parts["qzeros"]).to(torch.int32) + zeros_offset) & 0xF  # [K/g, N]
    zeros = zeros[:, :n].T.contiguous().to(torch.uint8)
    scales = parts["scales"].T.contiguous()
    qw = Int4Weight(qweight, scales, _symmetric_or_zeros(zeros, symmetric, "gptq"), group_size)
    perm = group_perm(parts["g_idx"], group_size) if "g_idx" in parts else None
    return _permute_columns(qw, perm), perm


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, C/8] int32 AWQ-interleaved -> [R, C] uint8 in natural column order."""
    raw = unpack_int4(packed)
    r, c = raw.shape
    return raw.view(r, c // 8, 8)[..., list(AWQ_REVERSE)].reshape(r, c)


def from_awq(parts: dict[str, torch.Tensor], group_size: int) -> tuple[Int4Weight, None]:
    """AWQ GEMM parts (qweight, qzeros, scales) -> (Int4Weight, None); always asymmetric."""
    codes = _awq_unpack(parts["qweight"]).T.contiguous()  # [N, K]
    zeros = _awq_unpack(parts["qzeros"]).T.contiguous()  # [N, K/g]
    scales = parts["scales"].T.contiguous()
    return Int4Weight(pack_int4(codes), scales, zeros, group_size), None


def to_compressed_tensors(qw: Int4Weight) -> dict[str, torch.Tensor]:
    """Int4Weight -> compressed-tensors pack-quantized parts (suffix -> tensor)."""
    n, k = qw.shape
    out = {
        "weight_packed": qw.qweight.contiguous(),
        "weight_scale": qw.scales.contiguous(),
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if qw.zeros is not None:
        zeros = torch.nn.functional.pad(qw.zeros, (0, 0, 0, -n % 8))  # [N8, K/g]
        out["weight_zero_point"] = pack_int4(zeros.T.contiguous()).T.contiguous()
    return out


def expand_scale(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Broadcast a tensor/channel/group/block scale to a [N, K] weight's shape."""
    n, k = shape
    s = scale.float().reshape(-1, 1) if scale.dim() <= 1 else scale.float()
    rn, rk = -(-n // s.shape[0]), -(-k // s.shape[1])
    return s.repeat_interleave(rn, 0)[:n].repeat_interleave(rk, 1)[:, :k]
