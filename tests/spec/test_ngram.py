"""N-gram proposer and its acceptance backoff."""

import pytest

from app.engine.spec.ngram import AcceptanceBackoff, NgramProposer


def test_longest_recent_match_is_continued():
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    #            a  b  c  d  x  b  c  e  a  b  c
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    # 3-gram (1, 2, 3) occurs at 0 -> continuation 4, 9, 2; the more recent 2-gram (2, 3)
    # at 5 would say 5 but a longer match wins.
    assert p.propose(tokens, 3) == [4, 9, 2]
    assert p.propose([7, 2, 3, 5, 8, 2, 3], 2) == [5, 8]  # 2-gram, most recent occurrence
    assert p.propose([7, 2, 3, 5, 2, 3, 6, 2, 3], 1) == [6]


def test_no_match_or_short_input_proposes_nothing():
    p = NgramProposer(2, 4)
    assert p.propose([1, 2, 3, 4, 5], 4) == []
    assert p.propose([1, 1], 4) == []
    assert p.propose([1, 2, 1, 2], 0) == []


def test_continuation_may_run_into_the_suffix():
    # a periodic sequence proposes its own period repeatedly
    assert NgramProposer(2, 2).propose([5, 6, 5, 6], 5) == [5, 6]
    assert NgramProposer(1, 1).propose([4, 4, 4], 3) == [4]


def test_bad_config():
    with pytest.raises(ValueError):
        NgramProposer(3, 2)
    with pytest.raises(ValueError):
        NgramProposer(0, 2)


def test_backoff_stops_and_probes():
    b = AcceptanceBackoff(k=4, probe_every=4)
    assert b.num_to_propose() == 4
    for _ in range(8):
        b.update(proposed=4, accepted=0)
    ks = [b.num_to_propose() for _ in range(8)]
    assert ks.count(0) == 6 and ks.count(1) == 2  # off, probing every 4th step
    for _ in range(6):
        b.update(proposed=1, accepted=1)
    assert b.num_to_propose() == 4  # accepted again: back to full length
