"""What one KV cache holds (`KVCacheSpec`) and the layout string readers of its KV agree on.

Layout string: `paged-v1:L{layers}:H{kv heads}:D{head dim}:B{block size}:tp{..}[:mla]`. It is
built only by `KVLayout.__str__` and read only by `KVLayout.parse`; `LAYOUT_VERSION` below is
its one definition. Exported chunks always carry all KV heads (tensor-parallel ranks gather
theirs), so a cache's layout is "tp1" whatever the replica's TP size.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.kv.dtypes import KVDtype, kv_dtype

LAYOUT_VERSION = "paged-v1"


class LayoutError(ValueError):
    """A layout string this build cannot read."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape facts a reader must share with the writer to use exported KV."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    use_mla: bool = False  # one plane (MLA latent + rope key) instead of K and V

    @property
    def num_planes(self) -> int:
        return 1 if self.use_mla else 2

    def __str__(self) -> str:
        tp = f"tp{self.tp_size}" if self.tp_size == 1 else f"tp{self.tp_rank}/{self.tp_size}"
        return (
            f"{LAYOUT_VERSION}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}"
            f":B{self.block_size}:{tp}" + (":mla" if self.use_mla else "")
        )

    @classmethod
    def parse(cls, text: str) -> KVLayout:
        """Inverse of ``str``; also reads ``tp{rank}/{size}`` and ``tp{size}``."""
        try:
            parts = text.split(":")
            use_mla = len(parts) == 7 and parts[-1] == "mla"
            version, layers, heads, dim, block, tp = parts[:-1] if use_mla else parts
            if version != LAYOUT_VERSION:
                raise ValueError(f"layout version {version!r}, this build reads {LAYOUT_VERSION!r}")
            rank, _, size = tp.removeprefix("tp").rpartition("/")
            for prefix, value in {"L": layers, "H": heads, "D": dim, "B": block}.items():
                if not value.startswith(prefix):
                    raise ValueError(f"expected {prefix}<n>, got {value!r}")
            dims = (int(v[1:]) for v in (layers, heads, dim, block))
            return cls(*dims, int(rank or 0), int(size), use_mla)
        except ValueError as e:
            raise LayoutError(f"unreadable KV layout {text!r}: {e}") from None


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """One rank's paged cache: kv [L, P, blocks, block_size, Hkv, D] in dtype.storage, plus
    scales [L, P, blocks, block_size, Hkv] in dtype.scale when the dtype has them. P = 2 (K and
    V), or 1 for MLA, whose one "head" is the latent + RoPE key and whose V aliases it."""

    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    block_size: int
    dtype: KVDtype  # also accepts a name or a torch dtype (normalised to the table row)
    use_mla: bool = False
    total_kv_heads: int = 0  # KV heads of the whole model (0: num_kv_heads)

    def __post_init__(self):
        object.__setattr__(self, "dtype", kv_dtype(self.dtype))

    @property
    def num_planes(self) -> int:
        return 1 if self.use_mla else 2

    def bytes_per_token(self) -> int:
        per_head = self.dtype.bytes_per_token_head(self.head_dim)
        return self.num_layers * self.num_planes * self.num_kv_heads * per_head

    def bytes_per_block(self) -> int:
        return self.bytes_per_token() * self.block_size

    def num_blocks(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block()

    @property
    def chunk_kv_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads

    @property
    def layout(self) -> str:
        """Names everything a reader of exported KV must agree on."""
        dims = (self.num_layers, self.chunk_kv_heads, self.head_dim, self.block_size)
        return str(KVLayout(*dims, use_mla=self.use_mla))

    def tensor_shapes(self, num_blocks: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """(kv shape, scales shape or None) of a cache of num_blocks blocks."""
        kv = (self.num_layers, self.num_planes, num_blocks, self.block_size)
        kv += (self.num_kv_heads, self.head_dim)
        return kv, kv[:-1] if self.dtype.has_scales else None
