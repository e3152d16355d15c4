"""Tiny random checkpoints of each supported family, saved with `save_pretrained`.

Each gets a small byte-level BPE tokenizer.json trained here, so text paths are exercised
with a real `tokenizers` tokenizer.
"""

from __future__ import annotations

import json
import os

import torch

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
}

# Renders an assistant turn's tool calls and a tool turn's call id (as real templates do),
# so tests can see that both APIs hand them to the template.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}] {% endif %}{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.id }} {{ c.function.name }}"
    " {{ c.function.arguments }}>{% endfor %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(out: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["the quick brown fox jumps over the lazy dog", "hello world, héllo wörld ☃"] * 50
    tok.train_from_iterator(text, trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}, f)


def make_checkpoint(family: str, out: str, seed: int = 0, **overrides) -> str:
    config_name, model_name, extra = FAMILIES[family]
    return save_random_model(config_name, model_name, {**COMMON, **extra, **overrides}, out, seed)


def save_random_model(config_name: str, model_name: str, kwargs: dict, out: str, seed: int) -> str:
    """A randomly initialised transformers model + a tiny tokenizer, saved to out (the one
    checkpoint builder the dense, MoE and MTP test checkpoints share)."""
    import transformers

    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    # Random init leaves tiny weights; widen them so logits and routing have real spread.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    model.save_pretrained(out)
    make_tokenizer(out, config.vocab_size)
    return out
