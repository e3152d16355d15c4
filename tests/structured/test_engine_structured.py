"""Structured outputs through the offline engine (LLM) on the embedded default model.

The model is small and random-ish; only the grammar makes its outputs valid, so every
assertion on validity here fails when masking is off (seen: with `StructuredOutputs.mask`
made a no-op, test_json_schema_outputs_validate fails on its first output).
"""

import asyncio
import json
import re
import threading

import jsonschema
import pytest

from app import LLM, SamplingParams
from app.assets import default_model_path
from app.engine import engine as engine_module
from app.engine.async_engine import AsyncEngine
from app.engine.request import Request
from app.engine.structured import StructuredOutputError, StructuredOutputSpec
from tests.structured.schemas import PERSON


@pytest.fixture(scope="module")
def llm():
    return LLM(default_model_path(), device="cpu", dtype="float32")


def _params(spec, **kw):
    return SamplingParams(structured=spec, **{"max_tokens": 160, "temperature": 1.0, **kw})


def test_json_schema_outputs_validate(llm):
    """50 prompts, nested schema: every output that ends "stop" parses and validates."""
    prompts = [f"Record {i} of the people of the city:" for i in range(50)]
    outs = llm.generate(prompts, _params(StructuredOutputSpec.json_schema(PERSON), seed=3))
    done = [o for o in outs if o.finish_reason == "stop"]
    assert len(done) >= 40, [o.finish_reason for o in outs]  # most finish within 160 tokens
    for o in done:
        jsonschema.validate(json.loads(o.text), PERSON)
    for o in outs:
        assert o.finish_reason in ("stop", "length")


def test_unconstrained_output_is_not_json(llm):
    """The control: without a grammar the same prompts do not produce the schema."""
    outs = llm.generate(["Record 1 of the people of the city:"] * 5, _params(None, seed=3))
    for o in outs:
        with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(o.text), PERSON)


def test_choice_and_regex_match(llm):
    choices = ["yes", "no", "not sure"]
    outs = llm.generate(["Is it so?"] * 8, _params(StructuredOutputSpec.choice(choices)))
    assert {o.finish_reason for o in outs} == {"stop"}
    assert all(o.text in choices for o in outs)
    pattern = r"[A-Z]{2}-\d{3}(-[a-z]{1,4})?"
    outs = llm.generate(["Plate:"] * 8, _params(StructuredOutputSpec.regex(pattern)))
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), o.text


def test_ebnf_grammar_and_json_object(llm):
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    outs = llm.generate(["Sum:"] * 6, _params(StructuredOutputSpec.grammar(ebnf), max_tokens=40))
    for o in outs:
        if o.finish_reason == "stop":
            assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", o.text), o.text
    assert any(o.finish_reason == "stop" for o in outs)
    outs = llm.generate(["Data:"] * 6, _params(StructuredOutputSpec.json_object(), max_tokens=60))
    for o in outs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)


def test_max_tokens_cut_off_is_length_never_stop(llm):
    """A grammar that cannot finish in max_tokens ends "length" with a valid prefix."""
    spec = StructuredOutputSpec.json_schema(PERSON)
    outs = llm.generate(["People:"] * 6, _params(spec, max_tokens=8))
    for o in outs:
        assert o.finish_reason == "length" and len(o.token_ids) == 8
        with pytest.raises(json.JSONDecodeError):
            json.loads(o.text)
        # a prefix of the schema's output, however the grammar's tokens cut it
        assert o.text.startswith('{"name": ') or '{"name": '.startswith(o.text), o.text


def test_grammar_end_stops_even_with_ignore_eos(llm):
    """The grammar's terminal state ends the sequence "stop", also when EOS is ignored.

    Seen failing: without the grammar check in OutputProcessor.process these ran to
    max_tokens ("length") after the grammar had finished."""
    spec = StructuredOutputSpec.choice(["alpha", "beta"])
    outs = llm.generate(["Pick:"] * 4, _params(spec, ignore_eos=True, max_tokens=30))
    for o in outs:
        assert o.finish_reason == "stop" and o.text in ("alpha", "beta")
        assert len(o.token_ids) < 30


def test_n_samples_each_follow_the_grammar(llm):
    spec = StructuredOutputSpec.json_schema(PERSON)
    out = llm.generate(["A person:"], _params(spec, n=4, seed=11))[0]
    assert len(out.outputs) == 4
    texts = [c.text for c in out.outputs if c.finish_reason == "stop"]
    assert len(texts) >= 2 and len(set(texts)) > 1  # independent samples, not copies
    for t in texts:
        jsonschema.validate(json.loads(t), PERSON)


def test_stop_strings_still_cut_the_output(llm):
    """A stop string inside a constrained output ends it there (OpenAI semantics)."""
    spec = StructuredOutputSpec.regex(r"ab(cd)(cd)+x")  # "cdcd" always comes
    out = llm.generate(["Go:"], _params(spec, stop=["cdcd"], max_tokens=30))[0]
    assert out.finish_reason == "stop" and out.text == "ab"


def test_disaggregated_replay_continues_the_grammar(llm):
    """Prefill-only samples a first token under the grammar; a second engine request with
    that token appended and replayed (prior_output_ids) continues to a valid output.

    Seen failing: without the replay the decode side's matcher starts at the grammar's
    root again and the output becomes '{' + a whole object (invalid)."""
    engine = llm.engine
    spec = StructuredOutputSpec.json_schema(PERSON)
    prompt = llm.tokenizer.encode("Person:")
    prefill = [Request(f"p{i}", prompt, _params(spec, seed=i), prefill_only=True) for i in range(6)]
    firsts = llm.run(prefill)
    assert all(f.text == "{" and len(f.token_ids) == 1 for f in firsts)
    decode = [
        Request(
            f"d{i}",
            prompt + f.token_ids,
            _params(spec, seed=i, max_tokens=159),
            prior_output_ids=f.token_ids,
        )
        for i, f in enumerate(firsts)
    ]
    rests = llm.run(decode)
    done = [f.text + r.text for f, r in zip(firsts, rests) if r.finish_reason == "stop"]
    assert len(done) >= 3, [r.finish_reason for r in rests]
    for text in done:
        jsonschema.validate(json.loads(text), PERSON)
    assert not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.num_blocks


def test_bad_spec_fails_add_request_and_leaks_nothing(llm):
    engine = llm.engine
    free = engine.blocks.num_free
    bad = StructuredOutputSpec.json_schema({"type": "object", "properties": {"a": {"$ref": "#/x"}}})
    with pytest.raises(StructuredOutputError, match="invalid json_schema"):
        llm.generate(["x"], _params(bad))
    assert not engine.has_unfinished() and engine.blocks.num_free == free
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate(["x"], _params(StructuredOutputSpec.regex("(ab")))


def test_failed_compile_aborts_only_that_request(llm, monkeypatch):
    """A compile that fails after validation ends its request "abort"; a plain request in
    the same batch finishes normally."""
    compiler = llm.engine.structured.compiler

    def broken(spec):
        raise StructuredOutputError("boom")

    monkeypatch.setattr(compiler, "_compile", broken)
    spec = StructuredOutputSpec.regex("never-cached-[0-9]+")
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=4, structured=spec))
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert [o.token_ids for o in outs] == [[], []]
    plain = llm.generate(["a"], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert plain.finish_reason == "length"


def test_a_plain_request_does_not_wait_for_a_grammar_compile(llm, monkeypatch):
    """The engine has nothing to run but a request whose grammar still compiles (held
    here) and its step idles on it; a plain request that arrives then is run at once:
    AsyncEngine wakes the idle step. The idle wait is set to 60 s, so only the wake can
    end it. Seen failing (wait_for timed out) with StructuredOutputs.wake a no-op."""
    monkeypatch.setattr(engine_module, "COMPILE_IDLE_S", 60.0)
    structured = llm.engine.structured
    gate, idling = threading.Event(), threading.Event()
    real_compile, real_wait = structured.compiler._compile, structured.wait

    def held_compile(spec):
        assert gate.wait(60), "test gate never opened"
        return real_compile(spec)

    def wait(timeout_s):
        idling.set()
        real_wait(timeout_s)

    monkeypatch.setattr(structured.compiler, "_compile", held_compile)
    monkeypatch.setattr(structured, "wait", wait)
    engine = AsyncEngine(llm.engine)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    spec = StructuredOutputSpec.regex("held-compile-[0-9]+")

    async def collect(request):
        return [t async for d in engine.generate(request) for t in d.new_token_ids]

    async def main():
        ids = llm.tokenizer.encode("Name:")
        held = asyncio.ensure_future(collect(Request("g", ids, _params(spec, max_tokens=8))))
        try:
            assert await asyncio.to_thread(idling.wait, 30), "the step never idled"
            got = await asyncio.wait_for(collect(Request("p", ids, plain)), 10)
        finally:
            gate.set()
        await asyncio.wait_for(held, 60)
        return got

    assert len(asyncio.run(main())) == 4


def test_speculative_decoding_keeps_the_grammar_and_the_output():
    """n-gram speculation with a grammar: greedy outputs equal plain decoding's and the
    proposals are both accepted and rejected (so the masked verify rows are exercised).

    Seen failing: masking every speculated row with the first row's mask (no tentative
    accept/rollback) made the first prompt's output differ from plain decoding at token 6."""
    spec = StructuredOutputSpec.regex(r"(ab|abc|b){4,40}")
    plain = LLM(default_model_path(), device="cpu", dtype="float32")
    fast = LLM(
        default_model_path(),
        device="cpu",
        dtype="float32",
        # cost_aware off: the cost policy could pause speculation on a slow machine
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "cost_aware": False,
        },
    )
    prompts = ["ab ab abc b", "Say:", "abcabc"]
    p = SamplingParams(temperature=0, max_tokens=40, structured=spec)
    want, got = plain.generate(prompts, p), fast.generate(prompts, p)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        if g.finish_reason == "stop":
            assert re.fullmatch(r"(ab|abc|b){4,40}", g.text), g.text
    stats = fast.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats
