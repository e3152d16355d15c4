"""`slimserve eval`: perplexity, KL, top-1 and greedy agreement of a quantized configuration
against the unquantized run of the same model (see app/evaluation/evaluate.py)."""

from __future__ import annotations

import argparse
import json

from app.evaluation.evaluate import MATRIX, Evaluator, QuantConfig, format_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    from app.cli import default_model

    p.add_argument("--model", default=None, help="checkpoint folder (default: embedded model)")
    p.add_argument("--text", default=None, help="evaluation text (default: model's held-out)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | bf16 | fp8_e4m3 ...")
    p.add_argument("--weight-quant", default=None, choices=["int4"], help="default: none")
    p.add_argument("--matrix", action="store_true", help="bf16, fp8 KV, int4, int4 + fp8 KV")
    p.add_argument("--dtype", default="auto", help="activation dtype of every run")
    p.add_argument("--device", default="auto")
    p.add_argument("--window", type=int, default=256, help="tokens per scored window")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens of text to score")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(default_model=default_model)


def evaluate(args: argparse.Namespace) -> list[dict]:
    from app.tokenizer import Tokenizer

    model = args.model or args.default_model()
    text_path = args.text
    if text_path is None:
        from app.assets import default_heldout_path

        text_path = default_heldout_path()
    with open(text_path, encoding="utf-8") as f:
        ids = Tokenizer.from_path(model).encode(f.read())
    ev = Evaluator(
        model,
        ids,
        args.dtype,
        args.window,
        args.max_tokens,
        args.prompt_len,
        args.gen_tokens,
        args.num_prompts,
        device=args.device,
    )
    configs = (
        MATRIX
        if args.matrix
        else [QuantConfig(_name(args), args.kv_cache_dtype, args.weight_quant)]
    )
    results = [ev.run(c) for c in configs]
    print(format_table(results))
    return [r.as_dict() | {"model": model, "text": text_path, "dtype": args.dtype} for r in results]


def _name(args) -> str:
    parts = [args.weight_quant or "", "" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype]
    return " + ".join(p for p in parts if p) or "unquantized"


def run(args: argparse.Namespace) -> int:
    results = evaluate(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    else:
        print(json.dumps(results, indent=2))
    return 0
