"""RequestDriver without Ray, disaggregated over the delta channel: the decode call placed
while the prefill runs, the prefill's token sent ahead, its result handed to the decode
call through the hand-off box (faked; the calls here go through Serve: the delivery to a
direct call is in test_call_handoff.py), and what the ingress posts to and discards from
that box."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from types import SimpleNamespace

from app.engine.request import OverloadedError, RequestDelta
from app.engine.sampling_params import SamplingParams
from app.serve.delta_inbox import DeltaInbox
from app.serve.delta_outbox import DeltaOutbox
from app.serve.delta_wire import head_id
from app.serve.driver import RequestDriver
from app.serve.messages import PrefillResult
from app.serve.metrics import ReplicaMetrics
from app.serve.normalize import NormalizedRequest
from serve.test_driver import DESCRIBE, _Method, delta


class _BoxClient:
    """The ingress's client of the hand-off box (`HandOffs`): posts into the fake ``box``
    (key -> a future of the posted value), records what it discards."""

    def __init__(self, box: dict[str, asyncio.Future]):
        self.box, self.discarded, self.posted = box, [], []

    async def post(self, key: str, value) -> None:
        self.posted.append(key)
        self.box[key].set_result(value)

    def discard(self, key: str) -> None:
        self.discarded.append(key)


class _PrefillCall:
    """A unary call to a prefill replica (`prefill_to`): awaitable (its result, once
    `release`d, which also posts the result to the hand-off ``box`` under its key when it
    is not in-band, as PrefillServer does) and `cancel()`."""

    def __init__(self, calls: list[str], result: PrefillResult, posted: asyncio.Future):
        self.calls, self.result, self.posted = calls, result, posted
        self.ref: asyncio.Future = asyncio.get_running_loop().create_future()
        self.cancelled = False

    def release(self) -> None:
        self.calls.append("prefill.done")
        if self.result.posted:
            self.posted.set_result(self.result)
        self.ref.set_result(self.result)

    def fail(self, error: Exception) -> None:
        self.calls.append("prefill.failed")
        self.ref.set_exception(error)  # unless posted before: the decode call would wait

    def post(self) -> None:
        self.posted.set_result(self.result)  # the answer to the ingress still to come

    def __await__(self):
        return asyncio.shield(self.ref).__await__()

    def cancel(self) -> None:
        self.cancelled = True


class _DecodeCall:
    """`decode.generate_to.remote(message, reply_to)`: takes the prefill's result from the
    hand-off ``box`` (key in the message), then sends its deltas to the ingress's inbox,
    like DecodeServer."""

    def __init__(self, calls, message, reply_to, deltas, box, refuse=None):
        self.calls, self.refuse, self.message = calls, refuse, message
        self.cancelled = False
        self.gate: asyncio.Event | None = None  # set: the last delta waits for it
        self.task = asyncio.ensure_future(self._run(message, reply_to, deltas, box))

    async def _run(self, message, reply_to, deltas, box):
        if self.refuse is not None:
            raise self.refuse
        first = (await box[message.prefill.key]).first  # placed before the prefill ended
        outbox = DeltaOutbox()
        link = await outbox.link(reply_to)
        for i, d in enumerate(deltas):
            if self.gate is not None and i == len(deltas) - 1:
                await link.drained()
                await self.gate.wait()
            link.send(dataclasses.replace(d, request_id=message.request.request_id))
        await link.drained()
        return first

    async def _fetch_future_result_async(self):
        if self.refuse is not None:
            raise self.refuse  # Serve's BackPressureError: no replica took it

    def __await__(self):
        return self.task.__await__()

    def cancel(self) -> None:
        self.cancelled = True
        self.task.cancel()


async def _send_head(reply_to, first: RequestDelta, request_id: str) -> None:
    """What PrefillServer.prefill_to sends ahead of its result."""
    link = await DeltaOutbox().link(reply_to)
    link.send(dataclasses.replace(first, request_id=head_id(request_id)))
    await link.drained()


def _overlap_driver(calls, first, rest, refuse=None, head=False, release=True, in_band=False):
    """head: the fake prefill sends its token ahead of its result; release: its result
    comes 50 ms after the decode call was placed (else the test releases it); in_band: the
    result comes back whole, not posted (else the prefill posts it: its KV has refs).
    state["box"]: the ingress's client of the box."""
    state = {}
    box: dict[str, asyncio.Future] = {}  # the hand-off box: key -> the posted result
    state["box"] = _BoxClient(box)

    class Prefill:
        def remote(self, gen, reply_to, hand_off):
            calls.append("prefill")
            posted = box[hand_off.key] = asyncio.get_running_loop().create_future()
            result = PrefillResult(gen.request_id, first, [], "p", posted=not in_band)
            state["prefill"] = _PrefillCall(calls, result, posted)
            if head:
                state["head"] = asyncio.ensure_future(_send_head(reply_to, first, gen.request_id))
            return state["prefill"]

    class GenerateTo:
        def remote(self, message, reply_to):
            calls.append("decode.generate_to")
            state["decode"] = _DecodeCall(calls, message, reply_to, rest, box, refuse)
            if release:
                asyncio.get_running_loop().call_later(0.05, state["prefill"].release)
            return state["decode"]

    prefill = SimpleNamespace(prefill_to=Prefill(), describe=_Method(calls, "p", DESCRIBE))
    decode = SimpleNamespace(generate_to=GenerateTo(), describe=_Method(calls, "d", DESCRIBE))
    return prefill, decode, state


def _run_overlapped(first, rest, refuse=None, max_tokens=4, hints=None, in_band=False):
    calls: list[str] = []

    async def go():
        inbox = await DeltaInbox.start()
        prefill, decode, state = _overlap_driver(calls, first, rest, refuse, in_band=in_band)
        state["discarded"] = state["box"].discarded
        driver = RequestDriver(
            ReplicaMetrics("ingress", "test-driver"), prefill=prefill, decode=decode, inbox=inbox,
            hand_offs=state["box"],
        )  # fmt: skip
        params = SamplingParams(max_tokens=max_tokens)
        req = NormalizedRequest("r", "e", "text_completion", [5, 6, 7], params, hints=hints or {})
        try:
            stream = await driver.start(req)
            return (await stream.collect(timeout_s=10))[0], state
        except Exception as e:  # noqa: BLE001 - the test looks at it
            return e, state
        finally:
            await inbox.stop()

    got, state = asyncio.run(go())
    return got, calls, state


def test_the_decode_call_is_placed_while_the_prefill_runs():
    """Disaggregated with the delta channel: the decode call goes out as soon as the prefill
    has a replica (it awaits the prefill's result itself), so the first token does not wait
    for the prefill and then the decode assignment in turn. Seen failing with the driver
    awaiting the prefill before placing the decode call (order prefill.done first)."""
    first = delta([40], "He", finished=True)  # prefill_only: finished, no reason
    rest = [delta([41], "l"), delta([42, 2], "lo", finished=True, reason="stop")]
    got, calls, state = _run_overlapped(first, rest)
    assert calls[-3:] == ["prefill", "decode.generate_to", "prefill.done"]
    assert "".join(d.text_delta for d in got) == "Hello"
    assert got[-1].finish_reason == "stop" and not state["prefill"].cancelled
    assert state["discarded"] == []  # the decode call took the result
    assert state["box"].posted == []  # the prefill posted it


def test_an_in_band_result_for_a_decode_call_placed_through_serve_is_posted_by_the_ingress():
    """A prefill result whose KV is in-band comes back whole instead of being posted (the
    ingress delivers it to a direct decode call); a decode call placed through Serve takes
    from the box, so the ingress posts it there. Seen failing (collect timed out, the decode
    call waiting in the box) without the ingress's post."""
    first = delta([40], "He", finished=True)
    rest = [delta([41], "l"), delta([42, 2], "lo", finished=True, reason="stop")]
    got, calls, state = _run_overlapped(first, rest, in_band=True)
    assert "".join(d.text_delta for d in got) == "Hello", got
    assert state["box"].posted == ["e-0"] and state["discarded"] == []


def test_a_prefill_routing_hint_does_not_follow_the_request_to_the_decode_deployment():
    """A hint forces a replica index of one deployment (tests place requests with it): the
    prefill's hint must not pick the decode replica too. Seen failing with the decode
    message given the request's own routing (hint 1 at the decode call)."""
    first = delta([40], "He", finished=True)
    rest = [delta([41], "l"), delta([42, 2], "lo", finished=True, reason="stop")]
    got, _, state = _run_overlapped(first, rest, hints={"prefill": 1})
    assert "".join(d.text_delta for d in got) == "Hello"
    assert state["decode"].message.request.routing.hint == 1  # what the prefill call had
    assert state["decode"].message.routing.hint is None


def test_an_overloaded_decode_deployment_refuses_before_any_byte_and_cancels_the_prefill():
    """429 stays before the first byte: the prefill's token is not given out until the decode
    call has a replica; a refused decode call fails the request and cancels the prefill."""
    first = delta([40], "He", finished=True)
    refused = OverloadedError("decode queue full")
    got, calls, state = _run_overlapped(first, [], refuse=refused)
    assert isinstance(got, Exception), got
    assert state["prefill"].cancelled
    assert state["discarded"] == ["e-0"]  # a result posted anyway must not stay in the box


def test_a_choice_the_prefill_token_ends_cancels_the_placed_decode_call():
    """The prefill's first token may end the choice (a stop token): the decode call that was
    placed while it ran is cancelled and the choice is that one token."""
    first = delta([2], "", finished=True, reason="stop")
    got, calls, state = _run_overlapped(first, [delta([41], "l", finished=True)])
    assert [d.new_token_ids for d in got] == [[2]] and got[0].finish_reason == "stop"
    assert state["decode"].cancelled
    # The prefill posts its result all the same: the box is told to drop it. Seen failing
    # (nothing discarded) without the driver's discard.
    assert state["discarded"] == ["e-0"]


def test_the_first_token_is_given_out_before_the_prefill_result_arrives():
    """The prefill replica sends its token to the inbox ahead of its result (which waits
    for the KV publish): the ingress gives it out from there, and the rest follows once the
    result reaches the decode call. The tests above (no token sent ahead) cover the
    fallback to the result. Seen failing (first() timed out) with _first_token awaiting
    only the result."""
    first = delta([40], "He", finished=True)
    rest = [delta([41], "l"), delta([42, 2], "lo", finished=True, reason="stop")]
    calls: list[str] = []

    async def go():
        inbox = await DeltaInbox.start()
        prefill, decode, state = _overlap_driver(calls, first, rest, head=True, release=False)
        driver = RequestDriver(
            ReplicaMetrics("ingress", "test-driver"), prefill=prefill, decode=decode, inbox=inbox
        )
        params = SamplingParams(max_tokens=4)
        req = NormalizedRequest("r", "e", "text_completion", [5, 6, 7], params)
        try:
            stream = await driver.start(req)
            head = await asyncio.wait_for(stream.first(), 10)
            result_arrived = state["prefill"].ref.done()
            state["prefill"].release()
            return head, result_arrived, (await stream.collect(timeout_s=10))[0]
        finally:
            await inbox.stop()

    head, result_arrived, later = asyncio.run(go())
    assert head.new_token_ids == [40] and not result_arrived
    assert head.text_delta + "".join(d.text_delta for d in later) == "Hello"
    assert later[-1].finish_reason == "stop"


async def _streaming_past_its_head(calls: list[str]):
    """A choice whose prefill sent its token ahead and holds its result, read up to that
    token: -> (inbox, stream, state, head)."""
    first = delta([40], "He", finished=True)
    rest = [delta([41], "l"), delta([42, 2], "lo", finished=True, reason="stop")]
    inbox = await DeltaInbox.start()
    prefill, decode, state = _overlap_driver(calls, first, rest, head=True, release=False)
    driver = RequestDriver(
        ReplicaMetrics("ingress", "test-driver"), prefill=prefill, decode=decode, inbox=inbox
    )
    req = NormalizedRequest("r", "e", "text_completion", [5, 6, 7], SamplingParams(max_tokens=4))
    stream = await driver.start(req)
    return inbox, stream, state, await asyncio.wait_for(stream.first(), 10)


def test_a_prefill_that_fails_after_its_token_fails_the_choice_and_cancels_the_decode():
    """The token can go out before the prefill's result; if the prefill then fails (its
    replica died before posting the result), the decode call would wait for the hand-off
    in vain: the choice fails and the decode call is cancelled. Seen failing (collect timed
    out, the decode call still waiting) without `inbox_deltas` watching the prefill."""

    async def go():
        inbox, stream, state, head = await _streaming_past_its_head([])
        try:
            state["prefill"].fail(ConnectionError("the prefill replica died"))
            try:
                await stream.collect(timeout_s=5)
            except Exception as e:  # noqa: BLE001 - the test looks at it
                return head, e, state
            return head, None, state
        finally:
            await inbox.stop()

    head, error, state = asyncio.run(go())
    assert head.new_token_ids == [40]
    assert isinstance(error, ConnectionError), error
    assert state["decode"].cancelled


def test_a_prefill_that_fails_after_its_decode_call_took_the_result_does_not_end_the_choice():
    """The prefill replica can die (or its answer be lost) after it posted its result: the
    decode call that took it and streams must finish the choice. Seen failing (the choice
    failed with ConnectionError) with the ingress failing the choice on any prefill error."""

    async def go():
        inbox, stream, state, head = await _streaming_past_its_head([])
        try:
            state["decode"].gate = gate = asyncio.Event()
            state["prefill"].post()
            queue = inbox._queues["e-0"]
            for _ in range(200):  # until the decode call's first delta is in the inbox
                if queue.received:
                    break
                await asyncio.sleep(0.01)
            assert queue.received
            state["prefill"].fail(ConnectionError("the prefill replica died after posting"))
            await asyncio.sleep(0.05)
            gate.set()
            return head, await stream.collect(timeout_s=5)
        finally:
            await inbox.stop()

    head, rest_got = asyncio.run(go())
    text = head.text_delta + "".join(d.text_delta for d in rest_got[0])
    assert text == "Hello" and rest_got[0][-1].finish_reason == "stop"


async def _placing_prefill(placement):
    """A stream whose prefill call's placement is ``placement()`` (what Serve's assignment
    awaits), with the discards recorded: -> (inbox, stream, state, discarded)."""
    inbox = await DeltaInbox.start()
    prefill, decode, state = _overlap_driver([], delta([40], "He", finished=True), [])
    remote = prefill.prefill_to.remote

    def placed_so(*args):
        call = remote(*args)
        call._fetch_future_result_async = placement
        return call

    prefill.prefill_to.remote = placed_so
    driver = RequestDriver(
        ReplicaMetrics("ingress", "test-driver"), prefill=prefill, decode=decode, inbox=inbox,
        hand_offs=state["box"],
    )  # fmt: skip
    req = NormalizedRequest("r", "e", "text_completion", [5, 6, 7], SamplingParams(max_tokens=4))
    return inbox, await driver.start(req), state, state["box"].discarded


def test_a_choice_cancelled_while_its_prefill_is_placed_discards_the_hand_off():
    """Cancelled while the prefill call's placement is awaited, the choice cancels that
    call, which may still have run and posted its result (the soak found one such result
    left in the box under load): the ingress discards the key all the same. Seen failing
    (nothing discarded) with the discard only after the placement."""

    async def go():
        never = asyncio.get_running_loop().create_future()
        inbox, stream, state, discarded = await _placing_prefill(lambda: asyncio.shield(never))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stream.first(), 0.2)  # the client gives up
        await asyncio.sleep(0.05)
        await inbox.stop()
        return discarded, state

    discarded, state = asyncio.run(go())
    assert state["prefill"].cancelled and discarded == ["e-0"]


def test_a_refused_prefill_leaves_nothing_to_discard():
    """A prefill refused by Serve's queue (429) never runs nor posts: no discard for it (an
    overload storm would otherwise fill the box with keys nobody posts). Seen failing
    (discarded ['e-0']) with every unsettled choice discarding."""
    from ray.serve.exceptions import BackPressureError

    async def refused():
        raise BackPressureError(num_queued_requests=4, max_queued_requests=4)

    async def go():
        inbox, stream, _, discarded = await _placing_prefill(refused)
        error = None
        try:
            await stream.first()
        except BackPressureError as e:
            error = e
        await inbox.stop()
        return error, discarded

    error, discarded = asyncio.run(go())
    assert isinstance(error, BackPressureError) and discarded == []
