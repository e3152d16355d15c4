"""The ingress's connection to one engine replica's call port (app/serve/call_port.py):
calls placed on it, and their `Accepted` / `Ended` answers.

Any failure of the connection (it closes, a frame cannot be read or loaded) breaks the
link: every call still open on it fails with `DeltaChannelError` (retriable), and the
caller opens a new link for the next call.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

from app.serve.call_wire import Accepted, CallAddress, Cancel, Deliver, Ended, Submit
from app.serve.delta_wire import DeltaChannelError, encode_frame, read_frame

log = logging.getLogger(__name__)
# A port that drops connection attempts silently must not hold calls long: they go through
# Serve instead, and the address is avoided for a while (DirectCaller).
CONNECT_S = 2.0


class DirectCall:
    """One call placed on a `PortLink`: `accepted` resolves when the replica took it,
    `result` with its return value (or error)."""

    def __init__(self, link: PortLink, call_id: int):
        loop = asyncio.get_running_loop()
        self.link, self.call_id = link, call_id
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.result: asyncio.Future[Any] = loop.create_future()

    def cancel(self) -> None:
        if not self.result.done():
            self.link.cancel(self.call_id)

    def deliver(self, value: Any) -> bool:
        """Sends ``value`` to the running call (its `call_mail()`); False if the call has
        ended or its link broke (nothing sent)."""
        return not self.result.done() and self.link.deliver(self.call_id, value)

    def settle(self, message: Accepted | Ended) -> None:
        if not self.accepted.done():
            if isinstance(message, Ended) and message.error is not None:
                self.accepted.set_exception(message.error)
            else:
                self.accepted.set_result(None)
        if isinstance(message, Ended) and not self.result.done():
            if message.error is not None:
                self.result.set_exception(message.error)
            else:
                self.result.set_result(message.result)
        # Retrieved here: a caller that stopped waiting must not log "never retrieved".
        for f in (self.accepted, self.result):
            if f.done() and not f.cancelled():
                f.exception()

    def fail(self, error: BaseException) -> None:
        self.settle(Ended(self.call_id, error=error))


class PortLink:
    """The connection from this ingress to one replica's call port."""

    def __init__(self, address: CallAddress):
        self.address = address
        self.error: DeltaChannelError | None = None  # set once broken; a new link replaces it
        self._ids = itertools.count()
        self._calls: dict[int, DirectCall] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._opening: asyncio.Task | None = None

    async def connected(self) -> None:
        """Opens the connection on first use (shared by concurrent callers); raises the
        link's error if it cannot be opened or broke."""
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        await asyncio.shield(self._opening)
        if self.error is not None:
            raise self.error

    def submit(self, method: str, args: tuple[Any, ...]) -> DirectCall:
        """Places the call on a connected link; the frame leaves at once."""
        assert self._writer is not None and self.error is None, "connected() first"
        call = DirectCall(self, next(self._ids))
        self._calls[call.call_id] = call
        call.result.add_done_callback(lambda _: self._calls.pop(call.call_id, None))
        self._writer.write(encode_frame([Submit(call.call_id, method, args)]))
        return call

    def cancel(self, call_id: int) -> None:
        call = self._calls.pop(call_id, None)
        if call is None:
            return
        if self._writer is not None and self.error is None:
            self._writer.write(encode_frame([Cancel(call_id)]))
        call.result.cancel()

    def deliver(self, call_id: int, value: Any) -> bool:
        if call_id not in self._calls or self._writer is None or self.error is not None:
            return False
        self._writer.write(encode_frame([Deliver(call_id, value)]))
        return True

    def close(self) -> None:
        self._break(DeltaChannelError("the call channel was closed by the ingress"))

    async def _open(self) -> None:
        host, port = self.address.host, self.address.port
        try:
            opening = asyncio.open_connection(host, port)
            reader, self._writer = await asyncio.wait_for(opening, CONNECT_S)
        except Exception as e:  # noqa: BLE001 - any failure: the link is unusable
            self._break(DeltaChannelError(f"cannot reach the call port {host}:{port}: {e!r}"))
            return
        self._writer.write(self.address.token)
        asyncio.get_running_loop().create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        error = DeltaChannelError("the call channel to an engine replica closed")
        try:
            while (frame := await read_frame(reader)) is not None:
                for message in frame:
                    call = self._calls.get(message.call_id)
                    if call is not None:
                        call.settle(message)
        except Exception as e:  # noqa: BLE001 - e.g. an answer this process cannot unpickle
            error = DeltaChannelError(f"the call channel to an engine replica broke: {e!r}")
        self._break(error)

    def _break(self, error: DeltaChannelError) -> None:
        if self.error is not None:
            return
        self.error = error
        log.warning("call channel to %s:%d: %s", self.address.host, self.address.port, error)
        for call in list(self._calls.values()):
            call.fail(error)
        self._calls.clear()
        if self._writer is not None:
            self._writer.close()
