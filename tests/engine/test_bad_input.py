"""Bad input raises a clear ValueError and leaves the engine untouched."""

import pytest

from app import LLM, SamplingParams
from app.engine.request import Request


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, dtype="float32", device="cpu")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(n=0), "n must"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(logprobs=50), "logprobs"),
        (dict(temperature="hot"), "temperature"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "prompt is empty"),
        ([1] * 600, "context is 512 tokens"),
        ([5, 99999], "out of range"),
        ([5, -1], "out of range"),
    ],
)
def test_bad_prompts(llm, prompt, message):
    free = llm.engine.blocks.num_free
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request(Request("bad", prompt, SamplingParams()))
    assert llm.engine.blocks.num_free == free
    assert not llm.engine.has_unfinished()
    # the engine still serves good requests
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids) >= 1


def test_empty_string_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams())


def test_duplicate_request_id(llm):
    llm.engine.add_request(Request("dup", [5, 6], SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request(Request("dup", [5, 6], SamplingParams(max_tokens=1)))
    llm.engine.abort("dup")
    llm.engine.step()


def test_wrong_prompt_type(llm):
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([3.5], SamplingParams())
