"""The ingress's load view and the driver's use of it: the placement policy fed by the
replicas' reports (no Ray: reports are given to `LoadView.update` directly)."""

from __future__ import annotations

import pytest

from app.engine.sampling_params import SamplingParams
from app.serve import metrics
from app.serve.driver import RequestDriver
from app.serve.messages import GenerateRequest, RoutingInfo
from app.serve.metrics import ReplicaMetrics
from app.serve.routing.compute import Compute
from app.serve.routing.load_view import LoadView
from app.serve.routing.prefill_placement import (
    PLACEMENTS,
    SHARES_COMPUTE,
    TTFT_ESTIMATE,
    PlacementConfig,
)
from serve.test_driver import FakeBox, FakeHandle


def report(queued: int, free: int = 100_000, running: int = 0, compute=None, **rates) -> dict:
    return {"queued_prefill_tokens": queued, "free_kv_tokens": free, "num_running": running,
            "compute": compute.report() if compute else None, **rates}  # fmt: skip


def test_placed_tokens_count_until_the_next_report():
    """A burst decided between two reports must not all go one way: each placement adds its
    tokens to that side's queue until the replicas report again (which includes them).
    Seen failing with `placed` a no-op (both later loads equal the report's)."""
    view = LoadView(None, None, period_s=1.0)
    assert not view.known
    view.update([report(100), report(50)], [report(0, free=4096)])
    assert view.prefill_load().queued_tokens == 50 and view.prefill_load().num_replicas == 2
    view.placed("remote", 600)
    view.placed("local", 300)
    assert view.prefill_load().queued_tokens == 650
    assert view.decode_load().queued_prefill_tokens == 300
    assert view.decode_load().headroom_tokens == 4096 - 300
    view.update([report(700)], [report(300, free=4096)])
    assert view.prefill_load().queued_tokens == 700


def test_shared_compute_is_judged_between_the_chosen_replicas():
    """The prefill side shares compute when its least-loaded replica runs on the decode
    replica the choice would go to. Seen failing with the first prefill replica compared."""
    here, there = Compute("a", (), (0, 1), 2), Compute("b", (), (0, 1), 2)
    view = LoadView(None, None, period_s=1.0)
    view.update([report(900, compute=there), report(0, compute=here)], [report(0, compute=here)])
    assert view.prefill_load().shares_compute
    view.update([report(0, compute=there), report(900, compute=here)], [report(0, compute=here)])
    assert not view.prefill_load().shares_compute
    view.update([report(0)], [report(0, compute=here)])  # not reported: not shared
    assert not view.prefill_load().shares_compute


def test_the_shared_compute_gauge_is_set_with_every_report():
    """Set at each report, not only at a placement: Ray drops a gauge not set for two
    export intervals, so one set per decision vanished while no long prompt came (seen:
    tests/ops/test_metrics_ray.py missing it). Seen failing (nothing set) with the gauge
    set only by the driver's decisions."""
    here = Compute("a", (), (0, 1), 2)

    class Gauges:
        def __init__(self):
            self.values = []

        def set(self, name, value, **tags):
            self.values.append((name, value))

    gauges = Gauges()
    view = LoadView(None, None, period_s=1.0, metrics=gauges)
    view.update([report(0)], [])  # no decode replica reported: nothing known
    view.update([report(0, compute=here)], [report(0, compute=here)])
    view.update([report(0)], [report(0, compute=here)])
    assert gauges.values == [(SHARES_COMPUTE, 1), (SHARES_COMPUTE, 0)]


def test_the_chosen_replicas_measured_rates_reach_the_policy():
    """The least-loaded prefill replica's measured rate, and the chosen decode replica's
    step time and rate; not measured (None, 0, absent from an older replica's report) is
    None. Seen failing with the rates left out of the loads (the policy's fallback)."""
    view = LoadView(None, None, period_s=1.0)
    prefill = [report(900, prefill_rate=500.0), report(0, prefill_rate=2500.0)]
    decode = [report(0, free=100, prefill_rate=9.0, decode_step_s=9.0),
              report(0, free=4096, prefill_rate=1800.0, decode_step_s=0.02)]  # fmt: skip
    view.update(prefill, decode)
    assert view.prefill_load().rate == 2500.0
    assert view.decode_load().prefill_rate == 1800.0
    assert view.decode_load().step_time_s == 0.02
    view.update([report(0, prefill_rate=None)], [report(0, prefill_rate=0, decode_step_s=0.0)])
    assert view.prefill_load().rate is None and view.decode_load().prefill_rate is None
    assert view.decode_load().step_time_s is None
    view.update([report(0)], [report(0)])
    assert view.prefill_load().rate is None and view.decode_load().step_time_s is None


class Broadcasting:
    """A deployment handle's `broadcast`: `placement_load` answers each replica's report
    in turn; other methods are recorded with their arguments, and fail while ``failing``."""

    def __init__(self, reports: list[list[dict] | Exception]):
        self.reports, self.told, self.failing = reports, [], 0

    def broadcast(self, method: str, *args):
        if method == "placement_load":
            answer = self.reports.pop(0) if len(self.reports) > 1 else self.reports[0]
        elif self.failing:
            self.failing -= 1
            answer = RuntimeError("no such method")
        else:
            self.told.append((method, *args))
            answer = [None]

        class Response:
            async def results_async(self):
                if isinstance(answer, Exception):
                    raise answer
                return answer

        return Response()


def polled(decode_reports: list, failing: int = 0) -> Broadcasting:
    """Runs a LoadView's poll loop over the decode reports (an exception: that poll
    fails), then some more polls of the last; -> the prefill deployment's handle, with
    what it was told."""
    import asyncio

    prefill = Broadcasting([[report(0), report(0)]])
    prefill.failing = failing
    decode = Broadcasting(decode_reports)
    view = LoadView(prefill, decode, period_s=0.0)

    async def polls():
        view.start()
        while decode.reports[0] is not decode_reports[-1]:
            await asyncio.sleep(0)
        for _ in range(20):
            await asyncio.sleep(0)
        await view.stop()

    asyncio.run(polls())
    return prefill


def test_the_demand_decode_replicas_took_is_told_to_every_prefill_replica():
    """Every poll, the prefill replicas are told the decode replicas' spilled tokens, the
    whole total to each (the policy takes the largest report), and once more when it falls
    to 0; nothing while there is none, nor from a replica that does not report it. Seen
    failing (nothing told) with `_tell_spilled` not called."""
    prefill = polled([
        [report(0, spilled_prefill_tokens=0)],
        [report(600, spilled_prefill_tokens=600), report(400, spilled_prefill_tokens=400)],
        [report(0, spilled_prefill_tokens=0)],
        [report(0)],  # a replica of a version that does not report it
    ])  # fmt: skip
    assert prefill.told == [("tell_spilled_demand", 1000), ("tell_spilled_demand", 0)]


def test_a_stale_total_is_not_told_again_while_the_polls_fail():
    """A decode replica that died holding spilled requests must not keep the prefill
    replicas' value alive: after a failed poll nothing is told (their TTL then drops it).
    Seen failing (700 told on every poll) with the tell outside the poll's success."""
    gone = RuntimeError("the decode replica is restarting")
    prefill = polled([[report(700, spilled_prefill_tokens=700)], gone])
    assert prefill.told == [("tell_spilled_demand", 700)]


def test_a_failed_tell_is_logged_once_and_tried_again(caplog):
    """A tell that fails (e.g. replicas of a version without the method, mid-update) is
    tried again next poll, warned about once, and does not stop the view's polls. Seen
    failing (a warning per failure) with the warning not held back while failing."""
    import logging

    with caplog.at_level(logging.DEBUG, logger="app.serve.routing.load_view"):
        prefill = polled([[report(0, spilled_prefill_tokens=300)]] * 2, failing=3)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "spilled demand" in warnings[0].getMessage()
    assert prefill.told and set(prefill.told) == {("tell_spilled_demand", 300)}


def _driver(prefill_queue: int, decode_free: int = 100_000) -> RequestDriver:
    calls: list[str] = []
    view = LoadView(None, None, period_s=1.0)
    view.update([report(prefill_queue)], [report(0, free=decode_free)])
    return RequestDriver(
        ReplicaMetrics("ingress", "test-placement"),
        prefill=FakeHandle(calls, "prefill"), decode=FakeHandle(calls, "decode"),
        hand_offs=FakeBox(), local_prefill_tokens=255, load_view=view,
        placement_config=PlacementConfig(short_prompt_tokens=255),
    )  # fmt: skip


def _gen(n: int, hint: int | None = None) -> GenerateRequest:
    return GenerateRequest("r-0", list(range(4, 4 + n)), SamplingParams(), None,
                           RoutingInfo(n, hint=hint))  # fmt: skip


def test_a_long_prompt_prefills_locally_while_the_prefill_replica_is_saturated():
    """The issue's case: 600-token prompts queued behind one prefill replica while the decode
    replica idles go local; with the prefill replica idle they go remote; a short prompt
    goes local, a routing hint or a decode replica that cannot hold the prompt remote.
    Seen failing (always remote for 600) with the driver's length rule alone."""
    assert _driver(prefill_queue=20_000)._local_prefill(_gen(600))
    assert not _driver(prefill_queue=0)._local_prefill(_gen(600))
    assert _driver(prefill_queue=0)._local_prefill(_gen(100))
    assert not _driver(prefill_queue=20_000)._local_prefill(_gen(600, hint=0))
    assert not _driver(prefill_queue=20_000, decode_free=512)._local_prefill(_gen(600))


def test_a_limit_of_zero_sends_every_prompt_to_a_prefill_replica():
    driver = _driver(prefill_queue=20_000)
    driver.local_prefill_tokens = 0
    assert not driver._local_prefill(_gen(100)) and not driver._local_prefill(_gen(600))


def test_without_a_report_the_prompt_length_decides():
    driver = _driver(prefill_queue=20_000)
    driver.load_view = LoadView(None, None, period_s=1.0)  # nothing reported yet
    assert driver._local_prefill(_gen(255)) and not driver._local_prefill(_gen(256))


def test_each_placement_records_its_ttft_estimate(monkeypatch):
    """The estimate for the side chosen, tagged with it, beside the placement count: what an
    operator compares with the TTFT measured. Seen failing with the observe call removed."""
    seen: list[tuple[str, float, dict]] = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def inc(self, value, tags):
            seen.append((self.name, value, tags))

        set = observe = inc

    monkeypatch.setattr(metrics, "_metric", Recorder)
    driver = _driver(prefill_queue=20_000)  # fallback 4,096 tokens/s on both sides
    assert driver._local_prefill(_gen(600))
    estimates = [(v, t["where"]) for n, v, t in seen if n == TTFT_ESTIMATE]
    assert estimates == [(pytest.approx(600 / 4096), "local")]
    assert any(n == PLACEMENTS and t["where"] == "local" for n, _, t in seen)
