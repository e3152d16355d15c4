"""The vLLM side of bench/vs_vllm.py; runs in vLLM's own venv (.venv-vllm), not ours.

Reads one JSON command per line on stdin, answers one line `@@result {json}` on stdout (vLLM
logs to stdout too, so the parent reads only the marked lines):

    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": 64,
     "temperature": 0.0, "top_p": 1.0}  -> {"tokens": N, "seconds": s, "first_ids": [...]}
    {"op": "quit"}

Standalone on purpose: it imports nothing of slimserve (another venv, another torch).
vLLM's offline LLM starts worker processes, hence the __main__ guard.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MARK = "@@result "


def reply(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def generate(llm, cmd: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=cmd["max_tokens"],
        temperature=cmd["temperature"],
        top_p=cmd["top_p"],
        ignore_eos=True,
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {
        "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "seconds": seconds,
        "first_ids": list(outs[0].outputs[0].token_ids[:8]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    args = ap.parse_args()
    import torch
    import vllm
    from vllm import LLM

    llm = LLM(
        model=args.model,
        dtype="float32",
        enable_prefix_caching=False,
        # On CPU vLLM otherwise reserves a fraction of all host memory for KV.
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        seed=0,
    )
    reply({"ready": True, "vllm": vllm.__version__, "torch": torch.__version__})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        reply(generate(llm, cmd))


if __name__ == "__main__":
    main()
