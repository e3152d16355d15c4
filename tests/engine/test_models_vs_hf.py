"""Our models against Hugging Face transformers on tiny random checkpoints (float32)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from app import LLM, SamplingParams

PROMPTS = [
    [5, 17, 42, 99, 3],
    list(range(10, 47)),
    [7] + [i % 300 + 3 for i in range(60)],
]


def hf_model(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def test_logits_match_transformers(family_path):
    llm = LLM(family_path, dtype="float32", device="cpu")
    ids = PROMPTS[1]
    ours = llm.engine.score(ids)
    with torch.no_grad():
        ref = hf_model(family_path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_greedy_batch_matches_transformers_generate(family_path):
    # Small token budget and prefill chunk: exercises chunked prefill, paging across
    # blocks and continuous batching of prompts of different lengths.
    llm = LLM(
        family_path,
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=24,
        long_prefill_chunk=8,
        block_size=4,
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    model = hf_model(family_path)
    for prompt, out in zip(PROMPTS, outs):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
        assert out.token_ids == ref[0, len(prompt) :].tolist()
        assert out.finish_reason == "length"
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_repetition_penalty_matches_transformers(llama_path):
    llm = LLM(llama_path, dtype="float32", device="cpu")
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5)
    out = llm.generate([prompt], params)[0]
    ref = hf_model(llama_path).generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False, repetition_penalty=1.5
    )
    assert out.token_ids == ref[0, len(prompt) :].tolist()


def test_unknown_architecture_is_a_clear_error(tmp_path, llama_path):
    import json
    import shutil

    shutil.copytree(llama_path, tmp_path / "m")
    cfg_file = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["architectures"] = ["FancyForCausalLM"]
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'FancyForCausalLM'.*Llama"):
        LLM(str(tmp_path / "m"), device="cpu")


def test_bfloat16_weights_track_float32(llama_path):
    ids = PROMPTS[1]
    ref = LLM(llama_path, dtype="float32", device="cpu").engine.score(ids)
    bf16 = LLM(llama_path, dtype="bfloat16", device="cpu").engine.score(ids)
    assert bf16.dtype == torch.float32  # logits are always float32
    assert (bf16.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert (bf16 - ref).abs().mean() < 0.1 * ref.std()


def test_sharded_checkpoint_loads(llama_path, tmp_path):
    import glob
    import shutil

    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{llama_path}/{name}", tmp_path)
    assert len(glob.glob(f"{tmp_path}/*.safetensors")) > 1
    sharded = LLM(str(tmp_path), dtype="float32", device="cpu").engine.score(PROMPTS[0])
    single = LLM(llama_path, dtype="float32", device="cpu").engine.score(PROMPTS[0])
    torch.testing.assert_close(sharded, single)
