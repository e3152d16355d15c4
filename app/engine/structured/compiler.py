"""Grammar compilation off the step loop: a thread pool and an LRU cache keyed by spec.

Compiling a grammar against a vocabulary (precomputing which tokens each grammar state
accepts) takes milliseconds to seconds for large schemas; the engine's step thread never
waits for it. A request's sequences stay in the waiting queue until their future is done.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from app.engine.structured.backend import StructuredOutputError, clean_message, xgrammar
from app.engine.structured.spec import StructuredOutputSpec
from app.tokenizer import Tokenizer


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
    """xgrammar's view of our tokenizer: each id's text (byte-level BPE decoded by xgrammar)
    and the stop tokens a finished grammar allows.

    Special added tokens (chat markers such as <|user|>) get an empty text, which xgrammar
    treats as special and never allows inside a grammar: their literal text would otherwise
    match e.g. a JSON string while detokenizing to nothing.
    """
    xgr = xgrammar()
    stop = sorted(set(stop_token_ids)) or None
    if tokenizer.hf is None:  # the raw-bytes fallback tokenizer: id i is byte i
        vocab = [bytes([i]) for i in range(256)]
        return xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop
        )
    hf = tokenizer.hf
    encoded = [""] * max(vocab_size, hf.get_vocab_size(with_added_tokens=True))
    for text, i in hf.get_vocab(with_added_tokens=True).items():
        encoded[i] = text
    for i, added in hf.get_added_tokens_decoder().items():
        if added.special:
            encoded[i] = ""
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(hf.to_str())
    return xgr.TokenizerInfo(
        encoded[:vocab_size],
        meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stop,
        add_prefix_space=meta["add_prefix_space"],
    )


@dataclass(slots=True)
class CompilerStats:
    compiles: int = 0
    cache_hits: int = 0
    failures: int = 0
    compile_seconds: float = 0.0


class GrammarCompiler:
    """submit(spec) -> Future[CompiledGrammar]; equal specs share one future (LRU-bounded)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        *,
        max_workers: int = 1,
        cache_size: int = 256,
    ):
        xgr = xgrammar()
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        # xgrammar's own cache is off: ours is keyed by spec and bounded by entries.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.stats = CompilerStats()

    def submit(self, spec: StructuredOutputSpec) -> Future:
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                self.stats.cache_hits += 1
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f, key=spec.key: self._forget_failure(key, f))
        return future

    def compile(self, spec: StructuredOutputSpec):
        """Blocking form of submit (tests, benchmarks)."""
        return self.submit(spec).result()

    def _compile(self, spec: StructuredOutputSpec):
        start = time.perf_counter()
        grammar = spec.build_grammar()
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise StructuredOutputError(
                f"cannot compile the {spec.kind}: {clean_message(e)}"
            ) from None
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - start
        return compiled

    def _forget_failure(self, key: tuple, future: Future) -> None:
        if not future.cancelled() and future.exception() is None:
            return
        with self._lock:
            self.stats.failures += 1
            if self._cache.get(key) is future:  # a later request may try again
                del self._cache[key]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
