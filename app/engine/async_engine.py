"""asyncio front of the engine: step() runs in a worker thread, deltas fan out per request.

add/abort calls from the event loop are queued and applied between steps, so the engine is
only ever touched by one thread at a time. A step's deltas are handed to their requests'
sinks synchronously, in one loop over the step's output: `run`'s callers see all of a
step's deltas before the event loop runs anything else (app/serve/channel/delta_outbox.py batches
on that), `generate`'s consumers each wake up in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from app.engine.engine import Engine
from app.engine.request import Request, RequestDelta, RequestError


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        # request id -> where its deltas (or an exception failing it) go
        self._sinks: dict[str, Callable[[RequestDelta | BaseException], None]] = {}
        self._commands: list = []
        self._loop_task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._done: dict[str, set[int]] = {}  # finished output indices per request
        # prefill-only requests whose token has not gone out yet: their export's final
        # delta, handed over by the transfer worker, is held until it has
        self._before_token: set[str] = set()
        self._held: dict[str, RequestDelta] = {}

    async def generate(self, request: Request) -> AsyncIterator[RequestDelta]:
        """Streams the request's deltas; cancelling the consumer aborts the request."""
        queue: asyncio.Queue = asyncio.Queue()
        self._open(request, queue.put_nowait)
        try:
            while True:
                delta = _checked(await queue.get())
                yield delta
                if delta.finished and self._all_done(request, delta):
                    return
        finally:
            self._close(request.request_id)

    async def run(self, request: Request, on_delta: Callable[[RequestDelta], None]) -> None:
        """Hands each delta to ``on_delta`` synchronously, inside the step's fan-out, and
        returns after the final one; raises what fails the request. Cancelling aborts it.
        ``on_delta`` must not raise."""
        done: asyncio.Future = asyncio.get_running_loop().create_future()

        def sink(item: RequestDelta | BaseException) -> None:
            if done.done():
                return
            try:
                delta = _checked(item)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)
                return
            on_delta(delta)
            if delta.finished and self._all_done(request, delta):
                done.set_result(None)

        self._open(request, sink)
        try:
            await done
        finally:
            self._close(request.request_id)

    def _open(self, request: Request, sink: Callable) -> None:
        if request.request_id in self._sinks:
            # Refused before anything is touched: taking over the id would strand the
            # running request's stream and abort it.
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._sinks[request.request_id] = sink
        if request.prefill_only:  # its export's final delta waits for its token
            self._before_token.add(request.request_id)
        self._submit(("add", request))

    def _close(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None:
            self._submit(("abort", request_id))
            self._done.pop(request_id, None)
        self._before_token.discard(request_id)
        self._held.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def _all_done(self, request: Request, delta: RequestDelta) -> bool:
        done = self._done.setdefault(request.request_id, set())
        done.add(delta.index)
        if len(done) < request.sampling_params.n:
            return False
        del self._done[request.request_id]
        return True

    def _submit(self, command) -> None:
        self._commands.append(command)
        self._wake.set()
        self.engine.wake()  # a step idling on a KV transfer or compile returns for it
        if self._loop_task is None or self._loop_task.done():
            loop = asyncio.get_running_loop()
            self._hook_transfers(loop)
            self._loop_task = loop.create_task(self._run())

    def _hook_transfers(self, loop: asyncio.AbstractEventLoop) -> None:
        """A KV export's delta goes to its sink as soon as the transfer worker has it, from
        that thread through this loop, not after the next step: an early part
        (`Request.export_early`) is fetched and imported while the prompt's next step runs,
        and the final one reaches the decode replica while this engine runs other prompts.
        A final delta never overtakes its request's token: it waits for that token's fan-out
        (`_fan_out`)."""
        transfers = getattr(self.engine, "transfers", None)
        if transfers is None:  # an engine stand-in
            return

        def from_worker(delta: RequestDelta) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(self._exported, delta)

        transfers.on_export = from_worker

    def _exported(self, delta: RequestDelta) -> None:
        rid = delta.request_id
        if delta.finished and rid in self._before_token:
            self._held[rid] = delta
            return
        sink = self._sinks.get(rid)
        if sink is not None:
            sink(delta)

    def _fan_out(self, deltas: list[RequestDelta]) -> None:
        """A step's deltas to their sinks, in order; then the final export delta each
        exporting request's token was waiting for."""
        for delta in deltas:
            rid = delta.request_id
            sink = self._sinks.get(rid)
            if sink is not None:
                sink(delta)
            if delta.new_token_ids and rid in self._before_token:
                self._before_token.discard(rid)
                held = self._held.pop(rid, None)
                if held is not None:
                    self._exported(held)

    def _apply_commands(self) -> None:
        commands, self._commands = self._commands, []
        for kind, arg in commands:
            if kind == "abort":
                self.engine.abort(arg)
                continue
            try:
                self.engine.add_request(arg)
            except Exception as e:  # bad input or overload: only this request fails
                sink = self._sinks.get(arg.request_id)
                if sink is not None:
                    sink(e)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._wake.clear()
                if not self._commands:
                    await self._wake.wait()
                continue
            try:
                deltas = await loop.run_in_executor(None, self.engine.step)
            except Exception as e:  # the engine is broken (e.g. a TP rank died): fail waiters
                for sink in list(self._sinks.values()):
                    sink(e)
                return  # the next request restarts the loop (and fails the same way)
            self._fan_out(deltas)  # one synchronous fan-out per step (module docstring)


def _checked(item: RequestDelta | BaseException) -> RequestDelta:
    if isinstance(item, BaseException):
        raise item
    if item.error is not None:  # only this request failed (e.g. its KV import)
        raise RequestError(item.error)
    return item
