"""Speculation counters reach Prometheus (app/serve/metrics.py, Ray's metric objects faked)
and the serve args carry the speculative block (validated like the LLM's)."""

import pytest
from pydantic import ValidationError

from app.serve.config import EngineArgs
from app.serve.metrics import SPECS, ReplicaMetrics
from tests.ops.test_metrics import STATS, recorded, values  # noqa: F401 - the fixture

SPEC = {"spec_verify_steps": 4, "spec_proposed_tokens": 12, "spec_accepted_tokens": 7}


def test_spec_counters_become_increments(recorded):  # noqa: F811
    m = ReplicaMetrics("decode", "m")
    m.on_step({**STATS, **SPEC})
    m.on_step({**STATS, **{k: v * 2 for k, v in SPEC.items()}})
    get = lambda name: values(recorded, f"slimserve:spec_decode_{name}", role="decode")  # noqa: E731
    assert get("num_drafts") == [4, 4]
    assert get("num_draft_tokens") == [12, 12]
    assert get("num_accepted_tokens") == [7, 7]


def test_engines_without_speculation_report_nothing(recorded):  # noqa: F811
    ReplicaMetrics("decode", "m").on_step(STATS)
    assert values(recorded, "slimserve:spec_decode_num_drafts", role="decode") == []
    assert {n for n in SPECS if "spec_decode" in n} == {
        "slimserve:spec_decode_num_drafts",
        "slimserve:spec_decode_num_draft_tokens",
        "slimserve:spec_decode_num_accepted_tokens",
    }


def test_engine_args_speculative_block_is_validated():
    args = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert args.speculative_config["num_speculative_tokens"] == 2
    for bad in ({"method": "eagle"}, {"bogus": 1}, {"num_speculative_tokens": 0}):
        with pytest.raises(ValidationError):
            EngineArgs(speculative_config=bad)
