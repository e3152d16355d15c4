"""Tensor-parallel-ready building blocks shared by the model families.

Each parameter carries a `weight_loader(param, loaded, shard_id)` that copies this rank's
slice of a checkpoint tensor into it, so loading is table-driven (see loader.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app.models.parallel import SINGLE, TPContext
from app.models.parallel_load import materialize
from slimserve_kernels import cpu_fused, cpu_linear


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _linear(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor,  # [out, in]
    packed: torch.Tensor | None,  # weight as the CPU kernel's panels, or None
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x W^T (+ b): the C++ CPU kernel over `packed` when the weight has panels (the kernel
    was on and built when pack_cpu_linears ran), else F.linear."""
    if packed is not None:
        return cpu_linear.linear(x, packed, weight.shape[0], bias)
    return F.linear(x, weight, bias)


def _copy_into(param: torch.Tensor, loaded) -> None:
    """loaded: a tensor or a LazyTensor already narrowed to this rank's slice (read here)."""
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor shape {tuple(loaded.shape)} != {tuple(param.shape)}")
    param.data.copy_(materialize(loaded))


class LinearBase(nn.Module):
    """y = x W^T + b over this rank's slice of W: [out_per_rank, in_per_rank]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, in_features)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(out_features) if bias else None
        if bias:
            self.bias.weight_loader = self.weight_loader
        self.packed: torch.Tensor | None = None  # CPU kernel panels of weight (pack_cpu_linears)

    def weight_loader(self, param, loaded, shard_id=None):
        _copy_into(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.weight, self.packed, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias=False, tp: TPContext = SINGLE):
        super().__init__(in_features, out_features, bias, tp)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; output stays sharded unless gather_output."""

    def __init__(self, in_f: int, out_f: int, bias=False, tp=SINGLE, gather_output=False):
        super().__init__(in_f, tp.split(out_f, "output features"), bias, tp)
        self.gather_output = gather_output

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[0]
        _copy_into(param, loaded.narrow(0, self.tp.rank * n, n))

    def forward(self, x):
        y = super().forward(x)
        return self.tp.all_gather_last(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (e.g. gate_proj + up_proj)."""

    def __init__(self, in_f: int, out_sizes: list[int], bias=False, tp=SINGLE):
        super().__init__(in_f, sum(out_sizes), bias, tp)
        self.out_sizes = [tp.split(n, "output features") for n in out_sizes]

    def weight_loader(self, param, loaded, shard_id=None):
        size = self.out_sizes[shard_id]
        offset = sum(self.out_sizes[:shard_id])
        shard = loaded.narrow(0, self.tp.rank * size, size)
        _copy_into(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; heads split by rank (KV heads replicated
    when there are fewer of them than ranks)."""

    def __init__(self, hidden: int, head_dim: int, n_heads: int, n_kv: int, bias=False, tp=SINGLE):
        self.n_heads = tp.split(n_heads, "num_attention_heads")
        self.kv_start, self.n_kv = tp.kv_heads(n_kv)  # first KV head of this rank, count
        self.head_dim = head_dim
        out = (self.n_heads + 2 * self.n_kv) * head_dim * tp.size
        super().__init__(hidden, out, bias, tp)

    def weight_loader(self, param, loaded, shard_id=None):
        d = self.head_dim
        q, kv = self.n_heads * d, self.n_kv * d
        if shard_id == "q":
            offset, size, start = 0, q, self.tp.rank * q
        else:
            offset = q if shard_id == "k" else q + kv
            size, start = kv, self.kv_start * d
        _copy_into(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced, then bias added.

    reduce_results=False leaves the partial sum (the caller reduces once for many layers,
    e.g. all experts of a MoE layer)."""

    def __init__(self, in_f: int, out_f: int, bias=False, tp=SINGLE, reduce_results=True):
        super().__init__(tp.split(in_f, "input features"), out_f, bias, tp)
        self.reduce_results = reduce_results
        assert reduce_results or not bias, "an unreduced partial sum cannot take a bias"

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias is not split
            return _copy_into(param, loaded)
        n = param.shape[1]
        _copy_into(param, loaded.narrow(1, self.tp.rank * n, n))

    def forward(self, x):
        y = _linear(x, self.weight, self.packed, None)
        y = self.tp.all_reduce(y) if self.reduce_results else y
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rows of the embedding table split across ranks; out-of-shard ids contribute zeros."""

    def __init__(self, vocab: int, dim: int, tp: TPContext = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_per_rank = -(-vocab // tp.size)
        self.start = tp.rank * self.vocab_per_rank
        self.vocab = vocab
        self.weight = _param(self.vocab_per_rank, dim)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        rows = loaded[self.start : self.start + self.vocab_per_rank]  # the last rank: fewer
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(materialize(rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.vocab_per_rank)
        out = F.embedding(local.clamp(0, self.vocab_per_rank - 1), self.weight)
        out = out * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-sharded output projection; logits gathered to full vocab: [N, V] float32."""

    packed: torch.Tensor | None = None  # CPU kernel panels of weight (pack_cpu_linears)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = _linear(hidden, self.weight, self.packed, None).float()
        return self.tp.all_gather_last(logits)[..., : self.vocab]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)
        self.weight.weight_loader = lambda p, w, s=None: _copy_into(p, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if x.dim() in (2, 3) and x.stride(-1) == 1 and cpu_fused.takes(x, self.weight):
            return cpu_fused.rms_norm(x, self.weight, self.eps)  # F.rms_norm's bits, one call
        if x.dtype == torch.float32:  # one op; bitwise the written-out form below in float32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype  # narrower: normalize in float32, scale after the cast (as HF does)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor):
        """residual += x in place (the caller owns residual; x is only read), then
        -> (norm(residual), residual): the decoder's residual add and the next norm, one C++
        call on float32 CPU (vLLM's fused_add_rms_norm); same values as add, then norm."""
        if (
            x.dim() == 2
            and x.stride(-1) == 1
            and residual.is_contiguous()
            and x.shape == residual.shape
            and cpu_fused.takes(x, residual, self.weight)
        ):
            return cpu_fused.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual.add_(x)
        return self(residual), residual


def column_major_linears(model: nn.Module) -> int:
    """Stores every dense float32 linear weight W [out, in] column-major (W.t() contiguous),
    in place; the same Parameter objects, values and shapes. Returns how many it moved.

    Why (CPU): F.linear(x, W) then runs MKL's plain x @ W.t() GEMM instead of the transposed
    one, 1.2-2x faster at 1-32 rows on the AMD EPYC of docs/performance.md. Values: identical
    at >= 8 rows; at 1-2 rows MKL's GEMV sums in another order (last-bit differences). Tied
    embedding tables keep their layout (a row gather wants rows contiguous)."""
    tables = {id(m.weight) for m in model.modules() if type(m) is VocabParallelEmbedding}
    moved = 0
    for m in model.modules():
        w = getattr(m, "weight", None) if isinstance(m, (LinearBase, ParallelLMHead)) else None
        if w is None or id(w) in tables or w.dtype != torch.float32 or w.dim() != 2:
            continue
        if w.is_contiguous():
            w.data = w.data.t().contiguous().t()
            moved += 1
    return moved


def pack_cpu_linears(model: nn.Module) -> int:
    """Gives every dense float32 CPU linear (and LM head) the C++ kernel's weight panels
    (slimserve_kernels/cpu_linear.py), so its forward runs the kernel. Returns how many.

    The panels are a copy beside `weight` (one more float32 copy of these weights): the
    Parameter stays as it was for the loaders, tensor parallelism and tied embedding tables.
    A no-op when the kernel is not available (SLIMSERVE_CPU_KERNELS=0, not built) or for
    other dtypes / devices; `unpack_cpu_linears` undoes it (F.linear again). A weight written
    in place after this (`weight.data.copy_`, as the quantization tests do to a dense twin)
    needs this called again: the panels would still hold the old values."""
    if not cpu_linear.available():
        return 0
    packed = 0
    for m in model.modules():
        w = getattr(m, "weight", None) if isinstance(m, (LinearBase, ParallelLMHead)) else None
        if w is None or w.dtype != torch.float32 or w.dim() != 2 or w.device.type != "cpu":
            continue
        m.packed = cpu_linear.pack(w.detach())
        packed += 1
    return packed


def unpack_cpu_linears(model: nn.Module) -> int:
    """Drops the panels pack_cpu_linears gave: F.linear again. Returns how many."""
    dropped = 0
    for m in model.modules():
        if getattr(m, "packed", None) is not None:
            m.packed = None
            dropped += 1
    return dropped
