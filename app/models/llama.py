"""Llama-style dense decoders: Llama 2/3, Qwen2 (qkv bias), Qwen3 (q/k norm), Mistral."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from app.config import ModelConfig
from app.models.activation import silu_and_mul
from app.models.hooks import ModelHooks
from app.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from app.models.parallel import SINGLE, TPContext
from app.models.rotary import RotaryEmbedding


class AttentionFn(Protocol):
    """Paged attention supplied by the engine: writes k/v to the layer's cache, then attends.

    q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor): ...


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPContext, rotary: RotaryEmbedding):
        super().__init__()
        self.layer = layer
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            d,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            bias=cfg.attention_bias,
            tp=tp,
        )
        self.n_heads, self.n_kv, self.head_dim = self.qkv_proj.n_heads, self.qkv_proj.n_kv, d
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, tp=tp)
        self.rotary = rotary  # shared by all layers
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, positions, x, attn: AttentionFn):  # x: [T, hidden]
        t, d, hq, hkv = x.shape[0], self.head_dim, self.n_heads, self.n_kv
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        # qkv and the q/k norms' outputs are this call's own: rotated in place where the
        # C++ kernel takes them (float32 CPU), else into new tensors.
        if self.q_norm is None:  # q and k side by side: one rotation for both
            qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
            q, k = self.rotary.rotate(positions, qk, inplace=True).split([hq, hkv], 1)
        else:
            q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
            q = self.rotary.rotate(positions, self.q_norm(q), inplace=True)
            k = self.rotary.rotate(positions, self.k_norm(k), inplace=True)
        o = attn(self.layer, q, k, v)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, hq * d))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [i, i], tp=tp)
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, tp=tp)

    def forward(self, x):  # [T, hidden] -> [T, hidden]
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class PreNormDecoderLayer(nn.Module):
    """x -> h = x + attn(norm1(x)) -> h + mlp(norm2(h)); subclasses set self_attn, mlp,
    input_layernorm and post_attention_layernorm.

    The stack carries the residual stream beside each block's output, as vLLM does, so each
    residual add happens inside the next norm (`RMSNorm.add_norm`: one C++ call on float32
    CPU instead of an add and a norm). Same values as the written-out form."""

    def forward(self, positions, x, attn):
        """One layer on its own (an MTP draft layer): x [T, hidden] -> [T, hidden]."""
        out, residual = self.forward_residual(positions, x, None, attn)
        return residual + out

    def forward_residual(self, positions, hidden, residual, attn):
        """(hidden, residual) -> (mlp output, residual); the layer's output is their sum.
        residual None: hidden is the layer's input itself (the first layer), left unchanged.
        A given residual is updated in place (it is the stack's own)."""
        if residual is None:
            residual = hidden.clone(memory_format=torch.contiguous_format)
            h = self.input_layernorm(hidden)
        else:
            h, residual = self.input_layernorm.add_norm(hidden, residual)
        h = self.self_attn(positions, h, attn)
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(h), residual


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPContext, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer, tp, rotary)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderStack(nn.Module):
    """Embedding -> decoder layers (PreNormDecoderLayer) -> final norm; subclasses build the
    three parts."""

    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: RMSNorm

    def forward(self, ids, positions, attn):  # ids, positions [T] -> [T, hidden]
        x, residual = self.embed_tokens(ids), None
        for layer in self.layers:
            x, residual = layer.forward_residual(positions, x, residual, attn)
        return self.norm(x) if residual is None else self.norm.add_norm(x, residual)[0]


class LlamaModel(DecoderStack):
    def __init__(self, cfg: ModelConfig, tp: TPContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, tp, rotary) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(ModelHooks, nn.Module):
    # checkpoint name fragment -> (our parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TPContext = SINGLE):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn):
        """ids, positions: [T] -> hidden states [T, hidden]."""
        return self.model(ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden)
