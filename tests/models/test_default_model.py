"""The embedded default model: a standard HF Llama checkpoint that has really been trained."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from app.assets import default_heldout_path, default_model_path  # noqa: E402

MODEL_DIR = Path(default_model_path())
EVAL_TOKENS = 4096
WINDOW = 512


@pytest.fixture(scope="module")
def hf_model():
    model = transformers.LlamaForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


def heldout_ids(tokenizer) -> torch.Tensor:
    text = Path(default_heldout_path()).read_text()[:20_000]  # ~4,900 tokens
    ids = tokenizer(text)["input_ids"][:EVAL_TOKENS]
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    total, count = 0.0, 0
    for start in range(0, ids.numel(), WINDOW):
        chunk = ids[start : start + WINDOW].unsqueeze(0)  # [1, S]
        if chunk.numel() < 2:
            break
        loss = model(input_ids=chunk, labels=chunk).loss
        total += loss.item() * (chunk.numel() - 1)
        count += chunk.numel() - 1
    return math.exp(total / count)


def test_folder_is_a_small_complete_checkpoint():
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "MODEL_CARD.md",
        "heldout.txt",
    ):
        assert (MODEL_DIR / name).is_file(), name
    size = sum(f.stat().st_size for f in MODEL_DIR.iterdir() if f.is_file())
    assert size <= 30 * 2**20
    assert 40_000 <= (MODEL_DIR / "heldout.txt").stat().st_size <= 120_000


def test_loads_as_llama(hf_model):
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    cfg = hf_model.config
    assert cfg.model_type == "llama"
    assert cfg.head_dim in (64, 128)
    assert cfg.num_attention_heads * cfg.head_dim == cfg.hidden_size
    assert cfg.num_attention_heads > cfg.num_key_value_heads  # GQA
    assert cfg.max_position_embeddings >= 512
    assert 4096 <= cfg.vocab_size <= 8192
    n_params = sum(p.numel() for p in hf_model.parameters())
    assert 1_000_000 <= n_params <= 10_000_000


def test_heldout_perplexity_is_far_below_random(hf_model, tokenizer):
    ids = heldout_ids(tokenizer)
    assert ids.numel() == EVAL_TOKENS
    trained = perplexity(hf_model, ids)
    # A model that knows nothing sits near the vocabulary size; check that the bound is
    # meaningful by measuring a freshly initialised model of the same shape.
    torch.manual_seed(0)
    untrained = transformers.LlamaForCausalLM(hf_model.config).eval()
    assert perplexity(untrained, ids[:1024]) > hf_model.config.vocab_size / 4
    assert trained < hf_model.config.vocab_size / 20, trained
    assert trained < 50, trained  # measured 42.4 (MODEL_CARD.md)


@pytest.mark.parametrize(
    "text",
    [
        "And God said, Let there be light: and there was light.",
        "Hello, world!  Two spaces, a tab\tand a new line\n",
        "Numbers 3.14159 and 2026; odd words: zyxt, naïve café, 東京, emoji 🙂.",
        "",
    ],
)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    with_bos = tokenizer(text)["input_ids"]
    assert with_bos[0] == tokenizer.bos_token_id and with_bos[1:] == ids


def test_chat_template_renders(tokenizer, hf_model):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "A small model."},
        {"role": "user", "content": "Hello"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|system|>Be brief.<|end|><|user|>Who are you?<|end|>"
        "<|assistant|>A small model.<|end|><|user|>Hello<|end|><|assistant|>"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert ids.count(tokenizer.eos_token_id) == 4  # the end-of-turn token is the EOS


def test_eos_ids_agree(tokenizer, hf_model):
    tok_cfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    gen_cfg = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert "chat_template" in tok_cfg
    eos = tokenizer.convert_tokens_to_ids(tok_cfg["eos_token"])
    assert eos == tokenizer.eos_token_id
    assert eos in gen_cfg["eos_token_id"]
    assert eos in hf_model.config.eos_token_id
    assert gen_cfg["bos_token_id"] == tokenizer.bos_token_id


def test_chat_reply_ends_with_end_of_turn(hf_model, tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who are you?"}], add_generation_prompt=True
    )["input_ids"]
    out = hf_model.generate(
        torch.tensor([prompt]),
        max_new_tokens=64,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    reply = out[0, len(prompt) :].tolist()
    assert reply[-1] == tokenizer.eos_token_id, tokenizer.decode(reply)
    assert len(tokenizer.decode(reply, skip_special_tokens=True).split()) >= 3


# --- slimserve's engine on the same checkpoint -------------------------------------------

TEXT_PROMPTS = ["And God said,", "Now the king of Babylon sent", "Peace be"]
CHAT = [{"role": "user", "content": "Who are you?"}]


@pytest.fixture(scope="module")
def llm():
    from app import LLM

    return LLM(model=str(MODEL_DIR), dtype="float32", device="cpu")


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain argmax decoding with full recomputation: no cache, no EOS handling."""
    ids = torch.tensor([prompt])  # [1, S]
    for _ in range(n):
        next_id = model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_slimserve_tokenizes_like_transformers(llm, tokenizer):
    for text in TEXT_PROMPTS:
        assert llm.tokenizer.encode(text) == tokenizer(text)["input_ids"]
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    assert llm.tokenizer.encode_chat(CHAT) == chat


def test_slimserve_greedy_matches_transformers(llm, hf_model, tokenizer):
    from app import SamplingParams

    prompts = [tokenizer(t)["input_ids"] for t in TEXT_PROMPTS]
    prompts.append(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_model, prompt, 16), tokenizer.decode(prompt)


def test_slimserve_seeded_sampling_is_deterministic(llm, tokenizer):
    from app import SamplingParams

    prompts = [tokenizer(t)["input_ids"] for t in TEXT_PROMPTS]

    def sample(batch, seed):
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=16)
        return [out.token_ids for out in llm.generate(batch, params)]

    first = sample(prompts, seed=1234)
    assert sample(prompts, seed=1234) == first
    assert sample(prompts[1:2], seed=1234) == first[1:2]  # independent of batch neighbours
    assert sample(prompts, seed=4321) != first
