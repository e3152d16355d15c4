"""The structured-output package on its own: specs, tokenizer info, compiler cache, matcher,
bitmask application (no model)."""

import subprocess
import sys
import threading

import pytest
import torch

from app.assets import default_model_path
from app.engine.structured import StructuredOutputError, StructuredOutputSpec
from app.engine.structured.compiler import GrammarCompiler
from app.engine.structured.logits import apply_bitmask, bitmask_to_bool, grammar_bitmask
from app.engine.structured.matcher import SequenceGrammar
from app.tokenizer import Tokenizer

EOS = (2, 1)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_path(default_model_path())


@pytest.fixture(scope="module")
def compiler(tok):
    c = GrammarCompiler(tok, 4096, EOS)
    yield c
    c.shutdown()


def _allowed(grammar: SequenceGrammar) -> list[int]:
    bitmask, rows = grammar_bitmask([grammar], 4096)
    return bitmask_to_bool(bitmask, 4096)[0].nonzero().flatten().tolist()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: StructuredOutputSpec.json_schema({"type": "nope"}), 'Unsupported type "nope"'),
        (lambda: StructuredOutputSpec.json_schema("{not json"), "not valid JSON"),
        (lambda: StructuredOutputSpec.json_schema([1]), "must be a JSON object"),
        (lambda: StructuredOutputSpec.regex("(?<=a)b"), "Lookbehind is not supported"),
        (lambda: StructuredOutputSpec.grammar("root ::= missing"), 'Rule "missing"'),
        (lambda: StructuredOutputSpec.choice([]), "non-empty list"),
        (lambda: StructuredOutputSpec.choice("yes"), "list of strings"),
        (lambda: StructuredOutputSpec("xml"), "unknown structured output kind"),
        (lambda: StructuredOutputSpec.regex(""), "regex is empty"),
    ],
)
def test_bad_specs_name_the_problem(make, message):
    with pytest.raises(StructuredOutputError) as e:
        make().build_grammar()
    assert message in str(e.value) and "/project/" not in str(e.value)


def test_spec_key_keeps_property_order():
    a = StructuredOutputSpec.json_schema({"properties": {"b": {}, "a": {}}})
    b = StructuredOutputSpec.json_schema('{"properties": {"b": {}, "a": {}}}')
    c = StructuredOutputSpec.json_schema({"properties": {"a": {}, "b": {}}})
    assert a.key == b.key != c.key and a.source.index('"b"') < a.source.index('"a"')


def test_special_tokens_are_never_allowed(compiler, tok):
    """Chat markers (<|user|> ...) would match a JSON string by their literal text."""
    spec = StructuredOutputSpec.regex(r"[<|a-z>]{1,20}")
    allowed = set(_allowed(SequenceGrammar(spec, compiler.submit(spec))))
    assert len(allowed) > 100
    assert not allowed & {0, 3, 4, 5, 6}  # BOS, PAD, <|user|>, <|assistant|>, <|system|>


def test_cache_shares_compiles_and_forgets_failures(tok):
    c = GrammarCompiler(tok, 4096, EOS, cache_size=2)
    threads = []
    real = c._compile
    c._compile = lambda spec: (threads.append(threading.current_thread().name), real(spec))[1]
    specs = [StructuredOutputSpec.regex(f"x{i}") for i in range(3)]
    f0 = c.submit(specs[0])
    assert c.submit(StructuredOutputSpec.regex("x0")) is f0 and c.stats.cache_hits == 1
    c.compile(specs[1]), c.compile(specs[2])  # evicts x0 (LRU, 2 entries)
    assert c.submit(specs[0]) is not f0
    assert all(name.startswith("grammar-compile") for name in threads)  # off the caller
    bad = StructuredOutputSpec.regex("(")
    with pytest.raises(StructuredOutputError):
        c.compile(bad)
    assert c.submit(bad) is not None and c.stats.failures >= 1
    c.shutdown()


def test_matcher_terminates_rolls_back_and_masks(compiler, tok):
    spec = StructuredOutputSpec.choice(["cat", "dog"])
    g = SequenceGrammar(spec, compiler.submit(spec))
    ids = tok.encode("cat", add_special_tokens=False)
    for t in ids:
        assert g.accept(t)
    assert not g.terminated and set(_allowed(g)) == set(EOS)  # only EOS after "cat"
    assert not g.accept(tok.encode("x", add_special_tokens=False)[0])  # rejected, no change
    assert g.accept(EOS[0]) and g.terminated
    g.rollback(1 + len(ids))
    assert not g.terminated and g.num_accepted == 0
    first = set(_allowed(g))
    assert ids[0] in first and EOS[0] not in first
    with pytest.raises(ValueError):
        g.rollback(1)


def test_replay_rejects_a_foreign_first_token(compiler, tok):
    spec = StructuredOutputSpec.choice(["cat"])
    x = tok.encode("x", add_special_tokens=False)
    future = compiler.submit(spec)
    future.result()
    g = SequenceGrammar(spec, future, replay=tuple(x))
    assert not g.ready and "does not fit the grammar" in g.settle() and not g.ready


def test_apply_bitmask_matches_a_torch_reference(compiler):
    """Rows with a grammar get -inf outside it; other rows are untouched."""
    spec = StructuredOutputSpec.regex("[0-9]+")
    g = SequenceGrammar(spec, compiler.submit(spec))
    logits = torch.randn(3, 4096)
    ref = logits.clone()
    bitmask, rows = grammar_bitmask([None, g, None], 4096)
    apply_bitmask(logits, bitmask, rows)
    allowed = bitmask_to_bool(bitmask, 4096)
    assert rows == [1] and allowed[0].all() and 0 < allowed[1].sum() < 1000, allowed[1].sum()
    ref[1][~allowed[1]] = float("-inf")
    torch.testing.assert_close(logits, ref)


def test_importable_without_xgrammar():
    """No xgrammar: the engine imports and runs; a structured request fails clearly."""
    code = (
        "import sys; sys.modules['xgrammar'] = None\n"
        "from app.engine.engine import Engine\n"
        "from app.engine.structured import StructuredOutputSpec, StructuredOutputError\n"
        "from app import SamplingParams\n"
        "p = SamplingParams(structured=StructuredOutputSpec.choice(['a']))\n"
        "try:\n"
        "    p.structured.build_grammar()\n"
        "except StructuredOutputError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR structured outputs need xgrammar" in out.stdout


@pytest.mark.parametrize("string", [{"type": "string"}, {"type": "string", "maxLength": 8}])
def test_json_strings_never_allow_raw_control_characters(compiler, tok, string):
    """JSON forbids raw U+0000-U+001F in strings. Seen failing: xgrammar's rule for
    length-bounded strings allowed them (a served output held a raw \\x08) until
    spec._no_raw_control_chars rewrote it."""
    spec = StructuredOutputSpec.json_schema({"type": "object", "properties": {"s": string}})
    g = SequenceGrammar(spec, compiler.submit(spec))
    for t in tok.encode('{"s": "a', add_special_tokens=False):
        assert g.accept(t)
    allowed = _allowed(g)
    controls = [i for i in allowed if any(ord(c) < 0x20 for c in tok.decode([i]))]
    assert not controls and len(allowed) > 1000
