"""Sampling parameters, stop conditions, logprobs and detokenization."""

import dataclasses

import pytest
import torch

from app import LLM, SamplingParams
from app.engine.detokenizer import IncrementalDetokenizer
from app.engine.sampler import SamplingBatch, filtered_probs

PROMPT = [5, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, dtype="float32", device="cpu")


def test_seed_is_reproducible_per_request(llm):
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=42, ignore_eos=True)
    a = llm.generate([PROMPT], p)[0].token_ids
    b = llm.generate([PROMPT, [9, 9, 9]], p)[0].token_ids  # batch company doesn't matter
    c = llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=12, seed=7))[0]
    assert a == b
    assert a != c.token_ids


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    topk1 = llm.generate(
        [PROMPT], SamplingParams(temperature=0.8, top_k=1, max_tokens=10, seed=1, ignore_eos=True)
    )
    assert greedy[0].token_ids == topk1[0].token_ids


def test_filters():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[None]

    def probs(p):
        batch = SamplingBatch.build([p], [0], [0], [[]], [[]], vocab_size=4)
        return filtered_probs(logits, batch)[0].tolist()

    want = pytest.approx([0.625, 0.375, 0, 0])
    assert probs(SamplingParams(top_k=2)) == want
    assert probs(SamplingParams(top_p=0.7)) == want
    assert probs(SamplingParams(min_p=0.5)) == want


def test_unseeded_requests_differ_and_n_siblings_differ(llm):
    p = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a, b = llm.generate([PROMPT, PROMPT], p)
    assert a.token_ids != b.token_ids
    pair = llm.generate([PROMPT], SamplingParams(n=2, seed=5, max_tokens=12, ignore_eos=True))[0]
    assert pair.outputs[0].token_ids != pair.outputs[1].token_ids
    # sibling i uses seed + i, as the ingress does when it splits n into requests
    single = llm.generate([PROMPT], SamplingParams(seed=6, max_tokens=12, ignore_eos=True))[0]
    assert pair.outputs[1].token_ids == single.token_ids


def test_penalties_see_every_earlier_output_token(llm):
    """Engine tokens under repetition/presence/frequency penalties equal a step-by-step
    reference that rescored the whole sequence and applied the old per-sequence penalties to
    all outputs so far. Seen failing with the penalty outputs cut to the last 4 tokens."""
    from sampler_reference import apply_penalties as ref_penalties

    p = SamplingParams(
        temperature=0,
        max_tokens=16,
        ignore_eos=True,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.7,
    )
    got = llm.generate([PROMPT], p)[0].token_ids
    out: list[int] = []
    for _ in range(16):
        logits = llm.engine.score(PROMPT + out)[-1]
        out.append(int(ref_penalties(logits.clone(), p, PROMPT, out).argmax()))
    assert got == out


def test_presence_penalty_discourages_repeats(llm):
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = llm.generate([PROMPT], base)[0].token_ids
    pen = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=2.0)
    penalized = llm.generate([PROMPT], pen)[0].token_ids
    assert len(set(penalized)) > len(set(plain))


def test_max_tokens_and_stop_token_ids(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    stop_id = out.token_ids[2]
    stopped = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_id])
    )[0]
    assert stopped.token_ids == out.token_ids[: out.token_ids.index(stop_id) + 1]
    assert stopped.finish_reason == "stop"


def test_stop_string_truncates_text(llm):
    full = llm.generate("the quick", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    text = full[0].text
    assert len(text) > 4
    stop = text[2:4]
    out = llm.generate("the quick", SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]


def test_logprobs(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    ref = llm.engine.score(PROMPT + out.token_ids).log_softmax(-1)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(PROMPT) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()


def test_streamed_text_equals_full_decode_and_is_valid_utf8(llm):
    tok = llm.tokenizer
    ids = tok.encode("héllo wörld ☃ the quick brown fox ☃☃")
    detok = IncrementalDetokenizer(tok, stop=[])
    pieces = []
    for t in ids:
        detok.add([t])
        pieces.append(detok.take(final=False))
    pieces.append(detok.take(final=True))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)


def test_chat_renders_template(llm):
    msgs = [{"role": "user", "content": "hello"}]
    rendered = llm.tokenizer.apply_chat_template(msgs)
    assert rendered == "<|user|>hello</s><|assistant|>"
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert len(out.token_ids) == 4


def test_handoff_from_another_replica_continues_the_same_tokens(llm):
    """Disaggregated in one process: a prefill-only request samples the first token, a second
    request continues from prompt + first (prior_output_ids) and must give the tokens one
    uninterrupted run gives, penalties included. Seen failing with the prior outputs counted
    as prompt (the frequency/presence penalties miss the first token)."""
    from app.engine.request import Request

    engine = llm.engine

    def run(request):
        engine.add_request(request)
        tokens = []
        while engine.has_unfinished():
            for delta in engine.step():
                tokens += delta.new_token_ids
        return tokens

    pen = dict(max_tokens=12, ignore_eos=True, presence_penalty=1.0, frequency_penalty=1.0)
    for i, p in enumerate([SamplingParams(temperature=0, **pen), SamplingParams(seed=7, **pen)]):
        want = llm.generate([PROMPT], p)[0].token_ids
        first = run(Request(f"pre{i}", PROMPT, p, prefill_only=True))
        rest_params = dataclasses.replace(p, max_tokens=p.max_tokens - len(first))
        rest = run(Request(f"dec{i}", PROMPT + first, rest_params, prior_output_ids=list(first)))
        assert first + rest == want
