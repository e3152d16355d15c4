"""The prefill's result handed to a direct decode call by the ingress, without Ray: a value
`Deliver`ed to a running call on a real CallPort (loopback), and the driver delivering an
in-band result (or word that it is in the hand-off box) to the real DecodeServer behind
that port, with no box call for the in-band one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from app.engine.sampling_params import SamplingParams
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
from serve.test_call_channel import APP, DEPLOYMENT, registered_router, replica_at, started_port
from serve.test_delta_channel import StepEngine
from serve.test_delta_replicas import _Box, _server
from serve.test_driver import DESCRIBE, _Method, delta


class _MailReader:
    """A replica whose direct `generate_to` returns what was delivered to it."""

    def __init__(self):
        self.slots = Slots(4)

    async def run_generate_to(self, tag: str) -> tuple[str, object]:
        return tag, await call_mail()


def test_a_value_delivered_to_a_running_call_reaches_its_mail_and_only_its_own():
    """Two calls on one connection: each gets the value sent for it. A value for a call
    that has ended is not sent (and the port keeps no mail for it). Seen failing (the
    calls never returned) with the port ignoring `Deliver`."""

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


def test_a_task_that_runs_no_direct_call_has_no_mail():
    """What a Serve call sees: nothing can be delivered to it, so it takes from the box."""
    assert call_mail() is None


class _Prefill:
    """`prefill_to.remote(...)` placed through Serve (no direct caller for it): answers
    ``result`` at once; ``box``: where a posted result goes (the decode replica's box)."""

    def __init__(self, result: PrefillResult, box: _Box):
        self.result, self.box = result, box

    def remote(self, gen, reply_to, hand_off):
        async def answer():
            if self.result.posted:  # its KV has refs: the prefill replica posts it
                await self.box.post(hand_off.key, self.result)
            return self.result

        return answer()


class _IngressBox:
    """The ingress's client of the hand-off box: what it posts and discards."""

    def __init__(self):
        self.posted: list[str] = []
        self.discarded: list[str] = []

    async def post(self, key: str, value: object) -> None:
        self.posted.append(key)

    def discard(self, key: str) -> None:
        self.discarded.append(key)


def _result(posted: bool) -> PrefillResult:
    chunks = [] if posted else [SimpleNamespace(key=b"p", ref=np.zeros(8, np.uint8))]
    return PrefillResult("e-0", delta([40], "He", finished=True), chunks, "p", posted=posted)


@pytest.mark.parametrize("posted", [False, True], ids=["in-band", "in-the-box"])
def test_the_ingress_hands_the_prefill_result_to_its_direct_decode_call(posted):
    """In-band: the ingress delivers the result itself, and nobody posts to or takes from
    the box; in the box (its KV has refs): the ingress says so, and the decode replica
    takes it there. Seen failing (collect timed out, the decode call waiting for its mail)
    with `_hand_over` not delivering."""

    async def main():
        inbox = await DeltaInbox.start()
        box, ingress_box = _Box(), _IngressBox()
        taken: list[str] = []
        take = box.take

        async def counted_take(key: str):
            taken.append(key)
            return await take(key)

        box.take = counted_take
        server = _server(DecodeServer, StepEngine(), box)
        port = await started_port(server)
        registered_router([replica_at(port)])
        prefill = SimpleNamespace(
            prefill_to=_Prefill(_result(posted), box), describe=_Method([], "p", DESCRIBE)
        )
        decode = SimpleNamespace(describe=_Method([], "d", DESCRIBE))
        driver = RequestDriver(
            ReplicaMetrics("ingress", "test-handoff"), prefill=prefill, decode=decode,
            inbox=inbox, direct={"decode": DirectCaller(APP, DEPLOYMENT)}, hand_offs=ingress_box,
        )  # fmt: skip
        req = NormalizedRequest("r", "e", "text_completion", [5, 6], SamplingParams(max_tokens=4))
        stream = await driver.start(req)
        try:
            got = (await stream.collect(timeout_s=10))[0]
        finally:
            await port.stop()
            await inbox.stop()
        return got, ingress_box, taken, port.calls

    got, ingress_box, taken, direct_calls = asyncio.run(main())
    assert [t for d in got for t in d.new_token_ids] == [40, 1, 2, 3], got
    assert got[-1].finish_reason == "length" and direct_calls == 1
    assert ingress_box.posted == [] and ingress_box.discarded == []
    assert taken == (["e-0"] if posted else [])
