"""DecodeServer: fetch the prompt's KV (verified), continue from the first token, stream."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

from ray import serve

from app.engine.request import Request, RequestDelta
from app.serve.engine_replica import EngineReplica
from app.serve.messages import DecodeRequest
from app.serve.streaming import coalesce

log = logging.getLogger(__name__)


@serve.deployment(name="DecodeServer")
class DecodeServer(EngineReplica):
    role = "decode"
    uses_store = True

    async def generate(self, req: DecodeRequest) -> AsyncIterator[RequestDelta]:
        """Deltas after the first token. If the prompt's KV cannot be fetched or verified,
        the engine recomputes what is missing: the tokens are the same either way."""
        gen, first = req.request, req.prefill.first
        prompt = gen.prompt_token_ids
        host = self.host
        host.inflight_tokens += len(prompt)
        try:
            # The tags are checked by the engine's import, in the same pass as its cache
            # write (app/engine/kv_transfer.py); what it rejects is dropped below.
            fetched = await host.fetch(req.prefill.chunks, prompt, verify_tag=False)
            params = gen.params
            request = Request(
                gen.request_id,
                prompt + first.new_token_ids,
                dataclasses.replace(
                    params, n=1, max_tokens=params.max_tokens - len(first.new_token_ids)
                ),
                cache_salt=gen.cache_salt,
                kv_import=fetched.chunks or None,
                prior_output_ids=list(first.new_token_ids),  # a grammar replays them
            )
            deltas = self._drop_rejected(host.async_engine.generate(request))
            # timed: inter-token latency on this replica (the first token came from prefill)
            timed = host.metrics.timed(deltas, len(prompt), count=False, after_first_token=True)
            # Closed explicitly (see EngineServer.generate): a cancel aborts at once.
            async with contextlib.aclosing(coalesce(timed, self.args.stream_interval_s)) as s:
                async for delta in s:
                    yield dataclasses.replace(delta, num_prompt_tokens=len(prompt))
        finally:
            host.inflight_tokens -= len(prompt)

    async def _drop_rejected(self, deltas: AsyncIterator[RequestDelta]):
        async with contextlib.aclosing(deltas):  # closing us aborts the engine request now
            async for delta in deltas:
                if delta.kv_rejected:
                    await self.host.drop_rejected(delta.kv_rejected)
                    delta = dataclasses.replace(delta, kv_rejected=None)
                yield delta
