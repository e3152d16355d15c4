"""DeepSeek-V3 / R1 and Kimi K2 (`DeepseekV3ForCausalLM`): MLA attention + MoE.

Attention is Multi-head Latent Attention (mla.py) with YaRN RoPE (mla_rope.py); MLP layers
are dense for the first `first_k_dense_replace` layers, then routed + shared experts (moe.py).
The model declares its KV cache: one plane, one head of kv_lora_rank + qk_rope_head_dim.
"""

from __future__ import annotations

from torch import nn

from app.config import ModelConfig
from app.kv.dtypes import KVDtype
from app.kv.layout import KVCacheSpec
from app.models.mla import MLAAttention
from app.models.mla_rope import MLARotaryEmbedding, softmax_mscale
from app.models.moe import MoECausalLM
from app.models.parallel import SINGLE, TPContext


class DeepseekV3ForCausalLM(MoECausalLM):
    def __init__(self, cfg: ModelConfig, tp: TPContext = SINGLE):
        super().__init__(cfg, tp)
        raw = cfg.raw
        qk_head_dim = raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]
        # Read by the engine's ModelRunner: the softmax scale of q.k over the absorbed query.
        self.attn_scale = qk_head_dim**-0.5 * softmax_mscale(cfg.rope_scaling)
        self.kv_width = raw["kv_lora_rank"] + raw["qk_rope_head_dim"]

    def make_attention(self, cfg: ModelConfig, layer: int, tp: TPContext) -> nn.Module:
        if not hasattr(self, "rotary"):  # one table for all layers
            self.rotary = MLARotaryEmbedding(
                cfg.raw["qk_rope_head_dim"],
                cfg.max_position_embeddings,
                cfg.rope_theta,
                cfg.rope_scaling,
                interleave=bool(cfg.raw.get("rope_interleave", True)),
            )
        return MLAAttention(cfg, layer, tp, self.rotary)

    def kv_cache_spec(self, block_size: int, dtype: KVDtype) -> KVCacheSpec | None:
        """One plane of [latent ; rope key] per token and layer (same on every TP rank)."""
        n = self.config.num_hidden_layers
        return KVCacheSpec(n, 1, self.kv_width, block_size, dtype, use_mla=True)
