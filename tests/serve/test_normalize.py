"""The one request normalisation both APIs share (no Ray: a tokenizer and a fake describe)."""

import asyncio
import threading

import pytest

from app.serve.api.normalize import INLINE_PROMPT_CHARS, EngineInfo, RequestNormalizer
from app.serve.api.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest
from app.serve.config import ServeArgs
from app.tokenizer import Tokenizer

INFO = EngineInfo(
    max_model_len=512,
    vocab_size=320,
    eos_token_ids=frozenset({2}),
    salt_base=("fp", "fp8_e4m3", "layout"),
    block_size=16,
    chunk_tokens=32,
    kv_cache_dtype="fp8_e4m3",
)
SALTS = {"key-a": "tenant-a", "key-b": "tenant-b"}


async def _describe() -> EngineInfo:
    return INFO


def normalizer(tokenizer, **args) -> RequestNormalizer:
    cfg = ServeArgs(api_key_cache_salts=SALTS, max_prompt_tokens=400, **args)
    return RequestNormalizer(cfg, "tiny", tokenizer, _describe)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer.from_path(tiny_model)


def run(coro):
    return asyncio.run(coro)


def test_text_chat_and_token_ids_normalise_alike(tokenizer):
    n = normalizer(tokenizer)
    text = CompletionRequest(model="tiny", prompt="hello world", max_tokens=3, temperature=0)
    req = run(n.normalize(text, {}))
    assert req.prompt_token_ids == tokenizer.encode("hello world")
    assert req.kind == "text_completion" and req.request_id.startswith("cmpl-")
    assert req.params.max_tokens == 3 and req.params.temperature == 0
    by_ids = CompletionRequest(model="tiny", prompt=req.prompt_token_ids, max_tokens=3)
    assert run(n.normalize(by_ids, {})).prompt_token_ids == req.prompt_token_ids
    chat = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}])
    got = run(n.normalize(chat, {}))
    assert got.kind == "chat.completion"
    assert got.prompt_token_ids == tokenizer.encode_chat([{"role": "user", "content": "hi"}])


def test_engine_ids_are_unique_even_for_one_client_request_id(tokenizer):
    """gRPC request ids need not be unique: the engine-side ids always are (tenants too)."""
    n = normalizer(tokenizer)
    body = CompletionRequest(model="tiny", prompt="hi", n=2)
    a = run(n.normalize(body, {"authorization": "Bearer key-a"}, request_id="same"))
    b = run(n.normalize(body, {"authorization": "Bearer key-b"}, request_id="same"))
    assert a.request_id == b.request_id == "same"
    ids = {r.choice(i, INFO, "engine").request_id for r in (a, b) for i in range(2)}
    assert len(ids) == 4
    assert (a.cache_salt, b.cache_salt) == ("tenant-a", "tenant-b")


def test_tenant_salt_and_required_key(tokenizer):
    n = normalizer(tokenizer, cache_salt_header="X-Tenant")
    assert n.tenant_salt({"x-api-key": "key-b"}, require_key=True) == "tenant-b"
    assert n.tenant_salt({"x-tenant": "t9"}, require_key=False) == "t9"
    with pytest.raises(APIError) as e:
        n.tenant_salt({"authorization": "Bearer nope"}, require_key=True)
    assert e.value.status == 401 and "not a known key" in e.value.message


@pytest.mark.parametrize(
    "body,status,words",
    [
        (CompletionRequest(model="gpt-4", prompt="hi"), 404, "does not exist"),
        (CompletionRequest(model="tiny", prompt="hi", cache_salt="x"), 400, "operator"),
        (CompletionRequest(model="tiny", prompt=""), 400, "empty"),
        (CompletionRequest(model="tiny", prompt=[1, 999]), 400, "token ids"),
        (CompletionRequest(model="tiny", prompt=[5] * 401), 400, "at most 400"),
    ],
)
def test_bad_bodies_are_named(tokenizer, body, status, words):
    with pytest.raises(APIError) as e:
        run(normalizer(tokenizer).normalize(body, {}))
    assert e.value.status == status and words in e.value.message


def test_routing_hints_only_when_the_operator_allows_them(tokenizer):
    body = CompletionRequest(model="tiny", prompt="hi")
    headers = {"x-slimserve-prefill-replica": "1", "x-slimserve-engine-replica": "x"}
    assert run(normalizer(tokenizer).normalize(body, headers)).hints == {}
    allowed = run(normalizer(tokenizer, allow_routing_hints=True).normalize(body, headers))
    assert allowed.hints == {"prefill": 1}
    assert allowed.choice(0, INFO, "prefill").routing.hint == 1


class BlockingTokenizer:
    """encode() blocks until released: stands for tokenizing a 4 MB prompt."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        self.entered.set()
        if not self.release.wait(5):  # only the event loop can release it
            raise TimeoutError("encode() blocked the event loop")
        return [5] * 3


def test_tokenization_runs_off_the_event_loop():
    """While a long prompt is being tokenized, the loop still runs other work (e.g. /health).

    Seen failing: with `_tokens` called directly in `prompt()` (no to_thread), encode()
    blocked the loop, nothing could release it, and it raised TimeoutError after 5 s.
    """
    tok = BlockingTokenizer()
    n = normalizer(tok)

    async def main() -> int:
        ticks = 0
        long = CompletionRequest(model="tiny", prompt="x" * (INLINE_PROMPT_CHARS + 1))
        task = asyncio.create_task(n.normalize(long, {}))
        while not tok.entered.is_set():
            await asyncio.sleep(0.01)
        for _ in range(3):  # the loop is free while encode() is blocked
            await asyncio.sleep(0)
            ticks += 1
        tok.release.set()
        assert (await task).prompt_token_ids == [5] * 3
        return ticks

    assert run(main()) == 3


class ThreadRecordingTokenizer:
    """Records the thread each encode ran on."""

    def __init__(self):
        self.threads: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.get_ident())
        return [5] * 3

    def encode_chat(self, conversation, tools) -> list[int]:
        return self.encode("")


def test_short_prompts_are_tokenized_on_the_event_loop():
    """A thread round trip sends the request to the back of the loop's queue (~4 ms at 8
    streams, docs/performance.md), so short texts are tokenized on the loop; longer ones,
    and chats with tools, in a worker thread.

    Seen failing: with the size check inverted, the short prompt ran in a worker thread.
    """
    tok = ThreadRecordingTokenizer()
    n = normalizer(tok)
    short = "x" * INLINE_PROMPT_CHARS
    bodies = [
        (CompletionRequest(model="tiny", prompt=short), True),
        (CompletionRequest(model="tiny", prompt=[short]), True),
        (ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}]), True),
        (CompletionRequest(model="tiny", prompt=short + "x"), False),
        (
            ChatCompletionRequest(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            ),
            False,
        ),
    ]

    async def main() -> list[bool]:
        loop_thread = threading.get_ident()
        on_loop = []
        for body, _ in bodies:
            await n.normalize(body, {})
            on_loop.append(tok.threads[-1] == loop_thread)
        return on_loop

    assert run(main()) == [inline for _, inline in bodies]
