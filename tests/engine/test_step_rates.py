"""An engine's measured step rates (app/engine/step_rates.py): its decode step time and
prefill rate, the placement policy's measured inputs."""

import pytest

from app import LLM, SamplingParams
from app.engine.step_rates import MIN_PREFILL_SHARE, StepRates


def test_nothing_is_measured_before_its_kind_of_step():
    rates = StepRates()
    assert rates.decode_step_s is None and rates.prefill_tokens_per_s is None
    rates.record(0, 4, 0.01)
    assert rates.decode_step_s == pytest.approx(0.01) and rates.prefill_tokens_per_s is None
    rates.record(0, 0, 1.0)  # an empty step says nothing
    rates.record(0, 4, 0.0)
    assert rates.decode_step_s == pytest.approx(0.01)


def test_decode_step_time_is_a_moving_average():
    """Seen failing with the last sample kept instead (0.03)."""
    rates = StepRates(alpha=0.5)
    for seconds in (0.01, 0.02, 0.03):
        rates.record(0, 8, seconds)
    assert rates.decode_step_s == pytest.approx(0.0225)  # 0.01 -> 0.015 -> 0.0225


def test_prefill_rate_weighs_steps_by_their_tokens():
    """A tail of 8 tokens in 10 ms (800 tokens/s) beside 2,048 in 1 s: a mean of per-step
    rates would read 1,424 tokens/s; the moving sums read about 1,036. Seen failing with
    the per-step rates averaged."""
    rates = StepRates(alpha=0.5)
    rates.record(2048, 0, 1.0)
    rates.record(8, 0, 0.01)
    assert rates.prefill_tokens_per_s == pytest.approx(1028 / 0.505)


def test_a_mixed_step_counts_one_decode_step_less_as_prefill_time():
    """Seen failing with the whole mixed step counted as prefill (1,000 tokens/s)."""
    rates = StepRates()
    rates.record(0, 16, 0.2)
    rates.record(1000, 16, 1.0)
    assert rates.prefill_tokens_per_s == pytest.approx(1000 / 0.8)
    assert rates.decode_step_s == pytest.approx(0.2)  # a mixed step is no decode sample


def test_a_mixed_step_keeps_a_floor_of_prefill_time():
    """A decode average above a mixed step's time (noise) must not make the rate unbounded."""
    rates = StepRates()
    rates.record(0, 16, 0.5)
    rates.record(100, 16, 0.4)
    assert rates.prefill_tokens_per_s == pytest.approx(100 / (0.4 * MIN_PREFILL_SHARE))


def test_bad_alpha_is_refused():
    with pytest.raises(AssertionError):
        StepRates(alpha=0.0)


def test_an_engine_measures_its_own_steps(llama_path):
    """A real engine: one prompt's prefill step and its decode steps give both measures,
    in its stats (0 before). Seen failing with `_time_step` not called."""
    llm = LLM(llama_path, dtype="float32", device="cpu")
    before = llm.stats()
    assert before["prefill_tokens_per_second"] == 0 and before["decode_step_seconds"] == 0
    llm.generate([list(range(3, 200))], SamplingParams(max_tokens=8, temperature=0))
    rates = llm.engine.step_rates
    assert rates.prefill_tokens_per_s is not None and rates.prefill_tokens_per_s > 0
    assert rates.decode_step_s is not None and 0 < rates.decode_step_s < 10
    stats = llm.stats()
    assert stats["prefill_tokens_per_second"] == pytest.approx(rates.prefill_tokens_per_s)
    assert stats["decode_step_seconds"] == pytest.approx(rates.decode_step_s)
