"""bench/nothing_lost.py's judgement: what counts as a lost request and as a settled server.
(The benchmark itself needs a served app and minutes; these are its rules, on made-up data.)"""

from __future__ import annotations

import pytest

from bench.nothing_lost import LENGTHS, Outcome, Run, check, deployments, settled, workload_prompts

COLOCATED, DISAGGREGATED = deployments("colocated"), deployments("disaggregated")


def replica(running=0, waiting=0, free=100, total=100) -> dict:
    return {
        "num_running": running,
        "num_waiting": waiting,
        "kv_blocks_free": free,
        "kv_blocks_total": total,
    }


def test_a_run_counts_matches_mismatches_and_errors_apart():
    offline = [Outcome("a b", "length"), Outcome("c", "length"), Outcome("d", "length")]
    served = [Outcome("a b", "length"), Outcome("c", "stop"), Outcome(error="HTTP 503")]
    run = Run("colocated", "128", 3)
    check(run, served, offline)
    assert run.matched == 1
    assert [m["request"] for m in run.mismatched] == [1]  # same text, another finish reason
    assert run.errors == {"HTTP 503": 1}
    run.settled_s = 2.0
    assert not run.ok


def test_a_run_is_ok_only_when_everything_matched_and_the_server_settled():
    run = Run("colocated", "128", 1)
    check(run, [Outcome("x", "length")], [Outcome("x", "length")])
    assert not run.ok  # never seen settled
    run.settled_s = 2.0
    assert run.ok


@pytest.mark.parametrize(
    "names, stats",
    [
        (COLOCATED, {"EngineServer": [replica(running=1, free=90)]}),
        (COLOCATED, {"EngineServer": [replica(waiting=1)]}),  # queued, never run
        (COLOCATED, {"EngineServer": [replica(free=99)]}),  # a leaked block
        (DISAGGREGATED, {"PrefillServer": [replica()], "DecodeServer": [replica(free=50)]}),
        (
            DISAGGREGATED,
            {"PrefillServer": [replica()], "DecodeServer": [replica()], "box": {"held": 1}},
        ),
        (DISAGGREGATED, {"PrefillServer": [replica()], "box": {"held": 0}}),  # decode not read
        (COLOCATED, {"error": "the read timed out"}),
        (COLOCATED, {}),  # nothing read: nothing is known
    ],
)
def test_a_server_is_not_settled_while_anything_is_held_or_unread(names, stats):
    assert not settled(stats, names)


def test_a_server_is_settled_when_every_replica_and_the_box_are_free():
    assert settled({"EngineServer": [replica(), replica(free=7, total=7)]}, COLOCATED)
    both = {"PrefillServer": [replica()], "DecodeServer": [replica()], "box": {"held": 0}}
    assert settled(both, DISAGGREGATED)


def test_workloads_have_their_lengths_and_fresh_prompts():
    mixed = workload_prompts("mixed", 6, seed=1)
    assert [len(p) for p in mixed] == [128, 512, 1000] * 2
    assert len({tuple(p) for p in mixed}) == 6
    assert all(len(p) == 512 for p in workload_prompts("512", 4, seed=2))
    assert set(LENGTHS) == {"128", "512", "1000", "mixed"}
