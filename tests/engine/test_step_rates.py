"""An engine's measured step rates (app/engine/step_rates.py): its decode step time and
prefill rate, the placement policy's measured inputs."""

from types import SimpleNamespace

import pytest

from app import LLM, SamplingParams
from app.engine.step_rates import MIN_PREFILL_SHARE, StepRates, step_work


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
    """A chunk of 128 tokens in 0.1 s (1,280 tokens/s) after 2,048 in 1 s: a mean of
    per-step rates would read 1,664 tokens/s; the moving sums read about 1,978. Seen failing
    with the per-step rates averaged."""
    rates = StepRates(alpha=0.5)
    rates.record(2048, 0, 1.0)
    rates.record(128, 0, 0.1)
    assert rates.prefill_tokens_per_s == pytest.approx(1088 / 0.55)


def test_a_prompts_tail_is_no_prefill_sample():
    """A prompt prefilled elsewhere (or mostly cached) leaves its last tokens to compute
    beside the decode rows: those steps must not drag the rate down. Seen failing with
    `min_prefill_tokens` ignored (the rate fell from 10,000 to ~1,760 tokens/s: a 9-token
    tail is charged MIN_PREFILL_SHARE of its step)."""
    rates = StepRates()
    rates.record(0, 16, 0.02)
    rates.record(1000, 16, 0.12)
    for _ in range(100):
        rates.record(9, 16, 0.0205)
    assert rates.prefill_tokens_per_s == pytest.approx(10_000)
    assert rates.decode_step_s == pytest.approx(0.02)


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


def test_a_step_is_split_into_prefill_tokens_and_decode_rows():
    """A preempted sequence recomputing its outputs prefills (it computes many tokens), a
    verify row is one decode row whatever it proposed. Seen failing with `prompt_done`
    alone deciding (the recompute counted as one decode row)."""
    prompt = SimpleNamespace(prompt_done=False, spec_tokens=[])
    recompute = SimpleNamespace(prompt_done=True, spec_tokens=[])
    verify = SimpleNamespace(prompt_done=True, spec_tokens=[5, 6, 7])
    decode = SimpleNamespace(prompt_done=True, spec_tokens=[])
    scheduled = [(prompt, 300), (recompute, 40), (verify, 4), (decode, 1)]
    assert step_work(scheduled) == (340, 2)


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
