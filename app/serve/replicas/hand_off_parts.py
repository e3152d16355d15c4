"""The decode replica's side of an overlapped hand-off: the parts of a prompt's KV that the
prefill replica posts while it computes the rest (`HandOffPart`), fetched and imported in
prompt order before the prefill's result comes (docs/serving.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from app.engine.request import Request
from app.kv.chunk import KVChunk
from app.serve.messages import GenerateRequest, HandOffPart
from app.serve.replicas.replica import EngineHost

log = logging.getLogger(__name__)


def chunks_end(chunks: list[KVChunk]) -> int:
    """The prompt position after ``chunks`` (consecutive, from position 0)."""
    return chunks[-1].meta.start_pos + chunks[-1].meta.num_tokens if chunks else 0


def continues(chunks: list[KVChunk], start: int) -> bool:
    """Whether chunks starting at ``start`` continue ``chunks`` (from position 0)."""
    return chunks_end(chunks) == start


class PartImports:
    """The parts of an overlapped hand-off (`HandOffPart`), each fetched as it comes and
    imported into this replica's prefix cache (`Request.import_only`) in prompt order,
    while the prefill replica computes the rest. Once the result is in hand, ``ready``
    gives every chunk fetched so far, those whose import ended marked verified: the request
    that continues the prompt imports them all again, which for those is a pin (its prefix
    match finds them; a chunk evicted meanwhile is written again from the same bytes), and
    imports still running are cancelled rather than waited for (on a busy replica an
    import ends only at a step's start, so a chain of them would add a step each). A part
    that cannot be fetched, or a chunk whose tag an import rejects (dropped from the store),
    ends the run: the tokens after it are recomputed, as for any missing chunk."""

    def __init__(self, host: EngineHost, gen: GenerateRequest, on_part: Callable[[], None]):
        self.host, self.gen = host, gen
        self.on_part = on_part  # a part is taken (its chunks fetched and in the run)
        self.chunks: list[KVChunk] = []  # fetched, from position 0; verified once imported
        self.broken = False  # a gap: later parts are not used
        self._fetched: asyncio.Task | None = None  # the parts' fetches, chained in order
        self._importing: asyncio.Task | None = None  # their imports, chained in order
        self._count = 0

    def add(self, part: HandOffPart) -> None:
        fetch = asyncio.ensure_future(
            self.host.fetch(
                part.chunks, self.gen.prompt_token_ids, verify_tag=False, start=part.start
            )
        )
        self._fetched = asyncio.ensure_future(self._take(self._fetched, part, fetch))

    async def ready(self) -> list[KVChunk]:
        """The chunks of every part so far, once fetched; imports still running stop."""
        try:
            if self._fetched is not None:
                await self._fetched
        finally:
            if self._importing is not None:
                self._importing.cancel()
        return list(self.chunks)

    def cancel(self) -> None:
        for task in (self._fetched, self._importing):
            if task is not None:
                task.cancel()

    async def _take(self, before: asyncio.Task | None, part: HandOffPart, fetch) -> None:
        try:
            fetched = await fetch  # beside the earlier parts' fetches
            if before is not None:
                await before
        except BaseException:
            fetch.cancel()
            raise
        if self.broken or not continues(self.chunks, part.start) or not fetched.chunks:
            if not self.broken:
                log.warning(
                    "%s: the hand-off's part at token %d is not used (chunks up to %d, %d "
                    "of %d chunks fetched): the decode replica recomputes from there",
                    self.gen.request_id, part.start, chunks_end(self.chunks), len(fetched.chunks),
                    len(part.chunks),
                )  # fmt: skip
            self.broken = True
            return
        lo = len(self.chunks)
        self.chunks += fetched.chunks
        self.broken = len(fetched.chunks) < len(part.chunks)
        self.on_part()
        self._importing = asyncio.ensure_future(self._import(self._importing, lo, len(self.chunks)))

    async def _import(self, before: asyncio.Task | None, lo: int, hi: int) -> None:
        """Imports chunks[lo:hi] (with those before them, already imported: a pin), marks
        them verified, or cuts the run at the first one whose tag failed."""
        if before is not None:
            await before
        if hi > len(self.chunks):  # cut by an earlier import
            return
        self._count += 1
        offered = self.chunks[:hi]
        request = Request(
            f"{self.gen.request_id}/import-{self._count}",
            self.gen.prompt_token_ids[: chunks_end(offered)],
            cache_salt=self.gen.cache_salt,
            kv_import=offered,
            import_only=True,
        )
        rejected = []
        async for delta in self.host.async_engine.generate(request):
            rejected = delta.kv_rejected or rejected
        bad = {key for key, _ in rejected}
        for i in range(lo, hi):
            if self.chunks[i].key in bad:
                del self.chunks[i:]
                self.broken = True
                break
            self.chunks[i] = dataclasses.replace(self.chunks[i], verified=True)
        if rejected:
            await self.host.drop_rejected(rejected)
