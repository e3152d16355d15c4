"""`slimserve generate`: complete one prompt (or a chat turn) offline and print it."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from app.assets import default_model_path
    from app.options import OPTIONS, add_engine_arguments

    p.add_argument("--model", default=default_model_path(), help="HF checkpoint folder")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user chat turn")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", dest="sampling_seed", type=int, help="this request's sampling seed")
    # Every engine option of app/config.py, as the offline LLM takes it (app/options.py).
    add_engine_arguments(p, [name for name in OPTIONS if name not in ("model", "seed")])


def run(args: argparse.Namespace) -> int:
    from app.engine.llm import LLM
    from app.engine.sampling_params import SamplingParams
    from app.options import given_options

    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sampling_seed,
            max_tokens=args.max_tokens,
        )
        llm = LLM(args.model, show_progress=True, **given_options(args))
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            out = llm.generate(args.prompt, params)[0]
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out.text)
    return 0
