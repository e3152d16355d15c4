"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

from tqdm import tqdm

from app.engine.engine import Engine
from app.engine.request import CompletionOutput, Request, RequestOutput
from app.engine.sampling_params import SamplingParams
from app.options import engine_config

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, *, show_progress: bool = False, **options: Any):
        """`options`: any engine option of app/config.py's dataclasses, by its flat name
        (app/options.py lists them: dtype, device, kv_cache_dtype, kv_cache_memory_bytes,
        block_size, enable_prefix_caching, max_num_seqs, max_num_batched_tokens,
        long_prefill_chunk, max_waiting, weight_quant, attention_backend,
        tensor_parallel_size, speculative_config, enforce_eager, ...); unknown names raise
        TypeError.

        tensor_parallel_size > 1 starts that many local ranks (this process is rank 0;
        gloo on CPU, NCCL on GPUs); call shutdown() or use `with LLM(...) as llm:`."""
        config = engine_config({**options, "model": model})
        self.engine = Engine(config, progress=show_progress)
        # Garbage collection ends the workers and the process group too (a notebook that
        # drops an LLM and builds another); the finalizer holds the engine, never self.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def stats(self) -> dict[str, float]:
        """The engine's counters: KV blocks, prefix cache, preemptions, speculation."""
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stops the tensor-parallel worker processes and leaves the process group (a no-op
        with one rank); idempotent, and what garbage collection of this LLM does too."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _tokens(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list):
            raise TypeError(
                f"a prompt is a str or a list of token ids, got {type(prompt).__name__}"
            )
        return prompt

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        requests = [
            Request(f"offline-{next(self._ids)}", self._tokens(p), params, cache_salt=cache_salt)
            for p in prompts
        ]
        return self.run(requests, use_tqdm)

    def run(self, requests: list[Request], use_tqdm: bool = False) -> list[RequestOutput]:
        """Adds every request, steps until all finish; outputs in request order."""
        outputs = {}
        for r in requests:
            self.engine.add_request(r)
            n = r.sampling_params.n
            outputs[r.request_id] = RequestOutput(
                r.request_id, r.prompt_token_ids, [CompletionOutput(i) for i in range(n)]
            )
        bar = tqdm(total=len(requests), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                outputs[delta.request_id].apply(delta)
            if use_tqdm:  # counting finished requests is O(B) per step: only for the bar
                bar.n = sum(all(o.finish_reason for o in out.outputs) for out in outputs.values())
                bar.refresh()
        bar.close()
        return [outputs[r.request_id] for r in requests]

    def chat(
        self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]], params=None
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.tokenizer.encode_chat(c) for c in conversations], params)
