"""Quality matrix: {bf16, fp8 KV, int4, int4 + fp8 KV} against the unquantized BF16 run, plus
INT4 written by `slimserve quantize --method gptq` (same group size), on the default model's
held-out text (or the shipped calibration text for a stand-in model).

    python bench/quality.py [--model PATH] [--text FILE] [--max-tokens 4096]
    -> bench/results/quality.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import default_model, write_json  # noqa: E402


def default_text(model: str) -> str:
    heldout = os.path.join(model, "heldout.txt")
    if os.path.exists(heldout):
        return heldout
    from app.quant.quantize_cli import CALIB_PATH

    return CALIB_PATH


def main() -> None:
    from app.evaluation.evaluate import MATRIX, Evaluator, QuantConfig, format_table
    from app.quant.quantize_cli import quantize_checkpoint
    from app.tokenizer import Tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--text")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args()
    model = args.model or default_model()
    text = args.text or default_text(model)
    with open(text, encoding="utf-8") as f:
        ids = Tokenizer.from_path(model).encode(f.read())
    ev = Evaluator(model, ids, args.dtype, args.window, args.max_tokens)
    gptq_dir = tempfile.mkdtemp()
    # GPTQ calibrates on the shipped calibration text, never on the evaluation text.
    quantize_checkpoint(model, gptq_dir, "gptq", args.group_size, symmetric=True)
    configs = list(MATRIX) + [
        QuantConfig("int4 gptq", model=gptq_dir),
        QuantConfig("int4 gptq + fp8 KV", kv_cache_dtype="fp8_e4m3", model=gptq_dir),
    ]
    results = []
    for cfg in configs:
        results.append(ev.run(cfg))
        print(format_table(results[-1:]), flush=True)
    print(format_table(results))
    data = {
        "model": model,
        "text": text,
        "dtype": args.dtype,
        "window": args.window,
        "int4_runtime": f"RTN symmetric g{args.group_size} on load (weight_quant=int4)",
        "results": [r.as_dict() for r in results],
    }
    print(f"wrote {write_json('quality', data)}")


if __name__ == "__main__":
    main()
