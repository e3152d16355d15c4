"""Model proposers (MTP, draft model) through the request lifecycle, as without speculation:
a cache too small for the batch (preemption: the proposer's KV is dropped with the target's
and caught up again on recompute), an abort mid-decode, stop token ids inside an accepted
run, max_tokens; every block free at the end (none leaked by drafts or rollbacks).
n-gram has the same checks in test_engine_ngram.py."""

import pytest

from app import LLM, SamplingParams
from app.engine.spec.factory import extra_block_bytes
from app.engine.spec.speculator import Speculator
from tests.spec.abort import abort_one_of_two
from tests.spec.mtp_checkpoints import make_mtp_checkpoint

PROMPTS = [list(range(3 + i, 40 + i)) for i in range(4)]  # 3 blocks each, 5 at the end
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(path, reference MTP logits) of a GLM-4.5 checkpoint with one MTP layer."""
    return make_mtp_checkpoint("glm4_moe", str(tmp_path_factory.mktemp("glm")))


def make(path: str, spec: dict | None, blocks: int | None = None) -> LLM:
    kw = dict(dtype="float32", device="cpu", speculative_config=spec)
    if blocks is not None:  # a pool of `blocks` blocks, each paying for target + proposer KV
        probe = LLM(path, **kw).engine
        per_block = probe.kv_spec.bytes_per_block() + extra_block_bytes(probe)
        kw["kv_cache_memory_bytes"] = blocks * per_block
    return LLM(path, **kw)


def cases(glm: str, llama: str) -> list[tuple[str, dict]]:
    mtp = {"method": "mtp", "num_speculative_tokens": 3, "backoff": False}
    draft = {"method": "draft_model", "model": llama, "num_speculative_tokens": 3}
    return [(glm, mtp), (llama, draft | {"backoff": False})]  # the target drafting itself


def check_proposals(which: int, stats: dict, drafts: list, reference) -> None:
    """The random MTP layer's drafts are (almost) never accepted: check them against the
    transformers reference from their context instead (after preemptions too); the
    self-draft must be accepted."""
    if which == 1:
        assert stats["spec_acceptance_rate"] > 0.9, stats
        return
    assert len(drafts) > 20
    for ids, d in drafts[:: len(drafts) // 6]:
        n = len(ids)
        assert reference(ids, d[:-1])[n - 2 : n - 2 + len(d)].argmax(-1).tolist() == d


@pytest.mark.parametrize("which", [0, 1], ids=["mtp", "draft_model"])
def test_preemption_abort_and_stops_as_without_speculation(glm, llama_path, which, monkeypatch):
    """Seen failing: with the proposers' catch-up skipping a preempted sequence's recompute
    (Speculator.after_step), the MTP drafts differed from the reference and the self-draft
    acceptance fell from > 0.9 to 0.04; with Engine._emit not stopping at a stop token
    inside an accepted run, the output ran past the stop ([.., 306, 164, 63] vs [.., 306])."""
    path, spec = cases(glm[0], llama_path)[which]
    base = make(path, None)
    llm = make(path, spec, blocks=14)
    want = base.generate(PROMPTS, GREEDY)
    drafts = []
    verify = Speculator.verify

    def record(self, logits, seqs):
        drafts.extend((list(s.token_ids), list(s.spec_tokens)) for s in seqs if s.spec_tokens)
        return verify(self, logits, seqs)

    monkeypatch.setattr(Speculator, "verify", record)
    got = llm.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert llm.stats()["preemptions"] > 0
    check_proposals(which, llm.stats(), drafts, glm[1])
    # Stop token ids first appearing at several places of the output end the sequence
    # there, as plain (some fall inside an accepted run); so does max_tokens.
    out = want[1].token_ids
    stops = [t for i, t in enumerate(out) if i >= 2 and t not in out[:i]][:4]
    assert len(stops) >= 2
    params = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[t]) for t in stops]
    params += [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 5)]
    for p in params:
        w, g = base.generate(PROMPTS[1:2], p)[0], llm.generate(PROMPTS[1:2], p)[0]
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    deltas = abort_one_of_two(llm.engine, [PROMPTS[0], PROMPTS[2]], GREEDY, steps=5)
    b = [t for d in deltas if d.request_id == "b" for t in d.new_token_ids]
    assert b == want[2].token_ids[-len(b) :]
