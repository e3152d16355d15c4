"""The prefill's result handed to the decode call by the ingress, without Ray: a value
`Deliver`ed to a running call on a real CallPort (loopback), and the driver handing an
in-band result (or word that it is in the hand-off box) to the real DecodeServer behind
that port (app/serve/result_hand_over.py), with an in-memory box shared by the ingress and
the replicas."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from app.engine.sampling_params import SamplingParams
from app.kvstore.store import StoredChunk
from app.serve.call_port import call_mail
from app.serve.decode import DecodeServer
from app.serve.delta_inbox import DeltaInbox
from app.serve.direct_calls import DirectCaller
from app.serve.driver import RequestDriver
from app.serve.messages import PrefillResult
from app.serve.metrics import ReplicaMetrics
from app.serve.normalize import NormalizedRequest
from app.serve.port_link import PortLink
from app.serve.slots import Slots
from serve.test_call_channel import (
    APP,
    DEPLOYMENT,
    registered_router,
    replica_at,
    started_port,
    until,
)
from serve.test_delta_channel import StepEngine
from serve.test_delta_replicas import _Box, _server
from serve.test_driver import DESCRIBE, _Method, delta
from serve.test_driver_handoff import _send_head


class _MailReader:
    """A replica whose direct `generate_to` returns what was delivered to it."""

    def __init__(self):
        self.slots = Slots(4)

    async def run_generate_to(self, tag: str) -> tuple[str, object]:
        return tag, await call_mail()


def test_a_value_delivered_to_a_running_call_reaches_its_mail_and_only_its_own():
    """Two calls on one connection: each gets the value sent for it. A value for a call
    that has ended is not sent, and the port keeps no mail for it. Seen failing (the calls
    never returned) with the port ignoring `Deliver`."""

    async def main():
        port = await started_port(_MailReader())
        link = PortLink(port.address)
        await link.connected()
        a, b = link.submit("generate_to", ("a",)), link.submit("generate_to", ("b",))
        await asyncio.wait_for(asyncio.gather(a.accepted, b.accepted), 10)
        sent = [b.deliver(2), a.deliver(1)]
        results = await asyncio.wait_for(asyncio.gather(a.result, b.result), 10)
        late = a.deliver(3)
        mail_left = [len(c.mail) for c in port._connections]
        link.close()
        await port.stop()
        return sent, results, late, mail_left

    sent, results, late, mail_left = asyncio.run(main())
    assert sent == [True, True] and results == [("a", 1), ("b", 2)]
    assert late is False and mail_left == [0]


def test_a_result_with_any_chunk_ref_is_not_in_band():
    ref = StoredChunk(b"s", "a Ray ref", 0, 8, (5,))  # a store hit's chunk (a stand-in ref)
    assert not _result(False, [_in_band_chunk(), ref]).in_band
    assert _result(False, [_in_band_chunk()]).in_band and _result(False, []).in_band


def _in_band_chunk() -> StoredChunk:
    return StoredChunk(b"p", np.zeros(8, np.uint8), 0, 8, (5, 6))


def _result(posted: bool, chunks: list | None = None, first=None) -> PrefillResult:
    chunks = ([] if posted else [_in_band_chunk()]) if chunks is None else chunks
    first = first or delta([40], "He", finished=True)
    return PrefillResult("e-0", first, chunks, "p", posted=posted)


class _Prefill:
    """`prefill_to.remote(...)` placed through Serve (no direct caller for it): sends the
    token ahead to the inbox, then answers ``result`` once ``answer`` is set (or fails
    with ``error``), posting it to ``box`` first when ``result.posted``, as PrefillServer
    does. The call is a task, so a cancel of whoever awaits it reaches it (as it reaches a
    `PlacedCall`)."""

    def __init__(self, result: PrefillResult, box: _Box, answer: asyncio.Event, error=None):
        self.result, self.box, self.answer, self.error = result, box, answer, error
        self.task: asyncio.Task | None = None

    def remote(self, gen, reply_to, hand_off):
        self.task = asyncio.ensure_future(self._run(gen, reply_to, hand_off.key))
        return self.task

    async def _run(self, gen, reply_to, key: str) -> PrefillResult:
        await _send_head(reply_to, self.result.first, gen.request_id)
        await self.answer.wait()
        if self.error is not None:
            raise self.error
        if self.result.posted:  # its KV has refs: the prefill replica posts it
            await self.box.post(key, self.result)
        return self.result


async def _disaggregated(
    result: PrefillResult, busy=False, error=None, held=False, max_tokens: int = 4, local=0
):
    """A choice (``max_tokens``) of a driver whose decode calls go direct to a real
    DecodeServer's port (``busy``: it has no free slot, so they go through Serve, which
    runs the replica's method) and whose prefill answers ``result`` (``held``: once
    ``ns.answer`` is set); ``local``: the driver's `local_prefill_tokens` (the prompt has 2):
    -> ns (stream, box, port, prefill, serve_calls, inbox, engine)."""
    ns = SimpleNamespace(box=_Box(), serve_calls=[], answer=asyncio.Event())
    ns.inbox = await DeltaInbox.start()
    ns.engine = StepEngine()
    server = _server(DecodeServer, ns.engine, ns.box)
    ns.port = await started_port(server, max_ongoing=1)
    if busy:
        assert ns.port.slots.try_take()
    registered_router([replica_at(ns.port)])

    def through_serve(message, reply_to):  # Serve placed it: no call_mail() there
        ns.serve_calls.append(message.request.request_id)
        return asyncio.ensure_future(server.run_generate_to(message, reply_to))

    ns.prefill = _Prefill(result, ns.box, ns.answer, error)
    prefill = SimpleNamespace(prefill_to=ns.prefill, describe=_Method([], "p", DESCRIBE))
    decode = SimpleNamespace(generate_to=SimpleNamespace(remote=through_serve))
    driver = RequestDriver(
        ReplicaMetrics("ingress", "test-handoff"), prefill=prefill, decode=decode,
        inbox=ns.inbox, direct={"decode": DirectCaller(APP, DEPLOYMENT)}, hand_offs=ns.box,
        local_prefill_tokens=local,
    )  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens)
    req = NormalizedRequest("r", "e", "text_completion", [5, 6], params)
    ns.stream = await driver.start(req)
    if not held:
        ns.answer.set()
    return ns


async def _closed(ns) -> None:
    ns.stream.close()
    await ns.port.stop()
    await ns.inbox.stop()


def _tokens(got) -> list[int]:
    return [t for d in got for t in d.new_token_ids]


@pytest.mark.parametrize("posted", [False, True], ids=["in-band", "in-the-box"])
def test_the_ingress_hands_the_prefill_result_to_its_direct_decode_call(posted):
    """In-band: the ingress delivers the result itself, and nobody posts to or takes from
    the box; in the box (its KV has refs): the prefill posts it, the ingress says so, and
    the decode replica takes it there. Seen failing (collect timed out, the decode call
    waiting for its mail) with `hand_over` not delivering."""

    async def main():
        ns = await _disaggregated(_result(posted))
        try:
            return (await ns.stream.collect(timeout_s=10))[0], ns
        finally:
            await _closed(ns)

    got, ns = asyncio.run(main())
    assert _tokens(got) == [40, 1, 2, 3] and got[-1].finish_reason == "length", got
    assert ns.port.calls == 1 and ns.serve_calls == [] and ns.box.discards == []
    assert ns.box.posts == ns.box.takes == (["e-0"] if posted else [])


def test_a_short_prompt_is_one_direct_decode_call_whose_replica_prefills_it():
    """Conditional disaggregation over the direct call channel: the 2-token prompt (limit 2)
    gets no prefill call; the decode replica's engine gets the whole prompt, no KV to
    import, and every token, the first included, comes from it. Seen failing (the prefill
    called, tokens [40, 1, 2, 3]) with the limit at 1."""
    added: list = []

    async def main():
        ns = await _disaggregated(_result(False), local=2)
        add = ns.engine.add_request
        ns.engine.add_request = lambda request: (added.append(request), add(request))
        try:
            return (await ns.stream.collect(timeout_s=10))[0], ns
        finally:
            await _closed(ns)

    got, ns = asyncio.run(main())
    assert _tokens(got) == [1, 2, 3, 4] and got[-1].finish_reason == "length", got
    assert ns.prefill.task is None and ns.port.calls == 1 and ns.serve_calls == []
    assert ns.box.posts == ns.box.takes == ns.box.discards == []
    (request,) = added
    assert request.prompt_token_ids == [5, 6] and request.kv_import is None
    assert request.sampling_params.max_tokens == 4


def test_a_client_leaving_after_an_in_band_delivery_has_nothing_to_discard():
    """The result was delivered, never posted: a choice the client leaves mid-stream makes
    no call to the box (the hand-over knows). Seen failing (discards ['e-0']) with
    `nothing_in_the_box` always False."""

    async def main():
        ns = await _disaggregated(_result(False), max_tokens=10**6)
        try:
            got = [await asyncio.wait_for(ns.stream.next(), 10) for _ in range(3)]
            ns.stream.close()  # the client left
            await until(lambda: ns.port.ongoing == 0)
            await asyncio.sleep(0.05)
            return got, ns
        finally:
            await _closed(ns)

    got, ns = asyncio.run(main())
    assert _tokens(got) == [40, 1, 2] and ns.box.discards == ns.box.posts == []


def test_a_decode_call_the_busy_replica_sends_through_serve_takes_the_result_the_ingress_posted():
    """The decode replica has no free slot: its direct call is refused and Serve places
    it, where nothing can be delivered (the replica's method sees no mail and takes from
    the box), so the ingress posts the in-band result there. Seen failing (collect timed
    out, the take waiting) without that post."""

    async def main():
        ns = await _disaggregated(_result(False), busy=True)
        try:
            return (await ns.stream.collect(timeout_s=10))[0], ns
        finally:
            await _closed(ns)

    got, ns = asyncio.run(main())
    assert _tokens(got) == [40, 1, 2, 3] and ns.serve_calls == ["e-0"]
    assert ns.port.calls == 0 and ns.box.posts == ns.box.takes == ["e-0"]


def test_a_client_leaving_while_the_decode_call_waits_for_its_mail_leaves_nothing():
    """After the token, before the prefill answers: the decode call (waiting for its mail)
    is cancelled on its replica, whose port then keeps no mail for it; the prefill's later
    in-band answer is neither delivered nor posted, and the key is discarded (the prefill
    might have posted). Seen failing (the mail kept) without the port dropping it."""

    async def main():
        ns = await _disaggregated(_result(False), held=True)
        try:
            head = await asyncio.wait_for(ns.stream.first(), 10)
            await until(lambda: ns.port.ongoing == 1)
            ns.stream.close()  # the client left
            await until(lambda: ns.port.ongoing == 0)
            ns.answer.set()
            await asyncio.wait_for(ns.prefill.task, 10)
            await asyncio.sleep(0.05)
            mail = [len(c.mail) for c in ns.port._connections]
            return head, mail, ns
        finally:
            await _closed(ns)

    head, mail, ns = asyncio.run(main())
    assert head.new_token_ids == [40] and mail == [0]
    assert ns.box.posts == [] and ns.box.takes == [] and ns.box.discards == ["e-0"]


def test_a_prefill_failing_after_its_token_fails_the_choice_and_its_direct_decode_call():
    """The decode call waits for a result that will not come: the choice fails with the
    prefill's error and the decode call is cancelled on its replica."""

    async def main():
        error = ConnectionError("the prefill replica died")
        ns = await _disaggregated(_result(False), error=error, held=True)
        try:
            head = await asyncio.wait_for(ns.stream.first(), 10)
            await until(lambda: ns.port.ongoing == 1)
            ns.answer.set()
            failed = None
            try:
                await ns.stream.collect(timeout_s=10)
            except ConnectionError as e:
                failed = e
            await until(lambda: ns.port.ongoing == 0)
            return head, failed
        finally:
            await _closed(ns)

    head, failed = asyncio.run(main())
    assert head.new_token_ids == [40] and "died" in str(failed)


def test_a_token_that_ends_the_choice_does_not_cancel_the_prefill_call():
    """A stop token ends the choice before the prefill has answered (its KV export and
    publish still running): the prefill call runs on, so its publish and its placement
    record are not cut short. Seen failing (the prefill call cancelled) with `hand_over`
    awaiting the prefill's result unshielded."""
    stop = delta([2], "", finished=True, reason="stop")

    async def main():
        ns = await _disaggregated(_result(False, first=stop), held=True)
        try:
            got = (await ns.stream.collect(timeout_s=10))[0]
            await asyncio.sleep(0.05)
            cancelled = ns.prefill.task.cancelled()
            ns.answer.set()
            await asyncio.wait_for(ns.prefill.task, 10)
            return got, cancelled, ns
        finally:
            await _closed(ns)

    got, cancelled, ns = asyncio.run(main())
    assert _tokens(got) == [2] and got[-1].finish_reason == "stop"
    assert not cancelled and ns.box.posts == []
