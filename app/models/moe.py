"""Mixture-of-experts execution shared by GLM-4.5/4.6 and DeepSeek-V3 / Kimi K2.

Routing (both families, "noaux_tc"): sigmoid scores per expert; a per-expert correction bias
is added for *choosing* experts only; experts are split into `n_group` groups, each group is
scored by the sum of its two best biased scores, the best `topk_group` groups stay eligible,
and the top `num_experts_per_tok` eligible experts are chosen. Their unbiased scores are the
weights, optionally renormalized to sum to 1, times `routed_scaling_factor`.

Execution (`slimserve_kernels.fused_moe`): the experts' weights are stacked once (moe_fused.py; each
expert's parameters become views of the stacks); the (token, expert) pairs are sorted by
expert; on CUDA two Triton grouped GEMMs run all experts at once (gate+up with SiLU-and-mul
fused, down with the routing weights applied), on CPU torch runs the sorted layout expert by
expert on the stacks. INT4 experts on CPU, act-order INT4 and mixed expert kinds keep the
per-expert module loop (`routed_loop`), which is also the reference the tests compare to.
Experts are ordinary `GatedMLP` modules, so checkpoint names (`experts.{e}.gate_proj`) load
through `packed_modules_mapping` and INT4 swaps them by module replacement (`app.quant`:
`Int4Linear`, compressed-tensors `pack-quantized` experts as in Kimi K2's INT4 release).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

import slimserve_kernels
from app.config import ModelConfig
from app.models.activation import silu_and_mul
from app.models.hooks import ModelHooks
from app.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from app.models.llama import DecoderStack, PreNormDecoderLayer
from app.models.moe_fused import stack_experts
from app.models.mtp import MTPFrontEnd, MTPHead
from app.models.parallel import SINGLE, TPContext

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); the intermediate dim is split across ranks."""

    def __init__(self, hidden: int, intermediate: int, tp: TPContext = SINGLE, reduce=True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, tp=tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp=tp, reduce_results=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def select_experts(
    logits: torch.Tensor,  # [T, E] float32 router logits
    bias: torch.Tensor,  # [E] e_score_correction_bias
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights [T, top_k] float32, expert ids [T, top_k] int64); see the module doc."""
    t, e = logits.shape
    scores = logits.sigmoid()
    biased = scores + bias
    group_scores = biased.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(-1)  # [T, G]
    groups = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
    ids = biased.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class TopKRouter(nn.Module):
    """`mlp.gate`: float32 router weight [E, hidden] and correction bias [E] (never INT4)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        raw = cfg.raw
        if raw.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"MoE scoring_func {raw['scoring_func']!r}: only sigmoid")
        if raw.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"MoE topk_method {raw['topk_method']!r}: only noaux_tc")
        self.num_experts = raw["n_routed_experts"]
        self.top_k = raw["num_experts_per_tok"]
        self.n_group = raw.get("n_group") or 1
        self.topk_group = raw.get("topk_group") or 1
        self.norm_topk_prob = bool(raw.get("norm_topk_prob", True))
        self.scaling = float(raw.get("routed_scaling_factor", 1.0))
        if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
            raise ValueError("n_routed_experts must split into n_group groups of >= 2 experts")
        e, h = self.num_experts, cfg.hidden_size
        self.weight = _fp32_param(e, h)
        self.e_score_correction_bias = _fp32_param(e)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)  # [T, E]
        return select_experts(
            logits,
            self.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.scaling,
        )


def _fp32_param(*shape: int) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)
    p.weight_loader = _copy_fp32
    return p


def _copy_fp32(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor shape {tuple(loaded.shape)} != {tuple(param.shape)}")
    param.data.copy_(loaded.float())


class AbsentExpert(nn.Module):
    """Placeholder for a routed expert another expert-parallel rank owns (no parameters)."""


class MoE(nn.Module):
    """Routed experts + shared experts: `mlp.experts.{e}`, `mlp.gate`, `mlp.shared_experts`.

    Tokens are replicated on every rank (attention ends in an all-reduce) and every rank
    routes them identically. Tensor parallel: each expert's intermediate dim is split across
    ranks. Expert parallel (tp.expert_parallel): each rank owns E / size whole experts and
    runs only the (token, expert) pairs routed to them. Either way a rank's routed + shared
    output is a partial sum, reduced by ONE all-reduce per layer (docs/parallelism.md).
    """

    def __init__(self, cfg: ModelConfig, tp: TPContext = SINGLE):
        super().__init__()
        raw, h = cfg.raw, cfg.hidden_size
        inter = raw["moe_intermediate_size"]
        self.tp = tp
        self.gate = TopKRouter(cfg)
        self.local = tp.experts(self.gate.num_experts)  # the routed experts this rank runs
        expert_tp = SINGLE if tp.expert_parallel else tp  # EP: whole experts
        self.experts = nn.ModuleList(
            GatedMLP(h, inter, expert_tp, reduce=False) if e in self.local else AbsentExpert()
            for e in range(self.gate.num_experts)
        )
        shared = raw.get("n_shared_experts") or 0
        self.shared_experts = GatedMLP(h, inter * shared, tp, reduce=False) if shared else None
        self.use_fused = True  # False: the per-expert module loop (reference, benchmarks)
        self._fused: tuple | None = None  # (first expert's projections, MoEWeights | None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        weights, ids = self.gate(x)  # [T, k] float32, [T, k] int64
        out = self.routed(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)

    def fused_weights(self):
        """The stacked MoEWeights (built on first use, rebuilt if a module replacement swapped
        the expert projections since), or None when the experts cannot be fused."""
        first = self.experts[self.local.start]
        key = (first.gate_up_proj, first.down_proj)
        if self._fused is None or self._fused[0] != key:
            local = [self.experts[e] for e in self.local]
            self._fused = (key, stack_experts(local))
        return self._fused[1]

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts' weighted outputs: [T, hidden] (a partial sum under TP/EP)."""
        w = self.fused_weights() if self.use_fused and len(self.local) else None
        if w is None or (w.kind == "int4" and not slimserve_kernels.use_triton(x)):
            return self.routed_loop(x, weights, ids)
        # Local expert ids; another EP rank's experts fall outside [0, E_local) and are skipped.
        return slimserve_kernels.fused_moe(x, weights, ids - self.local.start, w)

    def routed_loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """One module call per active expert over its slice of gathered tokens: [T, hidden]."""
        k, lo, hi = ids.shape[1], self.local.start, self.local.stop
        flat = ids.flatten()  # [T*k]: row r is token r // k's (r % k)-th expert
        order = flat.argsort(stable=True)  # rows grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # one host sync
        order = order[sum(counts[:lo]) : sum(counts[:hi])]  # rows of the local experts
        token = order // k  # source token of each grouped row
        parts = x.index_select(0, token).split(counts[lo:hi])  # per expert: [n_e, hidden]
        ys = [self.experts[lo + i](p) if len(p) else p for i, p in enumerate(parts)]
        ys = torch.cat(ys) if ys else x.new_empty(0, x.shape[1])
        ys = (ys.float() * weights.flatten()[order].unsqueeze(1)).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)


class MoEDecoderLayer(PreNormDecoderLayer):
    """Pre-norm block; the first `first_k_dense_replace` layers have a dense MLP."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPContext, attention: nn.Module):
        super().__init__()
        self.self_attn = attention
        if layer >= (cfg.raw.get("first_k_dense_replace") or 0):
            self.mlp = MoE(cfg, tp)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(MTPFrontEnd, MoEDecoderLayer):
    """A multi-token-prediction layer: a decoder layer behind the MTP front end."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPContext, attention: nn.Module):
        super().__init__(cfg, layer, tp, attention)
        self.init_front_end(cfg)


class MoEModel(DecoderStack):
    def __init__(self, cfg: ModelConfig, tp: TPContext, make_attention):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            MoEDecoderLayer(cfg, i, tp, make_attention(i)) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MoECausalLM(ModelHooks, nn.Module):
    """Base of the MoE families: subclasses give `make_attention(cfg, layer, tp)`.

    Multi-token-prediction layers some checkpoints carry (`model.layers.{L}`, L >=
    num_hidden_layers: GLM-4.5's layer 92, DeepSeek-V3's 61) are built only for MTP
    speculative decoding (`add_mtp_layers`, app/models/mtp.py); otherwise their tensors are
    skipped unread (`skips_weight`), INT4 ones included.
    """

    packed_modules_mapping = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TPContext = SINGLE):
        super().__init__()
        self.config = cfg
        self.model = MoEModel(cfg, tp, lambda i: self.make_attention(cfg, i, tp))
        self._local_experts = tp.experts(cfg.raw["n_routed_experts"])
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = None

    def make_attention(self, cfg: ModelConfig, layer: int, tp: TPContext) -> nn.Module:
        raise NotImplementedError

    def add_mtp_layers(self, tp: TPContext = SINGLE) -> None:
        """Builds the checkpoint's MTP layers (`self.mtp`) so that they load and can run."""
        cfg = self.config
        self.mtp = MTPHead(cfg, lambda i: MTPLayer(cfg, i, tp, self.make_attention(cfg, i, tp)))

    def checkpoint_name(self, name: str) -> str:
        return self.mtp.checkpoint_name(name) if self.mtp is not None else name

    def skips_weight(self, name: str) -> bool:
        """True for checkpoint tensors of routed experts another expert-parallel rank owns,
        and for multi-token-prediction layers (names or module prefixes)."""
        layer = _LAYER.match(name)
        if layer is not None and int(layer.group(1)) >= self.config.num_hidden_layers:
            mtp = self.mtp
            if mtp is None or int(layer.group(1)) >= mtp.first_layer + len(mtp.layers):
                return True
            if mtp.skips(name):
                return True
        m = _EXPERT.search(name)
        return m is not None and int(m.group(1)) not in self._local_experts

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """ids, positions: [T] -> hidden states [T, hidden]."""
        return self.model(ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden)
