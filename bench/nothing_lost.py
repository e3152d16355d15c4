"""Nothing lost under load, served (issue 34): greedy outputs equal the offline engine's,
no request fails, and every KV block is free again after each run, in every mode at every
prompt length.

Per mode (`slimserve serve` as `make serve` starts it, which on a box whose replicas share
cores prefills long prompts on the decode replica; `disaggregated-always`, every prompt
through the prefill replica and the KV hand-off; `--mode colocated`) and per
workload (random prompts of 128, 512 and 1,000 token ids, and a mix of the three), a closed
loop of --streams concurrent streams sends --requests fresh prompts through the official
`openai` client (streaming completions, temperature 0, 64 new tokens, `ignore_eos`; a
1,000-token prompt gets 24, the default model's context being 1,024). Each output (text and
finish reason) is compared with the offline engine's (`LLM`, the served engine options,
all prompts in one call, KV memory for all of them so nothing is preempted). After each
run, every engine deployment of the mode must be read (Serve's `broadcast("stats")`, from
a driver process of its own) with no sequence running or waiting and every KV block free
(cached prefixes count as free), and the hand-off box (disaggregated) must hold nothing,
within --settle-s. A failed read counts as not settled.

    python bench/nothing_lost.py [--modes disaggregated,disaggregated-always,colocated]
        [--workloads 128,512,1000,mixed] [--streams 32] [--requests 64] [--tag T]

Writes bench/results/nothing_lost[_<tag>].json; exits 1 if any run lost anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_model, write_json  # noqa: E402
from bench.peer import random_prompts  # noqa: E402
from bench.serve_vs_vllm import Server, start_ours  # noqa: E402

GEN = 64
VOCAB = 1000  # the ids of bench/serve_vs_vllm.py's prompts
LENGTHS = {"128": (128,), "512": (512,), "1000": (1000,), "mixed": (128, 512, 1000)}
# Read by a driver process of its own (a Ray connection in this process would outlive the
# server it attaches to): every engine replica's stats and the hand-off box's.
STATS_CODE = """
import asyncio, json, sys, ray
from ray import serve
ray.init(address="auto", logging_level="ERROR")
out = {}
for name in sys.argv[1].split(","):
    handle = serve.get_deployment_handle(name, "slimserve")
    out[name] = list(handle.broadcast("stats").results())
if "PrefillServer" in out:  # disaggregated: the hand-off box (HandOffs starts a missing one)
    from app.kvstore.handoff import HandOffs
    out["box"] = asyncio.run(HandOffs("slimserve-kvstore").stats())
print("STATS " + json.dumps(out, default=str))
"""


@dataclass
class Outcome:
    """One request as served: its text and finish reason, or the error it got."""

    text: str = ""
    finish_reason: str | None = None
    error: str | None = None  # "HTTP <status>" or the exception's repr


@dataclass
class Run:
    """One (mode, workload) run: what was lost, if anything."""

    mode: str
    workload: str
    requests: int
    matched: int = 0
    mismatched: list[dict] = field(default_factory=list)  # the first few
    errors: dict[str, int] = field(default_factory=dict)
    # seconds until a read of the stats (a driver start, ~2 s each) showed it all free;
    # None: still running or holding blocks after --settle-s
    settled_s: float | None = None
    replicas: list[dict] = field(default_factory=list)
    box: dict = field(default_factory=dict)
    error: str | None = None  # the last stats read's failure, if it failed

    @property
    def ok(self) -> bool:
        return self.matched == self.requests and not self.errors and self.settled_s is not None


def workload_prompts(name: str, n: int, seed: int) -> list[list[int]]:
    lengths = LENGTHS[name]
    return [
        random_prompts(seed + i, 1, VOCAB, lengths[i % len(lengths)], lengths[i % len(lengths)])[0]
        for i in range(n)
    ]


def offline_outputs(model: str, prompts: list[list[int]]) -> list[Outcome]:
    """The reference: the served engine options (FP8 KV and the step budgets), KV memory for
    every prompt at once."""
    from app import LLM, SamplingParams
    from app.serve.config import SERVE_DEFAULTS

    options = {**SERVE_DEFAULTS, "kv_cache_memory_bytes": 512 << 20}
    llm = LLM(model, dtype="float32", device="cpu", **options)
    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    return [Outcome(o.text, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]


async def served_outputs(url: str, model: str, prompts: list[list[int]], streams: int) -> list:
    """A closed loop of `streams` workers through the official openai client."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    out: list[Outcome] = [Outcome() for _ in prompts]
    todo = iter(range(len(prompts)))

    async def one(i: int) -> None:
        try:
            stream = await client.completions.create(
                model=model,
                prompt=prompts[i],
                max_tokens=GEN,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                for choice in chunk.choices:
                    out[i].text += choice.text
                    out[i].finish_reason = choice.finish_reason or out[i].finish_reason
        except openai.APIStatusError as e:
            out[i].error = f"HTTP {e.status_code}"
        except Exception as e:  # noqa: BLE001 - a dropped connection counts as lost
            out[i].error = repr(e)

    async def worker() -> None:
        for i in todo:
            await one(i)

    await asyncio.gather(*(worker() for _ in range(streams)))
    await client.close()
    return out


def deployments(mode: str) -> tuple[str, ...]:
    """The engine deployments a mode runs (bench/serve_vs_vllm.py's mode names)."""
    return ("EngineServer",) if mode == "colocated" else ("PrefillServer", "DecodeServer")


def engine_stats(names: tuple[str, ...]) -> dict:
    """{deployment: [each replica's stats]} (+ "box"), or {"error": why} if the read failed."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", STATS_CODE, ",".join(names)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).resolve().parent.parent,
        )
    except subprocess.TimeoutExpired:
        return {"error": "reading the replicas' stats timed out"}
    line = next((x for x in done.stdout.splitlines() if x.startswith("STATS ")), None)
    if line is None:
        return {"error": done.stderr[-2000:]}
    return json.loads(line[len("STATS ") :])


def settled(stats: dict, names: tuple[str, ...]) -> bool:
    """Every deployment read, no sequence running or waiting, every block free, the box
    (where there is one) empty."""
    if "error" in stats or not all(stats.get(n) for n in names):
        return False
    replicas = [s for n in names for s in stats[n]]
    idle = all(
        s["num_running"] == 0
        and s.get("num_waiting", 0) == 0
        and s["kv_blocks_free"] == s["kv_blocks_total"]
        for s in replicas
    )
    return idle and stats.get("box", {}).get("held", 0) == 0


def check(run: Run, served: list[Outcome], offline: list[Outcome]) -> None:
    for i, (got, want) in enumerate(zip(served, offline, strict=True)):
        if got.error is not None:
            run.errors[got.error] = run.errors.get(got.error, 0) + 1
        elif (got.text, got.finish_reason) == (want.text, want.finish_reason):
            run.matched += 1
        elif len(run.mismatched) < 3:
            run.mismatched.append({"request": i, "served": asdict(got), "offline": asdict(want)})


def run_mode(mode: str, model: str, args, references: dict) -> list[Run]:
    server: Server = start_ours(model, mode)
    runs = []
    try:
        for name, (prompts, offline) in references.items():
            run = Run(mode, name, len(prompts))
            served = asyncio.run(served_outputs(server.url, server.model, prompts, args.streams))
            check(run, served, offline)
            t0, names = time.perf_counter(), deployments(mode)
            while True:
                stats = engine_stats(names)
                if settled(stats, names):
                    run.settled_s = round(time.perf_counter() - t0, 1)
                    break
                if time.perf_counter() - t0 > args.settle_s:
                    break
                time.sleep(1.0)
            keep = ("num_running", "num_waiting", "kv_blocks_free", "kv_blocks_total")
            run.replicas = [
                {"deployment": n, **{k: s.get(k) for k in keep}}
                for n in names
                for s in stats.get(n, [])
            ]
            run.error = stats.get("error")
            run.box = stats.get("box", {})
            print(json.dumps({**asdict(run), "ok": run.ok}), flush=True)
            runs.append(run)
    finally:
        server.stop()
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--modes", default="disaggregated,disaggregated-always,colocated")
    ap.add_argument("--workloads", default="128,512,1000,mixed")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--settle-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=34)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    model = default_model()
    references = {}
    for k, name in enumerate(args.workloads.split(",")):
        prompts = workload_prompts(name, args.requests, args.seed * 1000 + 100 * k)
        references[name] = (prompts, offline_outputs(model, prompts))
    runs = [r for mode in args.modes.split(",") for r in run_mode(mode, model, args, references)]
    result = {
        "workload": f"{args.requests} requests per run, {args.streams} streams, {GEN} new "
        "tokens asked, ignore_eos, temperature 0, streaming /v1/completions, openai client",
        "runs": [{**asdict(r), "ok": r.ok} for r in runs],
        "all_ok": all(r.ok for r in runs),
    }
    write_json("nothing_lost" + (f"_{args.tag}" if args.tag else ""), result)
    print("| mode | prompts | matched offline | errors | blocks free after |")
    print("|---|---|---:|---|---|")
    for r in runs:
        free = f"{r.settled_s} s" if r.settled_s is not None else "NO"
        print(
            f"| {r.mode} | {r.workload} | {r.matched} / {r.requests} | "
            f"{sum(r.errors.values())} | {free} |"
        )
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
