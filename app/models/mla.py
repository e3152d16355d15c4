"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2), absorbed-weights formulation.

Per token the layer caches one vector of width R + Dr: the RMS-normed KV latent c (R =
kv_lora_rank) and the shared RoPE key k_pe (Dr = qk_rope_head_dim), as a single KV "head" in
a one-plane paged cache (KVCacheSpec.use_mla). kv_b_proj holds, per head h, W_UK[h]
[Dn, R] and W_UV[h] [Dv, R]. Since q_nope.k_nope = q_nope.(W_UK c) = (W_UK^T q_nope).c,
attention runs as MQA over the cache with

    query_h = [W_UK[h]^T q_nope_h ; q_pe_h]          [R + Dr]
    key     = value = [c ; k_pe]                     [R + Dr]  (V aliases K: one plane)
    out_h   = W_UV[h] (softmax(query_h . key * scale) @ value)[:R]

so the per-head keys and values are never materialized and the cache holds 576 numbers per
token per layer for DeepSeek-V3 instead of 2 * 128 * 192. Prefill uses the same path (one
attention for prefill, chunked prefill and decode; the compute-cheaper non-absorbed prefill
is a possible optimization). Heads are split across TP ranks; the latent is replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from app.config import ModelConfig
from app.models.layers import ColumnParallelLinear, ReplicatedLinear, RMSNorm, RowParallelLinear
from app.models.mla_rope import MLARotaryEmbedding
from app.models.parallel import TPContext

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the default eps in the reference


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPContext, rotary: MLARotaryEmbedding):
        super().__init__()
        raw, hidden, bias = cfg.raw, cfg.hidden_size, cfg.attention_bias
        self.layer, self.rotary = layer, rotary
        self.q_lora_rank = raw.get("q_lora_rank")
        self.kv_lora_rank = raw["kv_lora_rank"]
        self.nope, self.rope = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"]
        self.v_head_dim = raw["v_head_dim"]
        heads = cfg.num_attention_heads
        self.n_heads = tp.split(heads, "num_attention_heads")
        qk = self.nope + self.rope
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias, tp=tp)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk, tp=tp)
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk, tp=tp)
        r = self.kv_lora_rank
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, r + self.rope, bias=bias, tp=tp)
        self.kv_a_layernorm = RMSNorm(r, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(r, heads * (self.nope + self.v_head_dim), tp=tp)
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias=bias, tp=tp)
        self._absorbed: tuple | None = None

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, Dn, R], W_UV [H, Dv, R]) from kv_b_proj, dense even if it is INT4/FP8."""
        proj = self.kv_b_proj
        if self._absorbed is None or self._absorbed[0] is not proj:  # built once per module
            if hasattr(proj, "dequantized_weight"):  # Int4Linear / Fp8Linear (app.quant)
                w = proj.dequantized_weight(proj.params_dtype)
            else:
                w = proj.weight.detach()
            w = w.reshape(self.n_heads, self.nope + self.v_head_dim, self.kv_lora_rank)
            self._absorbed = (proj, w[:, : self.nope], w[:, self.nope :])
        return self._absorbed[1], self._absorbed[2]

    def _query(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, H, Dn + Dr]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        return q.view(x.shape[0], self.n_heads, self.nope + self.rope)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn) -> torch.Tensor:
        t, r = x.shape[0], self.kv_lora_rank
        q_nope, q_pe = self._query(x).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([r, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, R]
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.unsqueeze(1))  # [T, H, Dr], [T, 1, Dr]
        w_uk, w_uv = self.absorbed_weights()
        q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # [T, H, R]
        query = torch.cat((q_lat, q_pe), dim=-1)  # [T, H, R + Dr]
        entry = torch.cat((latent.unsqueeze(1), k_pe), dim=-1)  # [T, 1, R + Dr]: the cache row
        o_lat = attn(self.layer, query, entry, None)[..., :r]  # [T, H, R]
        o = torch.einsum("thr,hvr->thv", o_lat, w_uv)  # [T, H, Dv]
        return self.o_proj(o.reshape(t, self.n_heads * self.v_head_dim))
