"""The asyncio wrapper (what Serve deployments use) and `slimserve generate`."""

import asyncio
import subprocess
import sys

from app import LLM, SamplingParams
from app.engine.async_engine import AsyncEngine
from app.engine.request import Request

PROMPT = [5, 17, 42, 99, 3]


def test_async_streams_same_tokens_and_leaves_nothing_held(llama_path):
    """Token equality with the offline run. That cancel *aborts* (rather than letting the
    12-token request end on its own) is proven in tests/reliability/engine/test_abort.py."""
    llm = LLM(llama_path, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate([PROMPT], params)[0].token_ids
    engine = AsyncEngine(llm.engine)

    async def collect(rid, limit=None):
        tokens = []
        async for delta in engine.generate(Request(rid, PROMPT, params)):
            tokens += delta.new_token_ids
            if limit and len(tokens) >= limit:
                break  # client goes away mid-stream
        return tokens

    async def main():
        full, cut = await asyncio.gather(collect("a"), collect("b", limit=3))
        await asyncio.sleep(0.2)  # let the loop apply the abort
        return full, cut

    full, cut = asyncio.run(main())
    assert full == expected
    assert cut == expected[:3]
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    assert not llm.engine.has_unfinished()


def test_a_second_request_with_a_live_id_is_refused_and_the_first_runs_on(llama_path):
    """Seen failing before AsyncEngine.generate checked the id: the second call took over
    the first's queue, its refusal then aborted the id, and the first stream got nothing
    more (wait_for timed out)."""
    llm = LLM(llama_path, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = AsyncEngine(llm.engine)

    async def main():
        first = engine.generate(Request("dup", PROMPT, params))
        head = await first.__anext__()
        try:
            async for _ in engine.generate(Request("dup", PROMPT, params)):
                pass
        except ValueError as e:
            refused = str(e)
        rest = await asyncio.wait_for(_drain(first), 30)
        return [head, *rest], refused

    deltas, refused = asyncio.run(main())
    assert "already in use" in refused
    assert sum(len(d.new_token_ids) for d in deltas) == 10
    assert deltas[-1].finish_reason == "length"


async def _drain(stream) -> list:
    return [d async for d in stream]


def test_async_bad_request_fails_only_itself(llama_path):
    llm = LLM(llama_path, dtype="float32", device="cpu")
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run(rid, prompt):
        try:
            return [
                t
                async for d in engine.generate(Request(rid, prompt, params))
                for t in d.new_token_ids
            ]
        except ValueError as e:
            return str(e)

    async def both():
        return await asyncio.gather(run("g", PROMPT), run("x", []))

    good, bad = asyncio.run(asyncio.wait_for(both(), 60))
    assert len(good) == 4
    assert "empty" in bad


def test_cli_generate(llama_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "generate",
            "--model",
            llama_path,
            "--prompt",
            "the quick",
            "--max-tokens",
            "5",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    llm = LLM(llama_path, device="cpu")
    assert (
        out.stdout.rstrip("\n")
        == llm.generate("the quick", SamplingParams(temperature=0, max_tokens=5))[0].text
    )


def test_cli_reports_bad_model_path(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "generate", "--model", str(tmp_path), "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "config.json" in out.stderr


def test_light_modules_do_not_import_torch():
    """Serve's gRPC proxy imports the servicer; it must not drag torch and the engine in."""
    code = "import sys, app.serve.grpc_api.grpc_servicer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
