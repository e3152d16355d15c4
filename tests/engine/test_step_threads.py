"""The per-step thread policy: large steps get the threads, small ones one thread."""

import threading

import pytest
import torch

from app import LLM, SamplingParams
from app.engine.step_threads import StepThreads, available_cpus


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_by_longest_chunk():
    policy = StepThreads(max_threads=3, min_tokens=64)
    assert [policy.threads_for(n) for n in (1, 63, 64, 2048)] == [1, 1, 3, 3]


def test_available_cpus_are_the_affinity_capped_by_a_cgroup_quota(tmp_path, monkeypatch):
    """A Kubernetes CPU limit is a quota: the affinity alone is every core of the node.

    Seen failing: with the quota ignored (8 where 2.5 CPUs are allowed)."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    v2, quota, period = tmp_path / "cpu.max", tmp_path / "quota", tmp_path / "period"
    none = (str(tmp_path / "absent"), str(tmp_path / "absent"))
    v2.write_text("250000 100000\n")
    assert available_cpus(str(v2), none) == 3
    v2.write_text("max 100000\n")
    assert available_cpus(str(v2), none) == 8
    quota.write_text("50000\n")  # cgroup v1, no v2 file
    period.write_text("100000\n")
    assert available_cpus(str(tmp_path / "absent"), (str(quota), str(period))) == 1
    quota.write_text("-1\n")
    assert available_cpus(str(tmp_path / "absent"), (str(quota), str(period))) == 8
    assert available_cpus(str(tmp_path / "absent"), none) == 8


def test_bad_policy_is_refused():
    with pytest.raises(AssertionError):
        StepThreads(max_threads=0, min_tokens=1)


def test_engine_runs_each_step_on_the_threads_its_longest_chunk_asks_for(
    llama_path, restore_threads
):
    """Seen on the thread that runs the step, at the runner (where the forward pass runs):
    a step with a 20-token prompt on 2 threads; two 12-token prompts (24 new tokens, none
    of them 16) and each one-token decode step on 1.

    Seen failing: with the step's total new tokens deciding (the short prompts on 2)."""
    llm = LLM(llama_path, dtype="float32", device="cpu")
    engine = llm.engine
    engine.step_threads = StepThreads(max_threads=2, min_tokens=16)
    seen: list[tuple[int, int]] = []  # (new tokens, torch threads) per forward pass
    run = engine.runner.run

    def spy(plan):
        seen.append((len(plan.token_ids), torch.get_num_threads()))
        return run(plan)

    engine.runner.run = spy
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([[5, 17, 42, 99, 3] * 4, [7, 8, 9] * 4], params)
    assert seen == [(32, 2), (2, 1), (2, 1)]
    seen.clear()
    llm.generate([[7, 8, 9] * 4, [6, 5, 4] * 4], params)
    assert seen == [(24, 1), (2, 1), (2, 1)]


def test_the_policy_applies_on_whichever_thread_steps(llama_path, restore_threads):
    """torch's thread count is per OS thread: a step run from another thread (the asyncio
    engine's executor) still gets the policy's count there."""
    llm = LLM(llama_path, dtype="float32", device="cpu")
    engine = llm.engine
    engine.step_threads = StepThreads(max_threads=2, min_tokens=16)
    torch.set_num_threads(1)
    seen = []
    run = engine.runner.run
    engine.runner.run = lambda plan: (seen.append(torch.get_num_threads()), run(plan))[1]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def in_thread():
        llm.generate([list(range(5, 25))], params)

    worker = threading.Thread(target=in_thread)
    worker.start()
    worker.join()
    assert seen == [2]
