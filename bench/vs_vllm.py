"""Offline generation: slimserve's LLM vs vLLM's CPU build (the peer), side by side.

Same prompts (32-64 random token ids, fresh per batch size and repeat), 64 new tokens,
ignore_eos, prefix caching off, float32 weights and KV, one torch thread, 256 MiB of KV on
both, batch 1/8/32, greedy and T=0.8 top_p=0.9. vLLM runs in its own venv (.venv-vllm,
built on demand by scripts/peer_venv.sh) as a subprocess (bench/vllm_worker.py); slimserve
runs in this process. Each configuration is warmed up once per side, then the two sides
alternate (ABAB...) for --repeats runs each, so load from elsewhere hits both alike; the
median run is reported.

    python bench/vs_vllm.py [--model PATH] [--repeats 3] [--no-peer]

Writes bench/results/vs_vllm.json and vs_vllm.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, bar_plot, default_model, write_json  # noqa: E402
from bench.peer import (  # noqa: E402
    ROOT,
    CpuWindow,
    ensure_peer_venv,
    machine_conditions,
    median,
    random_prompts,
    settle,
)

SAMPLINGS = {"greedy": (0.0, 1.0), "T=0.8 top_p=0.9": (0.8, 0.9)}
KV_BYTES = 256 << 20


class PeerSide:
    """vLLM's offline LLM in .venv-vllm, driven over a JSON-lines pipe."""

    name = "vllm"

    def __init__(self, model: str):
        py = ensure_peer_venv()
        worker = os.path.join(ROOT, "bench", "vllm_worker.py")
        cmd = [py, worker, "--model", model, "--kv-cache-memory-bytes", str(KV_BYTES)]
        self.log = open(os.path.join(tempfile.gettempdir(), "vs_vllm_peer.log"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self.pid = self.proc.pid
        self.info = self._read()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@result "):
                return json.loads(line[len("@@result ") :])
        raise RuntimeError(f"the vLLM worker exited ({self.proc.wait()}); see {self.log.name}")

    def run(self, prompts: list[list[int]], gen: int, temperature: float, top_p: float) -> dict:
        cmd = {"op": "generate", "prompts": prompts, "max_tokens": gen}
        cmd |= {"temperature": temperature, "top_p": top_p}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write('{"op": "quit"}\n')
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class OurSide:
    """slimserve's offline LLM in this process."""

    name = "slimserve"

    def __init__(self, model: str, threads: int = 1):
        """threads 0: torch's default (every core), what an offline `LLM` user gets."""
        import torch

        from app import LLM

        if threads:
            torch.set_num_threads(threads)
        self.pid = os.getpid()
        self.llm = LLM(
            model,
            dtype="float32",
            device="cpu",
            kv_cache_memory_bytes=KV_BYTES,
            enable_prefix_caching=False,
        )
        self.info = {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}

    def run(self, prompts: list[list[int]], gen: int, temperature: float, top_p: float) -> dict:
        from app import SamplingParams

        params = SamplingParams(
            temperature=temperature, top_p=top_p, max_tokens=gen, ignore_eos=True
        )
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outs)
        return {"tokens": tokens, "seconds": seconds, "first_ids": list(outs[0].token_ids[:8])}

    def close(self) -> None:
        self.llm.shutdown()


def one_config(sides, batch: int, temp: float, top_p: float, args, seed: int) -> dict:
    """Warm-up once per side, then alternate the sides for args.repeats runs each."""
    for side in sides:
        side.run(random_prompts(seed, batch, args.vocab), args.gen, temp, top_p)
    runs: dict[str, list[dict]] = {s.name: [] for s in sides}
    trees = [(s.pid, s.name != "slimserve") for s in sides]
    for r in range(args.repeats):
        prompts = random_prompts(seed + 1 + r, batch, args.vocab)
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            waited = settle(trees)
            with CpuWindow(trees) as cpu:
                out = side.run(prompts, args.gen, temp, top_p)
            out["tok_s"] = out["tokens"] / out["seconds"]
            out["cores"] = {s.name: round(c, 2) for s, c in zip(sides, cpu.cores)}
            out["settle_s"] = round(waited, 2)
            runs[side.name].append(out)
    row: dict = {"runs": runs}
    for name, rs in runs.items():
        row[f"{name}_tok_s"] = median([x["tok_s"] for x in rs])
    if len(sides) == 2:
        row["ratio"] = row["slimserve_tok_s"] / row["vllm_tok_s"]
        if temp == 0:  # same model, same prompts: greedy tokens should mostly agree
            a, b = runs["slimserve"][0]["first_ids"], runs["vllm"][0]["first_ids"]
            row["greedy_first_ids_agree"] = sum(x == y for x, y in zip(a, b)) / len(a)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--samplings", default=",".join(SAMPLINGS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-peer", action="store_true", help="slimserve only (smoke test)")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="slimserve's torch threads, 0: torch's default (every core). vLLM's CPU build "
        "on 2 cores uses ~2 cores with one OpenMP thread for its model: compare with the "
        "cores-used column; more than one OpenMP thread collapses on a loaded machine "
        "(docs/performance.md)",
    )
    args = ap.parse_args(argv)
    from app.config import ModelConfig

    model = args.model or default_model()
    args.vocab = ModelConfig.from_path(model).vocab_size
    conditions = machine_conditions()
    sides: list = [OurSide(model, args.threads)]
    args.threads = sides[0].info["torch_threads"]  # what the settings and the plot say
    try:
        if not args.no_peer:
            sides.insert(0, PeerSide(model))
        rows = {}
        for b, batch in enumerate(int(x) for x in args.batches.split(",")):
            for s, name in enumerate(args.samplings.split(",")):
                temp, top_p = SAMPLINGS[name]
                key = f"{batch} {name}"
                rows[key] = one_config(sides, batch, temp, top_p, args, 1000 * b + 100 * s)
                print(key, json.dumps({k: v for k, v in rows[key].items() if k != "runs"}))
    finally:
        for side in sides:
            side.close()
    result = {
        "model": model,
        "gen_len": args.gen,
        "repeats": args.repeats,
        "settings": "float32 weights+KV, prefix caching off, ignore_eos, "
        f"{args.threads} slimserve torch thread(s), "
        f"{KV_BYTES >> 20} MiB KV each, prompts of 32-64 random ids",
        "conditions_before": conditions,
        "conditions_after": machine_conditions(),
        "sides": {s.name: s.info for s in sides},
        "results": rows,
    }
    write_json("vs_vllm", result, out_dir=args.out)
    series = {s.name: {k: r[f"{s.name}_tok_s"] for k, r in rows.items()} for s in sides}
    bar_plot(
        "vs_vllm",
        f"Offline tokens/s (CPU, slimserve {args.threads} thread(s))",
        series,
        "tokens/s",
        out_dir=args.out,
    )
    print(markdown(result))
    return result


def markdown(result: dict) -> str:
    """The docs/performance.md table of a result (also: python -c on a saved JSON)."""
    lines = [
        "| prompts | sampling | slimserve tok/s | vLLM tok/s | slimserve / vLLM "
        "| cores used (slimserve / vLLM) | per CPU-second: slimserve / vLLM |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for key, row in result["results"].items():
        batch, sampling = key.split(" ", 1)
        if "vllm_tok_s" not in row:
            continue
        cores = [median([r["cores"][n] for r in row["runs"][n]]) for n in ("slimserve", "vllm")]
        lines.append(
            f"| {batch} | {sampling} | {row['slimserve_tok_s']:,.0f} | {row['vllm_tok_s']:,.0f} "
            f"| {row['ratio']:.2f}x | {cores[0]:.2f} / {cores[1]:.2f} "
            f"| {per_cpu_ratio(row):.2f}x |"
        )
    return "\n".join(lines)


def per_cpu_ratio(row: dict) -> float:
    """slimserve's tokens per CPU-second of its own processes over vLLM's (median runs): what
    each side gets out of the cores it used, less sensitive to other load than tok/s."""
    eff = {}
    for name, runs in row["runs"].items():
        eff[name] = median([r["tok_s"] / max(r["cores"][name], 1e-9) for r in runs])
    return eff["slimserve"] / eff["vllm"]


if __name__ == "__main__":
    main()
