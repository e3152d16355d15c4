"""RequestDriver without Ray, disaggregated: the prefill's Serve stream (its token, then its
result), the decode stream placed at the token, the result handed over through the store's
hand-off box (faked), and what the ingress posts to and discards from that box."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve.exceptions import BackPressureError

from app.engine.sampling_params import SamplingParams
from app.serve.api.normalize import NormalizedRequest
from app.serve.driver import RequestDriver
from app.serve.messages import HandOff, HandOffStarted, PrefillResult
from app.serve.metrics import ReplicaMetrics
from serve.test_driver import DESCRIBE, _Method, delta


class _Box:
    """The hand-off box and its client (`HandOffs`): key -> a future of the posted value."""

    def __init__(self):
        self.values: dict[str, asyncio.Future] = {}
        self.posted, self.discarded = [], []

    def slot(self, key: str) -> asyncio.Future:
        return self.values.setdefault(key, asyncio.get_running_loop().create_future())

    async def post(self, key: str, value) -> None:
        self.posted.append(key)
        self.slot(key).set_result(value)

    def discard(self, key: str) -> None:
        self.discarded.append(key)


class _Call:
    """A streaming Serve call: async iteration over ``run()``'s items, `cancel()`, and
    Serve's assignment hook (raises ``refuse``, as a full deployment's queue does)."""

    def __init__(self, calls: list[str], name: str, run, refuse: Exception | None = None):
        self.calls, self.name, self.refuse = calls, name, refuse
        self.cancelled = False
        self._items = run()

    async def _fetch_future_result_async(self):
        if self.refuse is not None:
            raise self.refuse

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.refuse is not None:
            raise self.refuse
        return await anext(self._items)

    def cancel(self) -> None:
        self.cancelled = True
        self.calls.append(f"{self.name}.cancelled")


class _Setup:
    """A prefill stream that gives its token, then waits for `release` (or `fail`) before its
    result (posted to the box first unless ``in_band``, as PrefillServer does), and a decode
    stream that takes the result from the box and gives ``rest``."""

    def __init__(
        self, first, rest, in_band=False, refuse_prefill=None, refuse_decode=None, started=False
    ):
        self.calls: list[str] = []
        # an overlapped hand-off: `HandOffStarted` first, the token once `token_gate` is set
        self.started = started
        self.token_gate: asyncio.Future | None = None
        self.box = _Box()
        self.first, self.rest, self.in_band = first, rest, in_band
        self.released: asyncio.Future | None = None
        self.refusals = refuse_prefill, refuse_decode
        self.prefill = SimpleNamespace(
            describe=_Method(self.calls, "p", DESCRIBE), prefill=SimpleNamespace(remote=self._p)
        )
        self.decode = SimpleNamespace(
            describe=_Method(self.calls, "d", DESCRIBE), generate=SimpleNamespace(remote=self._d)
        )
        for h in (self.prefill, self.decode):
            h.options = lambda h=h, **_: h

    def _p(self, gen):
        self.calls.append("prefill")
        self.released = asyncio.get_running_loop().create_future()
        self.token_gate = asyncio.get_running_loop().create_future()

        async def run():
            if self.started:
                yield HandOffStarted(gen.request_id)
                await self.token_gate
            yield self.first
            await self.released  # raises what `fail` set
            result = PrefillResult(gen.request_id, self.first, [], "p-0", posted=not self.in_band)
            if result.posted:
                await self.box.post(HandOff(gen.request_id).key, result)
            yield result

        self.prefill_call = _Call(self.calls, "prefill", run, self.refusals[0])
        return self.prefill_call

    def _d(self, message):
        self.calls.append("decode")
        self.message = message

        async def run():
            await self.box.slot(message.prefill.key)
            self.calls.append("decode.took")
            for d in self.rest:
                yield d

        self.decode_call = _Call(self.calls, "decode", run, self.refusals[1])
        return self.decode_call

    def driver(self) -> RequestDriver:
        return RequestDriver(
            ReplicaMetrics("ingress", "test-driver"), prefill=self.prefill, decode=self.decode,
            hand_offs=self.box,
        )  # fmt: skip


def _request(max_tokens: int = 4) -> NormalizedRequest:
    return NormalizedRequest(
        "r", "e", "text_completion", [5, 6, 7], SamplingParams(max_tokens=max_tokens)
    )


FULL = BackPressureError(num_queued_requests=1, max_queued_requests=1)
FIRST = delta([40], "He", finished=True)  # prefill_only: finished, no reason
REST = [delta([41], "l"), delta([42, 2], "lo", finished=True, reason="stop")]


def _run(setup: _Setup, release: bool = True):
    async def go():
        stream = await setup.driver().start(_request())
        if release:
            asyncio.get_running_loop().call_later(0.02, lambda: setup.released.set_result(None))
        return (await stream.collect(timeout_s=10))[0]

    return asyncio.run(go())


def test_the_token_goes_out_before_the_prefill_result_and_the_decode_takes_it_from_the_box():
    """The decode call is placed at the token and takes the result the prefill replica
    posted; the choice's text is whole and nothing is discarded. Seen failing with the
    decode call placed only after the result (the token waited for the release)."""
    setup = _Setup(FIRST, REST)

    async def go():
        stream = await setup.driver().start(_request())
        head = await asyncio.wait_for(stream.first(), timeout=5)  # result not released yet
        assert setup.calls[-2:] == ["prefill", "decode"] and not setup.released.done()
        setup.released.set_result(None)
        return head, (await stream.collect(timeout_s=10))[0]

    head, rest = asyncio.run(go())
    assert "".join(d.text_delta for d in [head, *rest]) == "Hello"
    assert setup.box.posted == ["e-0"] and setup.box.discarded == []
    assert isinstance(setup.message.prefill, HandOff) and setup.message.routing.hint is None


def test_an_in_band_result_is_posted_by_the_ingress():
    """A result whose KV is in-band comes back whole (the prefill replica posts nothing): the
    ingress posts it for the decode call. Seen failing without the ingress's post (the
    decode call waited for the box until the test's timeout)."""
    setup = _Setup(FIRST, REST, in_band=True)
    got = _run(setup)
    assert "".join(d.text_delta for d in got) == "Hello"
    assert setup.box.posted == ["e-0"] and setup.box.discarded == []


def test_an_overloaded_decode_deployment_refuses_before_any_byte():
    """429 stays before the first byte: the token is not given out until the decode call
    has a replica; refused, the prefill stream is cancelled and its key discarded (the
    replica may post). Seen failing with the token given out before the assignment."""
    setup = _Setup(FIRST, REST, refuse_decode=FULL)

    async def go():
        stream = await setup.driver().start(_request())
        await stream.first()

    with pytest.raises(BackPressureError):
        asyncio.run(go())
    assert "prefill.cancelled" in setup.calls and setup.box.discarded == ["e-0"]


def test_a_refused_prefill_leaves_nothing_to_discard():
    """A prefill refused by Serve's queue never runs nor posts: no decode call, no discard
    (under an overload storm each would leave a tombstone in the box). Seen failing with the
    discard made for every unsettled choice."""
    setup = _Setup(FIRST, REST, refuse_prefill=FULL)
    with pytest.raises(BackPressureError):
        _run(setup, release=False)
    assert "decode" not in setup.calls and setup.box.discarded == []


def test_a_token_that_ends_the_choice_places_no_decode_call():
    """max_tokens reached or a stop token at the prefill: the choice ends with the token, no
    decode call, nothing in the box to discard. Seen failing with the decode call placed
    regardless (the fake decode waited for a result never posted)."""
    setup = _Setup(delta([2], "", finished=True, reason="stop"), REST)
    got = _run(setup, release=False)
    assert got[-1].finish_reason == "stop" and "decode" not in setup.calls
    assert setup.box.discarded == []


def test_a_prefill_that_fails_after_its_token_fails_the_choice_and_cancels_the_decode():
    """The token went out; the prefill then fails before its result: the decode call would
    wait for the box in vain, so the choice fails, the decode call is cancelled and the key
    discarded. Seen failing with the result's failure ignored (the stream hung)."""
    setup = _Setup(FIRST, REST)

    async def go():
        stream = await setup.driver().start(_request())
        await stream.first()
        setup.released.set_exception(RuntimeError("prefill replica died"))
        return await stream.collect(timeout_s=5)

    with pytest.raises(RuntimeError, match="prefill replica died"):
        asyncio.run(go())
    assert "decode.cancelled" in setup.calls and setup.box.discarded == ["e-0"]


def test_a_client_leaving_mid_stream_cancels_both_calls_and_discards_the_key():
    """Seen failing without the discard in the driver's finally."""
    setup = _Setup(FIRST, REST)

    async def go():
        stream = await setup.driver().start(_request())
        await stream.first()
        stream.close()  # what the ingress does when its client leaves
        await asyncio.sleep(0.05)

    asyncio.run(go())
    assert "prefill.cancelled" in setup.calls and "decode.cancelled" in setup.calls
    assert setup.box.discarded == ["e-0"]


def test_a_started_hand_off_places_the_decode_call_before_the_token():
    """An overlapped hand-off: the prefill stream says its first part is in the box
    (`HandOffStarted`) before the token; the decode call is placed then, so its replica
    imports the parts while the prompt is computed. Seen failing (no decode call until the
    token) with the marker skipped."""
    setup = _Setup(FIRST, REST, started=True)

    async def go():
        stream = await setup.driver().start(_request())
        head = asyncio.ensure_future(stream.first())
        for _ in range(100):
            if "decode" in setup.calls:
                break
            await asyncio.sleep(0.01)
        placed_before_token = "decode" in setup.calls and not head.done()
        setup.token_gate.set_result(None)
        setup.released.set_result(None)
        return placed_before_token, await head, (await stream.collect(timeout_s=10))[0]

    placed_before_token, head, rest = asyncio.run(go())
    assert placed_before_token
    assert "".join(d.text_delta for d in [head, *rest]) == "Hello"
    assert setup.box.posted == ["e-0"] and setup.box.discarded == []


def test_a_started_hand_off_whose_token_ends_the_choice_cancels_the_decode_call():
    """The token ends the choice after the decode call was placed: the call is cancelled and
    the key discarded (the parts posted must not wait in the box). Seen failing (no discard)
    with `settled` set as when no decode call was placed."""
    setup = _Setup(delta([2], "", finished=True, reason="stop"), REST, started=True)

    async def go():
        stream = await setup.driver().start(_request())
        asyncio.get_running_loop().call_later(0.02, lambda: setup.token_gate.set_result(None))
        return (await stream.collect(timeout_s=10))[0]

    got = asyncio.run(go())
    assert got[-1].finish_reason == "stop"
    assert "decode.cancelled" in setup.calls and setup.box.discarded == ["e-0"]
