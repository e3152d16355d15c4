"""FP8 KV scale granularity: quantization error on a model's real K/V and the capacity each
option leaves, per-tensor static .. per-token-head dynamic (one run).

    python bench/kv_scale_granularity.py [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import default_model, write_json  # noqa: E402

FP8, FMAX = torch.float8_e4m3fn, 448.0


def _q(x, scale):
    return (x / scale).clamp(-FMAX, FMAX).to(FP8).float() * scale


def options(x):
    """x: [T, H, D] -> {name: (dequantized, scale bytes per token-head)}."""
    amax_th = x.abs().amax(-1, keepdim=True).clamp_min(1e-12)
    return {
        "per_tensor_static_1.0": (_q(x, torch.tensor(1.0)), 0),
        "per_tensor_dynamic": (_q(x, x.abs().max() / FMAX), 0),
        "per_head_dynamic": (_q(x, x.abs().amax((0, 2), keepdim=True) / FMAX), 0),
        "per_token_head_fp32": (_q(x, amax_th / FMAX), 4),
        "per_token_head_pow2_int8 (ours)": (
            _q(x, torch.exp2(torch.ceil(torch.log2(amax_th / FMAX)))),
            1,
        ),
    }


def capture_kv(model_path: str, text_ids: list[int]):
    from app.quant.load import load_model

    model, _ = load_model(model_path, torch.float32, "cpu")
    seen = []

    def attn(layer, q, k, v):
        seen.append((k.clone(), v.clone()))
        g = q.shape[1] // k.shape[1]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.repeat_interleave(g, 1).transpose(0, 1),
            v.repeat_interleave(g, 1).transpose(0, 1),
            is_causal=True,
        )
        return o.transpose(0, 1)

    with torch.no_grad():
        ids = torch.tensor(text_ids)
        model(ids, torch.arange(len(ids)), attn)
    return seen


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument(
        "--amplify", type=float, default=1.0, help="multiply K/V (real LLM keys reach 100s)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    path = args.model or default_model()
    from app.tokenizer import Tokenizer

    heldout = os.path.join(path, "heldout.txt")
    tok = Tokenizer.from_path(path)
    if os.path.exists(heldout):
        with open(heldout) as f:
            ids = tok.encode(f.read()[:20000])[: args.tokens]
    else:
        ids = [3 + (i * 37) % 250 for i in range(args.tokens)]
    kv = [(k * args.amplify, v * args.amplify) for k, v in capture_kv(path, ids)]
    d = kv[0][0].shape[-1]
    rows = {}
    for name in options(kv[0][0]):
        err, ref, row_rel = 0.0, 0.0, []
        for k, v in kv:
            for x in (k, v):
                diff = options(x)[name][0] - x
                err += diff.pow(2).sum().item()
                ref += x.pow(2).sum().item()
                # per token-head: small heads drowned in a coarse scale show up here
                row_rel.append((diff.norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-12)).mean())
        scale_bytes = options(kv[0][0])[name][1]
        rows[name] = {
            "relative_rms_error": (err / ref) ** 0.5,
            "mean_token_head_relative_error": float(torch.stack(row_rel).mean()),
            "capacity_vs_bf16_at_this_head_dim": 2 * d / (d + scale_bytes),
            "capacity_vs_bf16_at_head_dim_128": 256 / (128 + scale_bytes),
        }
        print(f"{name:34s} {rows[name]}")
    result = {"model": path, "tokens": len(ids), "amplify": args.amplify, "head_dim": d}
    result["results"] = rows
    name = "kv_scale_granularity" + ("" if args.amplify == 1 else f"_x{args.amplify:g}")
    write_json(name, result, **({"out_dir": args.out} if args.out else {}))
    return result


if __name__ == "__main__":
    main()
