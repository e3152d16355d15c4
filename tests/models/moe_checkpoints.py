"""Tiny random GLM-4.5-style and DeepSeek-V3/Kimi-K2-style checkpoints (transformers) and the
helpers their tests share: HF reference, greedy runs, INT4-experts conversion."""

from __future__ import annotations

import torch
import transformers

from tiny_models import save_random_model

VOCAB = 320
PROMPTS = [
    [5, 17, 42, 99, 3],
    list(range(10, 47)),
    [7] + [i % 300 + 3 for i in range(60)],
]
# Routing stays realistic: sigmoid + bias, 4 groups of 4 experts, the best 2 groups eligible,
# 3 of 16 experts per token, one shared expert, routed scaling 2.5, one dense layer first.
MOE = dict(
    vocab_size=VOCAB,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)
# GLM-4.5: head_dim 128 with 96 q / 8 kv heads, partial rotary 0.5, qkv bias, hidden 5120.
GLM = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=True,
)
# DeepSeek-V3 / Kimi K2: kv_lora 512 = 4 x nope 128, rope 64, v 128, q_lora 1536; YaRN with
# mscale; here mscale != mscale_all_dim so both YaRN scalings (cos/sin and softmax) matter.
DEEPSEEK = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=128,
        mscale=1.0,
        mscale_all_dim=0.8,
        beta_fast=32,
        beta_slow=1,
    ),
)
FAMILIES = {
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", GLM),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK),
}


def make_moe_checkpoint(family: str, out: str, seed: int = 0, **overrides) -> str:
    config_name, model_name, extra = FAMILIES[family]
    return save_random_model(config_name, model_name, {**MOE, **extra, **overrides}, out, seed)


def hf_model(path: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        ref = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
        outs.append(ref[0, len(p) :].tolist())
    return outs


def int4_experts_checkpoint(src: str, out: str, group_size: int = 32) -> str:
    """compressed-tensors pack-quantized, routed experts only (Kimi K2's INT4 release: group
    32, symmetric; attention, shared experts, dense MLPs, routers and lm_head stay dense)."""
    from app.quant.export import DEFAULT_SKIP
    from app.quant.quantize_cli import quantize_checkpoint

    skip = DEFAULT_SKIP + (r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*\.mlp\.[a-z_]+$")
    quantize_checkpoint(src, out, "rtn", group_size=group_size, symmetric=True, skip=skip)
    return out


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = p_logits.log_softmax(-1)
    return (p.exp() * (p - q_logits.log_softmax(-1))).sum(-1).mean().item()


def logit_errors(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(mean |error| / std of the reference logits, KL(ref || ours), top-1 agreement)."""
    mean_err = ((ours - ref).abs().mean() / ref.std()).item()
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return mean_err, kl(ref, ours), top1


def teacher_forced_agreement(llm, full, prompts, params) -> float:
    """Fraction of `llm`'s greedy tokens that the full-precision engine `full` would also
    pick given the same prefix (free runs of random tiny models diverge at near-ties)."""
    same = total = 0
    for p, out in zip(prompts, llm.generate(prompts, params)):
        picks = full.engine.score(p + out.token_ids).argmax(-1)[len(p) - 1 : -1].tolist()
        same += sum(a == b for a, b in zip(out.token_ids, picks))
        total += len(out.token_ids)
    return same / total
