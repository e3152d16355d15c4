"""Engine speed on a GPU: decode CUDA graphs vs eager, BF16 vs INT4 / FP8 weights, BF16 vs
FP8 KV, at 1 / 8 / 32 concurrent prompts (issue 14 item 3, issue 16's seed comparison).

    python bench/gpu_engine.py [--quick] [--out DIR]      # needs CUDA

Two models:
- `default`: the embedded default model (4 layers, hidden 256): each step is a few dozen tiny
  kernels, so it measures launch overhead, the case CUDA graphs exist for;
- `llama-1b`: a random Llama at TinyLlama-1.1B's shapes (hidden 2048, 22 layers, 32 / 4
  heads, head_dim 64, intermediate 5632) built here with `transformers` on the GPU, with the
  default model's tokenizer (so its vocabulary is 4,096, not 32,000: the LM head is small);
- `glm-moe`: a random GLM-4.5-style MoE (8 layers, the first dense, 64 experts of 512,
  top-8, one shared expert, hidden 2048), the same way.

Each configuration runs `LLM.generate` on prompts of 32-64 random ids with `ignore_eos`,
greedy, prefix caching off; one warm-up generate per batch, then one timed. Reported:
output tok/s, decode ms per step ((t(gen) - t(1 token)) / (gen - 1)), graph replays in the
timed run, and whether the greedy tokens equal the eager BF16 run's (graphs replay the same
kernels, but a padded bucket can pick another GEMM algorithm; a random model has near ties).

Writes gpu_engine.json (+ gpu_engine.png) to --out (default bench/results/).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, default_model  # noqa: E402
from bench.peer import random_prompts  # noqa: E402

LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
)
# A GLM-4.5-style MoE at a small scale (fused MoE kernels, CUDA graphs since align_rows has
# no host sync): 8 layers (the first dense), 64 experts, top-8, one shared expert.
GLM_MOE = dict(
    hidden_size=2048,
    intermediate_size=5632,
    moe_intermediate_size=512,
    num_hidden_layers=8,
    first_k_dense_replace=1,
    n_routed_experts=64,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    partial_rotary_factor=0.5,
    max_position_embeddings=2048,
)
# name -> engine options on top of the common ones
CONFIGS = {
    "bf16 graphs": {},
    "bf16 eager": dict(enforce_eager=True),
    "bf16 + fp8 KV graphs": dict(kv_cache_dtype="fp8_e4m3"),
    "int4 graphs": dict(weight_quant="int4"),
    "fp8 graphs": dict(weight_quant="fp8"),  # fp8_activations=auto: W8A8 on sm_89+, N >= 1024
    "fp8 w8a16 graphs": dict(weight_quant="fp8", fp8_activations="w8a16"),
    "fp8 w8a8 graphs": dict(weight_quant="fp8", fp8_activations="w8a8"),
}
COMMON = dict(
    device="cuda",
    dtype="bfloat16",
    enable_prefix_caching=False,
    max_num_seqs=32,
    kv_cache_memory_bytes=4 << 30,
)


def build_random(out: str, config_name: str, model_name: str, shape: dict,
                 device: str = "cuda") -> str:  # fmt: skip
    """A random transformers model of `shape`, saved in BF16 with the default model's
    tokenizer (and its vocabulary)."""
    import torch
    import transformers

    src = default_model()
    with open(os.path.join(src, "config.json")) as f:
        base = json.load(f)
    config = getattr(transformers, config_name)(
        vocab_size=base["vocab_size"],
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        pad_token_id=base.get("pad_token_id"),
        **shape,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_name)(config).to(torch.bfloat16).eval()
    with torch.no_grad():  # random init's spread, so logits are not all ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def build_llama_1b(out: str, device: str = "cuda") -> str:
    return build_random(out, "LlamaConfig", "LlamaForCausalLM", LLAMA_1B, device)


def build_glm_moe(out: str, device: str = "cuda") -> str:
    return build_random(out, "Glm4MoeConfig", "Glm4MoeForCausalLM", GLM_MOE, device)


def timed_generate(llm, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    import torch

    from app import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]


def bench_config(model: str, name: str, options: dict, batches, gen: int, vocab: int) -> list:
    import torch

    from app import LLM

    t0 = time.perf_counter()
    llm = LLM(model, **COMMON, **options)
    start_s = time.perf_counter() - t0
    rows = []
    for b in batches:
        prompts = random_prompts(1000 + b, b, vocab)
        timed_generate(llm, prompts, gen)  # warm-up: lazy inits, Triton compiles
        t_one, _ = timed_generate(llm, prompts, 1)
        graphs = llm.engine.runner.graphs
        replays = sum(graphs.replays.values()) if graphs else 0
        t_all, tokens = timed_generate(llm, prompts, gen)
        rows.append(
            dict(
                config=name,
                batch=b,
                gen=gen,
                tok_s=b * gen / t_all,
                decode_ms_per_step=(t_all - t_one) / (gen - 1) * 1e3,
                prefill_ms=t_one * 1e3,
                graph_replays=(sum(graphs.replays.values()) - replays) if graphs else 0,
                start_s=start_s,
                tokens=tokens,
            )
        )
        print(f"  {name:22s} batch {b:3d}: {rows[-1]['tok_s']:9.0f} tok/s, "
              f"{rows[-1]['decode_ms_per_step']:.2f} ms/step", flush=True)  # fmt: skip
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def teacher_forced(model: str, rows: list[dict], vocab: int) -> None:
    """agreement_eager: the fraction of a run's greedy tokens that an eager BF16 prefill of
    (prompt + the tokens before it) also ranks first. Free runs of a random model part at the
    first near tie; this asks whether each step picked what eager picks from the same prefix
    (a wrong graph replay or kernel would agree ~never)."""
    import torch

    from app import LLM

    llm = LLM(model, **COMMON, enforce_eager=True)
    for r in rows:
        if r["batch"] != 8:
            continue
        same = total = 0
        for p, out in zip(random_prompts(1000 + r["batch"], r["batch"], vocab), r["tokens"]):
            picks = llm.engine.score(p + out).argmax(-1)[len(p) - 1 : -1].tolist()
            same += sum(a == b for a, b in zip(out, picks))
            total += len(out)
        r["agreement_eager"] = same / total
    del llm
    torch.cuda.empty_cache()


def mark_exact(rows: list[dict]) -> None:
    """tokens_equal_eager: this run's greedy tokens == the 'bf16 eager' run's (same model)."""
    ref = {(r["model"], r["batch"]): r["tokens"] for r in rows if r["config"] == "bf16 eager"}
    for r in rows:
        base = ref.get((r["model"], r["batch"]))
        if base is not None:
            same = sum(a == b for a, b in zip(r["tokens"], base))
            r["sequences_equal_eager"] = f"{same}/{len(base)}"
        del r["tokens"]


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in result["rows"] if r["model"] == model]
        for config in dict.fromkeys(r["config"] for r in rows):
            pts = sorted((r["batch"], r["tok_s"]) for r in rows if r["config"] == config)
            ax.plot(*zip(*pts), marker="o", label=config)
        ax.set(xscale="log", xlabel="concurrent prompts", ylabel="output tok/s", title=model)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"slimserve engine on {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="64 new tokens instead of 128")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--models", default="default,llama-1b,glm-moe")
    ap.add_argument("--configs", default="", help="CONFIGS names, spaces as _, comma-separated")
    args = ap.parse_args()
    known = [name.replace(" ", "_") for name in CONFIGS]
    wanted = [c for c in args.configs.split(",") if c]
    if unknown := sorted(set(wanted) - set(known)):
        raise SystemExit(f"unknown --configs {unknown}; known: {known}")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark runs on a GPU")
    gen, batches, rows = (64 if args.quick else 128), (1, 8, 32), []
    paths = {"default": default_model()}
    t0 = time.time()
    for model in args.models.split(","):
        if model == "llama-1b":
            paths[model] = build_llama_1b("/tmp/slimserve-llama-1b")
        if model == "glm-moe":
            paths[model] = build_glm_moe("/tmp/slimserve-glm-moe")
        configs = CONFIGS if model != "default" else {k: CONFIGS[k] for k in CONFIGS if "bf16" in k}
        model_rows = []
        for name, options in configs.items():
            if wanted and name.replace(" ", "_") not in wanted:
                continue
            for r in bench_config(paths[model], name, options, batches, gen, 4096):
                model_rows.append({"model": model, **r})
        teacher_forced(paths[model], model_rows, 4096)
        rows += model_rows
    mark_exact(rows)
    result = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        gen=gen,
        wall_s=time.time() - t0,
        rows=rows,
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_engine.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, "gpu_engine.png"))
    print(f"wrote {args.out}/gpu_engine.json in {result['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
