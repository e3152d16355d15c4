"""Speculative decoding beside tensor parallelism: a TP=2 target that speculates gives the
greedy tokens of TP=1 plain decoding. The verify forward (1 + k query tokens per sequence)
runs on every rank like any extend; n-gram needs no weights; a draft model runs unsharded
on rank 0 (its own cache, the target's block ids)."""

import pytest

from app import SamplingParams
from app.engine.spec.speculator import Speculator
from tests.parallel.helpers import make_llm
from tests.spec.mtp_checkpoints import make_mtp_checkpoint

PROMPTS = [[7, 8, 9, 7, 8, 9, 7, 8], list(range(10, 40))]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def want(llama_path):
    return [o.token_ids for o in make_llm(llama_path).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tp2_speculation_equals_tp1_plain_decoding(llama_path, want, method):
    """Seen failing (both methods): with worker ranks reading token 3 for every proposal of
    a verify step (tp_driver.Step.run), their KV shard went wrong and the tokens diverged."""
    spec = {"method": method, "num_speculative_tokens": 3, "backoff": False}
    spec |= {"model": llama_path} if method == "draft_model" else {"prompt_lookup_min": 1}
    with make_llm(llama_path, 2, speculative_config=spec) as llm:
        assert llm.engine.tp_ctx.size == 2
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        stats = llm.stats()
    assert got == want
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_proposed_tokens"]


def test_tp2_mtp_drafts_like_tp1(tmp_path, monkeypatch):
    """MTP beside TP: every rank runs rank 0's MTP plan on its shard of the MTP layer (its
    collectives keep them in step); the TP=2 engine makes TP=1's plain greedy tokens and
    proposes exactly TP=1's MTP drafts. Seen failing with the worker rank reading its
    hidden rows shifted by one (tp_driver.MTPDraft): the drafts differed."""
    path, _ = make_mtp_checkpoint("glm4_moe", str(tmp_path / "glm"))
    mtp = {"method": "mtp", "num_speculative_tokens": 3, "backoff": False}
    plain = [o.token_ids for o in make_llm(path).generate(PROMPTS, GREEDY)]
    runs = []
    for tp in (1, 2):
        drafts = []
        verify = Speculator.verify

        def record(self, logits, seqs, drafts=drafts, verify=verify):
            drafts.extend(list(s.spec_tokens) for s in seqs if s.spec_tokens)
            return verify(self, logits, seqs)

        monkeypatch.setattr(Speculator, "verify", record)
        with make_llm(path, tp, speculative_config=mtp) as llm:
            runs.append(([o.token_ids for o in llm.generate(PROMPTS, GREEDY)], drafts))
        monkeypatch.undo()
    assert runs[0][0] == runs[1][0] == plain
    assert len(runs[0][1]) >= len(PROMPTS) * 4
    assert runs[1][1] == runs[0][1]


def test_tp2_cost_policy_pauses_and_resumes_with_tp1_tokens(llama_path, want):
    """The cost policy decides on rank 0 only; worker ranks follow rank 0's plan, whether a
    step verifies proposals or decodes plainly. On a fake clock (CPU-like, then GPU-like)
    the TP=2 engine pauses and resumes speculation and still makes TP=1's plain tokens.
    Seen failing: with the clock left CPU-like for the second run, it verified in 2 steps
    and paused in 16 (GPU-like: 8 and 4), and since re-probes back off while paused, with
    no resume counted (GPU-like: one); the token check is the one the other tests in this
    file saw fail."""
    from tests.spec.test_cost import cpu_like, gpu_like, timed

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    model = {"cost": cpu_like}
    with make_llm(llama_path, 2, speculative_config=spec) as llm:
        timed(llm, model)
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        paused = llm.stats()
        model["cost"] = gpu_like
        again = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        resumed = llm.stats()
    assert got == want and again == want
    assert paused["spec_cost_pauses"] >= 1 and paused["spec_cost_paused_steps"] > 0
    verified = resumed["spec_verify_steps"] - paused["spec_verify_steps"]
    # Resumed at a re-probe; how soon depends on the re-probe back-off (app/engine/spec/cost.py)
    assert resumed["spec_cost_resumes"] > paused["spec_cost_resumes"] and verified > 0
    assert resumed["spec_cost_ratio"] < 1.0
