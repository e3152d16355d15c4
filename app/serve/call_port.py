"""Replica side of the direct call channel (app/serve/call_wire.py): a TCP server in the
replica's event loop that runs the calls ingresses submit, as Serve would run them.

Each accepted call runs the replica's own method (e.g. `EngineServer.run_generate_to`, what
its Serve method `generate_to` runs) in a task; `Cancel`, or the connection ending (the ingress
went away), cancels it, which aborts its engine request, as a cancelled Serve call does. A
call needs one of the replica's `Slots` (its `max_ongoing_requests`, shared with Serve's
calls) at once, else it is answered `ReplicaBusy`, and the ingress places it through Serve.
A running call may be sent one value by the ingress (`Deliver`), which it awaits through
`call_mail()` (the decode call: the prefill's result, app/serve/decode.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import pickle
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass

from app.serve.call_wire import (
    DIRECT_METHODS,
    Accepted,
    CallAddress,
    Cancel,
    Deliver,
    Ended,
    ReplicaBusy,
    Submit,
)
from app.serve.delta_wire import (
    TOKEN_BYTES,
    DeltaChannelError,
    encode_frame,
    presents_token,
    read_frame,
)
from app.serve.slots import Slots

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Mail:
    """A direct call's mail: resolved by the ingress's `Deliver` for it; None once the call
    has ended (tasks the call started inherit the holder, not what was delivered)."""

    future: asyncio.Future | None


# Set in the context of each direct call's task only (a Serve call sees None: nothing can
# be delivered to it).
_CALL_MAIL: contextvars.ContextVar[_Mail | None] = contextvars.ContextVar("call_mail", default=None)


def call_mail() -> asyncio.Future | None:
    """The value the ingress delivers to the direct call running in this task, to await;
    None when this task runs no direct call (or its call has ended)."""
    mail = _CALL_MAIL.get()
    return None if mail is None else mail.future


class CallPort:
    """``target``: the object whose DIRECT_METHODS run here (the replica); ``slots``: its
    share of max_ongoing_requests. The socket is bound at construction (its address is
    known at once, e.g. for routing stats built before the loop runs); `start` begins
    accepting."""

    def __init__(self, target: object, host: str, slots: Slots):
        self.target = target
        self.slots = slots
        self.ongoing = 0  # direct calls running now, over all connections
        self.calls = 0  # calls accepted so far (tests, debugging)
        self._sock = socket.create_server((host, 0))
        port = self._sock.getsockname()[1]
        self.address = CallAddress(host, port, secrets.token_bytes(TOKEN_BYTES))
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self.serving = False  # accepting connections (advertise the address only then)
        self.draining = False  # shutting down: new calls are refused (ReplicaBusy)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, sock=self._sock)
        self.serving = True

    async def drain(self, within_s: float) -> None:
        """Replica shutdown: refuses new calls, lets the running ones end (within
        ``within_s``), then stops. Serve's own graceful drain waits only for its calls."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while self.ongoing and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self.stop()

    async def stop(self) -> None:
        """Stops accepting and ends every connection (their calls are cancelled; the
        ingresses fail them with a retriable error)."""
        self.serving = False
        for connection in list(self._connections):
            connection.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        else:
            self._sock.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(self, writer)
        self._connections.add(connection)
        try:
            if not await presents_token(reader, self.address.token):
                log.warning("call port: refused a connection without the token")
                return
            while (frame := await read_frame(reader)) is not None:
                for message in frame:
                    connection.handle(message)
        except Exception as e:  # noqa: BLE001 - any failure ends this connection only
            log.warning("call port: a connection from an ingress broke: %r", e)
        finally:
            self._connections.discard(connection)
            connection.close()  # the ingress is gone: nobody reads these calls' deltas


class _Connection:
    """One ingress's connection: its running calls, by call id."""

    def __init__(self, port: CallPort, writer: asyncio.StreamWriter):
        self.port, self.writer = port, writer
        self.tasks: dict[int, asyncio.Task] = {}
        self.mail: dict[int, _Mail] = {}  # each running call's `call_mail()`
        self.cancelled: set[int] = set()  # calls the ingress cancelled (no answer owed)

    def handle(self, message: object) -> None:
        if isinstance(message, Cancel):
            task = self.tasks.get(message.call_id)
            if task is not None:
                self.cancelled.add(message.call_id)
                task.cancel()
        elif isinstance(message, Deliver):
            mail = self.mail.get(message.call_id)
            if mail is not None and not mail.future.done():  # else the call ended: dropped
                mail.future.set_result(message.value)
        elif isinstance(message, Submit) and message.method in DIRECT_METHODS:
            self._start(message)
        elif isinstance(message, Submit):
            error = PermissionError(f"{message.method!r} cannot be called directly")
            _reply(self.writer, Ended(message.call_id, error=error))
        else:
            log.warning("call port: ignored an unknown message %r", type(message).__name__)

    def close(self) -> None:
        self.cancelled.update(self.tasks)  # the ingress is gone: no answer owed
        for task in self.tasks.values():
            task.cancel()
        self.writer.close()

    def _start(self, call: Submit) -> None:
        port = self.port
        try:  # before a slot is taken: a bad call takes none
            method: Callable = getattr(port.target, DIRECT_METHODS[call.method])
            run = method(*call.args)
        except Exception as e:  # noqa: BLE001 - another deployment's method, bad arguments
            _reply(self.writer, Ended(call.call_id, error=e))
            return
        if port.draining or not port.slots.try_take():
            run.close()
            error = ReplicaBusy("shutting down" if port.draining else "no free slot")
            _reply(self.writer, Ended(call.call_id, error=error))
            return
        port.ongoing += 1
        port.calls += 1
        _reply(self.writer, Accepted(call.call_id))
        mail = self.mail[call.call_id] = _Mail(asyncio.get_running_loop().create_future())
        context = contextvars.copy_context()
        context.run(_CALL_MAIL.set, mail)
        task = asyncio.get_running_loop().create_task(run, context=context)
        self.tasks[call.call_id] = task
        task.add_done_callback(lambda t: self._ended(call.call_id, t))

    def _ended(self, call_id: int, task: asyncio.Task) -> None:
        self.port.ongoing -= 1
        self.port.slots.release()
        self.tasks.pop(call_id, None)
        mail = self.mail.pop(call_id, None)
        if mail is not None:  # a value delivered but never awaited goes with it
            mail.future.cancel()
            mail.future = None
        if call_id in self.cancelled:
            self.cancelled.discard(call_id)
            return  # cancelled by the ingress (or its connection ended): nobody waits
        if task.cancelled():  # cancelled here, not by the ingress, which still waits
            _reply(self.writer, Ended(call_id, error=DeltaChannelError("cancelled on the replica")))
            return
        error = task.exception()
        _reply(self.writer, Ended(call_id, None if error else task.result(), error))


def _reply(writer: asyncio.StreamWriter, message: Accepted | Ended) -> None:
    if writer.is_closing():
        return
    if isinstance(message, Ended) and message.error is not None:
        message = Ended(message.call_id, error=_portable(message.error))
    writer.write(encode_frame([message]))


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives a pickle round trip (the ingress must be able to load it),
    else a RuntimeError naming it (an exception whose __init__ takes other arguments than
    it passes to BaseException cannot be unpickled)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception as e:  # noqa: BLE001 - any failure: send what can be sent
        return RuntimeError(f"{type(error).__name__}: {error} (not portable: {e})")
