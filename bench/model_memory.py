"""KV bytes per token (MLA vs GQA vs MHA, BF16 vs FP8) and weight memory (BF16 / FP8 / INT4)
of Kimi K2 and GLM-4.5, computed from their published config.json values (no download).

Arithmetic only, no tensors: parameter counts follow the module shapes of
app/models/{deepseek_v3,glm4_moe,mla,moe}.py; byte formats follow this repository's layouts:

- KV cache (slimserve_kernels/README.md): BF16 = 2 bytes per element; FP8 = 1 byte per element + one
  int8 power-of-two scale exponent per token and KV head (MLA: one "head" per token).
- FP8 weights: block-scaled e4m3 (128 x 128 blocks, one fp32 scale each), as DeepSeek-V3 and
  Kimi K2 ship; embeddings, LM head, norms and routers stay BF16.
- INT4 weights: W4A16 group-wise, 0.5 byte + one BF16 scale per group (symmetric).

    python bench/model_memory.py           # markdown tables; -> bench/results/model_memory.json
    python bench/model_memory.py --measure [--device cuda]   # resident bytes, by loading
                                           # -> bench/results/resident_weights.json

`--measure` (bench/resident_weights.py) writes one real-shape decoder layer of Llama-3-8B
and of GLM-4.5 as BF16 and FP8-block checkpoints, loads them as the engine does (BF16,
FP8 kept FP8, INT4 via weight_quant) and counts the bytes the loaded layer holds.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# moonshotai/Kimi-K2-Instruct config.json (architectures: DeepseekV3ForCausalLM)
KIMI_K2 = dict(
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=384,
    n_shared_experts=1,
    num_experts_per_tok=8,
    first_k_dense_replace=1,
    vocab_size=163840,
)
# zai-org/GLM-4.5 config.json (architectures: Glm4MoeForCausalLM); one MTP layer not counted
GLM_45 = dict(
    hidden_size=5120,
    intermediate_size=12288,
    moe_intermediate_size=1536,
    num_hidden_layers=92,
    num_attention_heads=96,
    num_key_value_heads=8,
    head_dim=128,
    n_routed_experts=160,
    n_shared_experts=1,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    vocab_size=151552,
)
FP8_BLOCK = 128 * 128
BF16 = 2


def kv_bytes_per_token(elements_per_layer: int, scales_per_layer: int, layers: int, fp8: bool):
    per_layer = elements_per_layer * (1 if fp8 else BF16) + (scales_per_layer if fp8 else 0)
    return per_layer * layers


def kv_table(name: str, c: dict) -> list[dict]:
    """MLA (as cached here), GQA, and the MHA the same heads would need, per token."""
    layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
    rows = []
    if "kv_lora_rank" in c:
        width = c["kv_lora_rank"] + c["qk_rope_head_dim"]
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        shapes = {
            "MLA (latent + rope key)": (width, 1),
            "MHA (expanded K/V)": (heads * (qk + c["v_head_dim"]), 2 * heads),
        }
    else:
        d, kv = c["head_dim"], c["num_key_value_heads"]
        shapes = {
            f"GQA ({kv} KV heads)": (2 * kv * d, 2 * kv),
            f"MHA ({heads} heads)": (2 * heads * d, 2 * heads),
        }
    for kind, (elements, scales) in shapes.items():
        bf16 = kv_bytes_per_token(elements, scales, layers, fp8=False)
        fp8 = kv_bytes_per_token(elements, scales, layers, fp8=True)
        rows.append(dict(model=name, kind=kind, bf16=bf16, fp8=fp8))
    return rows


def param_groups(c: dict) -> dict[str, int]:
    """Parameters by role: attention, dense MLP, shared experts, routed experts, other."""
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    heads, dense_layers = c["num_attention_heads"], c["first_k_dense_replace"]
    moe_layers = layers - dense_layers
    if "kv_lora_rank" in c:
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        r, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
        attn = h * c["q_lora_rank"] + c["q_lora_rank"] * heads * qk  # q_a, q_b
        attn += h * (r + rope) + r * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
        attn += heads * c["v_head_dim"] * h  # o_proj
        attn_norms = c["q_lora_rank"] + r
    else:
        d, kv = c["head_dim"], c["num_key_value_heads"]
        attn = h * (heads + 2 * kv) * d + (heads + 2 * kv) * d + heads * d * h  # qkv(+bias), o
        attn_norms = 2 * d  # q_norm, k_norm
    mlp = 3 * h * c["intermediate_size"]
    expert = 3 * h * c["moe_intermediate_size"]
    e = c["n_routed_experts"]
    return {
        "attention": attn * layers,
        "dense_mlp": mlp * dense_layers,
        "shared_experts": expert * c["n_shared_experts"] * moe_layers,
        "routed_experts": expert * e * moe_layers,
        # embeddings + LM head, norms, routers (weight + correction bias): kept in BF16
        "bf16_other": 2 * c["vocab_size"] * h
        + (2 * h + attn_norms) * layers
        + h
        + (e * h + e) * moe_layers,
    }


def weight_bytes(groups: dict[str, int], plan: dict[str, str]) -> int:
    per_param = {
        "bf16": BF16,
        "fp8": 1 + 4 / FP8_BLOCK,
        "int4-g32": 0.5 + BF16 / 32,
        "int4-g128": 0.5 + BF16 / 128,
    }
    return int(sum(n * per_param[plan.get(g, "bf16")] for g, n in groups.items()))


LINEARS = ("attention", "dense_mlp", "shared_experts", "routed_experts")
PLANS = {
    "BF16": {},
    "FP8 (block-scaled linears)": {g: "fp8" for g in LINEARS},
    "INT4 g32 routed experts + FP8 rest": {
        **{g: "fp8" for g in LINEARS},
        "routed_experts": "int4-g32",
    },
    "INT4 g32 routed experts + BF16 rest (Kimi K2 INT4 release)": {"routed_experts": "int4-g32"},
    "INT4 g128 all linears (weight_quant=int4)": {g: "int4-g128" for g in LINEARS},
}


def measure_main(argv: list[str]) -> None:
    import argparse

    from bench.common import write_json
    from bench.resident_weights import markdown, measure

    p = argparse.ArgumentParser()
    p.add_argument("--measure", action="store_true")
    p.add_argument("--experts", type=int, default=8, help="GLM-4.5 experts loaded (>= 8)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tmp", default=None, help="where the checkpoints are written")
    args = p.parse_args(argv)
    results = measure(args.experts, args.device, args.tmp)
    print(markdown(results))
    print(write_json("resident_weights", dict(device=args.device, layers=results)))


def main() -> None:
    from bench.common import write_json

    if "--measure" in sys.argv[1:]:
        return measure_main(sys.argv[1:])

    models = {"Kimi K2": KIMI_K2, "GLM-4.5": GLM_45}
    kv = [row for name, c in models.items() for row in kv_table(name, c)]
    print("| model | KV layout | BF16 bytes/token | FP8 bytes/token | FP8 / BF16 |")
    print("|---|---|---:|---:|---:|")
    for r in kv:
        print(
            f"| {r['model']} | {r['kind']} | {r['bf16']:,} | {r['fp8']:,} "
            f"| {r['fp8'] / r['bf16']:.3f} |"
        )
    weights = {}
    print("\n| model | params (B) | " + " | ".join(PLANS) + " |")
    print("|---|---:|" + "---:|" * len(PLANS))
    for name, c in models.items():
        groups = param_groups(c)
        gib = {plan: weight_bytes(groups, p) / 2**30 for plan, p in PLANS.items()}
        weights[name] = dict(params=groups, gib=gib)
        cells = " | ".join(f"{v:,.0f} GiB" for v in gib.values())
        print(f"| {name} | {sum(groups.values()) / 1e9:,.1f} | {cells} |")
    print("\n", write_json("model_memory", dict(kv_bytes_per_token=kv, weights=weights)))


if __name__ == "__main__":
    main()
