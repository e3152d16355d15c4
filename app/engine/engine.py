"""The engine: add_request / step / abort over one model in one process (no Ray).

One step reads top to bottom (`step`): schedule -> plan (app/engine/step.py) -> run the
model -> sample -> apply. `_apply` is the one place that changes sequences, blocks and
outputs after a forward pass; the runner sees only the plan, never a Sequence.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from app.config import EngineConfig
from app.engine.attention import backend_ops
from app.engine.block_manager import BlockManager
from app.engine.cuda_graphs import capturable
from app.engine.detokenizer import IncrementalDetokenizer
from app.engine.fingerprint import eos_token_ids, model_fingerprint
from app.engine.kv_cache import KVCache
from app.engine.model_runner import ModelRunner
from app.engine.outputs import OutputProcessor
from app.engine.request import Request, RequestDelta
from app.engine.sampler import SamplingBatch, greedy_tokens, sample
from app.engine.sampling_params import SamplingParams
from app.engine.scheduler import Scheduler, SchedulerOutput
from app.engine.sequence import SeqStatus, Sequence
from app.engine.shard import budget_blocks, kv_cache_spec, load_rank_model
from app.engine.spec.deltas import merge_deltas
from app.engine.spec.factory import extra_block_bytes, make_speculator, uses_mtp
from app.engine.spec.sampling import plain_greedy
from app.engine.step import execute, plan_step
from app.engine.step_rates import StepRates, step_work
from app.engine.step_threads import StepThreads
from app.engine.structured.manager import StructuredOutputs
from app.engine.tp_driver import DriverRunner, ShardedKVCache, min_over_ranks
from app.engine.transfers import Transfers
from app.engine.workers import start_local_workers
from app.kv.chunk_format import ChunkFormat
from app.kv.keys import make_salt
from app.models.parallel import SINGLE
from app.tokenizer import Tokenizer

log = logging.getLogger(__name__)
# A step with nothing to run but KV transfers / grammar compiles in flight sleeps until one
# finishes, `wake` is called (a new request or abort), or this long: no busy loop.
TRANSFER_IDLE_S = 0.02
COMPILE_IDLE_S = 0.05


class Engine:
    def __init__(self, config: EngineConfig, progress: bool = False, tp_group=None):
        """tp_group: this process's place in a tensor-parallel replica (app/engine/workers.py);
        None starts the local workers when config.tensor_parallel_size > 1."""
        self.config = config
        if tp_group is None and config.tensor_parallel_size > 1:
            tp_group = start_local_workers(config)
        self.tp_group = tp_group
        self.tp_ctx = tp_group.ctx if tp_group is not None else SINGLE
        self.device = tp_group.device if tp_group is not None else config.resolved_device()
        self.dtype = config.resolved_dtype()
        try:
            self._build(config, progress)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig, progress: bool) -> None:
        spec = config.speculative_config
        self.model, self.model_config = load_rank_model(
            config, self.tp_ctx, self.device, self.dtype, progress, mtp=uses_mtp(spec)
        )
        self.tokenizer = Tokenizer.from_path(config.model, self.model_config.eos_token_ids)
        self.fingerprint = model_fingerprint(config.model, self.dtype, config.weight_quant)
        self.kv_spec = kv_cache_spec(
            self.model, self.model_config, config.cache, self.tp_ctx, self.dtype
        )
        self.chunk_format = ChunkFormat(self.fingerprint, self.kv_spec, config.cache.chunk_tokens)
        # A model proposer's KV (MTP layer, draft model) shares the block ids: a block costs both.
        blocks = budget_blocks(config.cache, self.kv_spec, self.device, extra_block_bytes(self))
        num_blocks = min_over_ranks(blocks, self.tp_ctx, self.device)
        ops = backend_ops(config.attention_backend, self.device)
        self._build_cache_and_runner(num_blocks, ops)
        self.blocks = BlockManager(
            self.cache.num_blocks, self.kv_spec.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.blocks)
        inline = self.tp_group is not None  # TP cache I/O is a collective: keep it in order
        # Ends a step's idle wait: a KV transfer or grammar compile finished, or `wake`
        self._idle = threading.Event()
        self.transfers = Transfers(
            self.blocks, self.cache, self.chunk_format, self.device, inline, self._idle
        )
        eos = eos_token_ids(
            config.model, self.model_config.eos_token_ids, self.tokenizer.eos_token_ids
        )
        self.outputs = OutputProcessor(self.model_config.max_position_embeddings, eos)
        vocab = self.model_config.vocab_size
        self.structured = StructuredOutputs(self.tokenizer, vocab, eos, self._idle)
        self.speculator = make_speculator(self, ops) if spec is not None else None
        self.seqs: dict[str, list[Sequence]] = {}
        self._pending: list[RequestDelta] = []
        self._imports: list[Sequence] = []  # import-only requests (Request.import_only)
        self.step_threads: StepThreads | None = None  # None: torch's thread count as set
        self.step_rates = StepRates()  # its measured decode step time and prefill rate

    def _build_cache_and_runner(self, num_blocks: int, ops) -> None:
        args = (self.model, ops, self.model_config.head_dim, self.device)
        if self.tp_group is None:
            self.cache = KVCache(self.kv_spec, num_blocks, self.device)
            self.runner = ModelRunner(args[0], self.cache, *args[1:])
            graphs = self.device.type == "cuda" and not self.config.enforce_eager
            if graphs and capturable(self.model):  # (capturable stacks MoE experts: CUDA only)
                mc = self.model_config  # decode graphs per batch bucket, before any request
                max_len, vocab = mc.max_position_embeddings, mc.vocab_size
                self.runner.enable_graphs(self.config.scheduler.max_num_seqs, max_len, vocab)
        else:  # rank 0 of a tensor-parallel replica: both also drive the other ranks
            self.cache = ShardedKVCache(self.kv_spec, num_blocks, self.device, self.tp_group)
            self.runner = DriverRunner(args[0], self.cache, *args[1:], self.tp_group)

    @property
    def salt_base(self) -> tuple[str, str, str]:
        return self.fingerprint, self.kv_spec.dtype.name, self.kv_spec.layout

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers (no-op for one process); idempotent."""
        group, self.tp_group = getattr(self, "tp_group", None), None
        if group is not None:
            group.shutdown()
        if getattr(self, "structured", None) is not None:
            self.structured.shutdown()
        if getattr(self, "transfers", None) is not None:
            self.transfers.shutdown()

    # --- the engine API -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.seqs:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._validate(request)
        salt = make_salt(*self.salt_base, request.cache_salt)
        p = request.sampling_params
        seqs = [
            Sequence(
                request,
                i,
                salt,
                IncrementalDetokenizer(self.tokenizer, p.stop, p.skip_special_tokens).primed(
                    request.prior_output_ids
                ),
            )
            for i in range(p.n)
        ]
        for later in seqs[1:]:
            later.wait_for = seqs[0]
        if p.structured is not None:  # validates now (bad schema: ValueError), compiles later
            self.structured.attach(seqs, p.structured, request.prior_output_ids)
        if request.import_only:
            self._add_import(seqs[0], salt)
            return
        self.scheduler.add(seqs)
        if request.kv_import:  # written off the step; pinned until admission
            seqs[0].kv_hold = self.transfers.start_import(
                request.request_id, request.prompt_token_ids, request.kv_import, salt
            )
        self.seqs[request.request_id] = seqs

    def _add_import(self, seq: Sequence, salt: bytes) -> None:
        """An import-only request (`Request.import_only`): its chunks are written off the
        step and made findable; the step ends it once they are (`_end_imports`). Never
        scheduled: it computes nothing."""
        request = seq.request
        assert request.sampling_params.n == 1, "an import-only request has one sequence"
        self.seqs[request.request_id] = [seq]
        seq.kv_hold = self.transfers.start_import(
            request.request_id, request.prompt_token_ids, request.kv_import or [], salt
        )
        self._imports.append(seq)

    def _end_imports(self) -> None:
        """Import-only requests whose chunks are written (or that import nothing: a chunk
        that does not continue the prompt, or a pool too short): their blocks stay in the
        prefix cache, unpinned, and the request ends (its rejected chunks reported)."""
        for seq in [s for s in self._imports if s.kv_hold is None or s.kv_hold.ready]:
            self._imports.remove(seq)
            if seq.finished:  # aborted, or its import failed
                continue
            if seq.kv_hold is not None:
                self.blocks.release_hold(seq.kv_hold)
                seq.kv_hold = None
            seq.status, seq.finish_reason = SeqStatus.FINISHED, "stop"
            delta = self.outputs.final_delta(seq)
            delta.kv_rejected, seq.kv_rejected = seq.kv_rejected, None
            self._pending.append(delta)
            self.seqs.pop(seq.request_id, None)

    def _validate(self, request: Request) -> None:
        ids = request.prompt_token_ids
        if not ids:
            raise ValueError("prompt is empty")
        max_len = self.model_config.max_position_embeddings
        if len(ids) >= max_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the model's context is {max_len} tokens"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        need = self.blocks.blocks_for(len(ids) + 1)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"prompt needs {need} KV blocks; the cache holds {self.blocks.num_blocks}"
            )

    def abort(self, request_id: str) -> None:
        """Stops a request now and frees its KV blocks (those of a KV transfer in flight
        once the transfer worker lets go of them); a final 'abort' delta follows."""
        self._end_request(request_id, "abort")

    def _end_request(self, request_id: str, reason: str, error: str | None = None) -> None:
        seqs = self.seqs.pop(request_id, [])
        self._pending += self.transfers.cancel(request_id, seqs)
        for seq in seqs:
            if not seq.finished:
                self.scheduler.remove(seq)
                seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
                delta = self.outputs.final_delta(seq)
                delta.error = error
                self._pending.append(delta)

    def _end(self, seq: Sequence, reason: str) -> None:
        """Ends one sequence without a new token (e.g. its grammar failed to compile)."""
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self._pending.append(self.outputs.final_delta(seq))
        self._finish(seq)

    def wake(self) -> None:
        """Ends a step's idle wait now (any thread): a request or abort came for it, so a
        new prompt does not wait for another request's KV transfer or grammar compile."""
        self._idle.set()

    def has_unfinished(self) -> bool:
        return bool(self.seqs) or bool(self._pending) or self.transfers.busy

    def step(self) -> list[RequestDelta]:
        for seq, why in self.structured.poll():
            log.warning("request %s: %s", seq.request_id, why)
            self._end(seq, "abort")
        deltas = self._apply_transfers()
        self._end_imports()
        deltas, self._pending = self._pending + deltas, []
        started = time.perf_counter()  # a step's time: proposals to the verified tokens
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.transfers.busy and not deltas:
                self.transfers.wait(TRANSFER_IDLE_S)  # idle until a KV transfer finishes
            elif self.structured.compiling and not deltas:
                self.structured.wait(COMPILE_IDLE_S)  # idle until a grammar compiles
            return deltas
        starts = [seq.num_computed_tokens for seq, _ in out.scheduled]
        plan = plan_step(out.scheduled, self.kv_spec.block_size)
        if self.step_threads is not None:  # set on the stepping thread (step_threads.py)
            self.step_threads.apply(max(n for _, n in out.scheduled))  # longest chunk
        result = self.runner.run(plan)
        sampled = [out.scheduled[i][0] for i in result.sampled]
        if sampled:  # [rows, V]: grammar rows (speculated ones too) get -inf outside
            self.structured.mask(result.logits, sampled)
        emitted = self._sample(result.logits, sampled)
        prefill, decode_rows = step_work(out.scheduled)  # before `_apply` moves them on
        deltas += self._apply(out, sampled, emitted)
        if self.speculator is not None:
            self.speculator.after_step(out.scheduled, starts, self.runner.last_hidden)
        self.step_rates.record(prefill, decode_rows, time.perf_counter() - started)
        return deltas

    def _apply_transfers(self) -> list[RequestDelta]:
        """KV transfers the side thread finished: export deltas, failed requests, and
        imported chunks whose tag failed (reported with the request's first token)."""
        done = self.transfers.poll()
        for request_id, error in done.failed:
            self._end_request(request_id, "error", error)
        for request_id, rejected in done.rejected:
            for seq in self.seqs.get(request_id, [])[:1]:
                seq.kv_rejected = rejected
        return done.deltas

    def _apply(self, out: SchedulerOutput, sampled: list[Sequence], emitted: list) -> list:
        """A step's results: progress and full blocks, new tokens, finished sequences."""
        for seq, n in out.scheduled:  # proposed tokens count once verified (settle)
            seq.num_computed_tokens += n - len(seq.spec_tokens)
            self.blocks.commit_full_blocks(seq)
            if seq.request.export_early and not seq.prompt_done:
                self._export_early(seq)
        deltas = []
        for seq, tokens in zip(sampled, emitted):
            delta = self._emit(seq, tokens)
            if delta is None:
                continue
            if seq.request.prefill_only:  # the token goes out now, the KV after it
                seq.status = SeqStatus.FINISHED  # finished below
                self.transfers.start_export(seq, delta)  # off the step: the final delta
                delta.finished = False  # the export's delta ends the request
            if seq.finished:
                self._finish(seq)
            deltas.append(delta)
        return deltas

    def _export_early(self, seq: Sequence) -> None:
        """The prompt's chunks this step completed go out now (`Request.export_early`), not
        after its last step: their reader imports them while the rest is computed."""
        ct = self.chunk_format.chunk_tokens
        upto = seq.num_computed_tokens // ct * ct
        if upto > seq.num_exported_tokens:
            self.transfers.start_early_export(seq, upto)

    def _sample(self, logits: torch.Tensor, sampled: list[Sequence]) -> list[list]:
        """Per sequence, the (token, logprob) pairs it emits this step, in order."""
        if not sampled:
            return []
        if self.speculator is not None:
            return self.speculator.verify(logits, sampled)
        if all(plain_greedy(s.params) for s in sampled):  # what sample() does, minus the
            return [[(t, None)] for t in greedy_tokens(logits).tolist()]  # [B] tensors
        batch = SamplingBatch.from_seqs(sampled, logits.shape[-1], logits.device)
        result = sample(logits, batch)
        return [[pair] for pair in zip(result.token_ids, result.logprobs)]

    def _emit(self, seq: Sequence, emitted: list) -> RequestDelta | None:
        """Appends the tokens until one finishes the sequence; one delta for all of them.
        None: the sequence's grammar rejected its token and it was ended."""
        delta = None
        for token, logprob in emitted:
            if not self.structured.advance(seq, token):
                self._end(seq, "abort")
                return None
            seq.token_ids.append(token)
            delta = merge_deltas(delta, self.outputs.process(seq, token, logprob))
            if seq.finished:
                break
        if self.speculator is not None:
            self.speculator.settle(seq, len(delta.new_token_ids))
        if seq.kv_rejected and delta is not None:
            delta.kv_rejected, seq.kv_rejected = seq.kv_rejected, None
        return delta

    def _finish(self, seq: Sequence) -> None:
        if seq.kv_hold is not None:  # ended before admission (e.g. its grammar failed)
            self._pending += self.transfers.cancel(seq.request_id, [seq])
        self.scheduler.remove(seq)
        siblings = self.seqs.get(seq.request_id, [])
        if all(s.finished for s in siblings):
            self.seqs.pop(seq.request_id, None)

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Next-token logits at every position of token_ids: [T, vocab] float32.

        One prefill outside the scheduler (for evaluation and tests); do not interleave with
        step() from another thread.
        """
        request = Request("score", list(token_ids), SamplingParams(max_tokens=1))
        self._validate(request)
        seq = Sequence(request, 0, make_salt(*self.salt_base, None), None)
        if not self.blocks.ensure_slots(seq, seq.num_tokens):
            raise RuntimeError("not enough free KV blocks to score this sequence")
        try:
            logits, _ = execute(self.runner, [(seq, seq.num_tokens)], all_rows=True)
        finally:
            self.blocks.free(seq)
        return logits

    # --- introspection for metrics and tests --------------------------------------
    def stats(self) -> dict[str, float]:
        s = self.blocks.stats
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_free": self.blocks.num_free,
            "kv_cache_usage": self.blocks.usage(),
            "prefix_cache_queries": s.queries,
            "prefix_cache_hits": s.hits,
            "prefix_cache_evictions": s.evictions,
            "preemptions": self.scheduler.num_preemptions,
            # 0: no such step yet (step_rates.py)
            "decode_step_seconds": self.step_rates.decode_step_s or 0.0,
            "prefill_tokens_per_second": self.step_rates.prefill_tokens_per_s or 0.0,
            **(self.speculator.stats.as_dict() if self.speculator is not None else {}),
        }
