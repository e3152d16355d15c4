"""DeepseekV3ForCausalLM (DeepSeek-V3 / Kimi K2: MLA + MoE) against transformers (float32, CPU),
and the MLA KV cache through paging, FP8, chunk export/import and layout checks."""

import logging

import pytest
import torch

from app import LLM, SamplingParams
from app.config import CacheConfig, EngineConfig
from app.engine.engine import Engine
from app.engine.request import Request
from app.kv.chunk import ChunkMismatchError, KVChunk
from app.kv.layout import KVLayout
from app.quant import Int4Linear
from models.moe_checkpoints import (
    PROMPTS,
    hf_greedy,
    hf_logits,
    hf_model,
    int4_experts_checkpoint,
    logit_errors,
    make_moe_checkpoint,
    teacher_forced_agreement,
)

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SCORED = PROMPTS[2]
WIDTH = 64 + 8  # kv_lora_rank + qk_rope_head_dim: the one cached "head"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_moe_checkpoint("deepseek_v3", str(tmp_path_factory.mktemp("deepseek_v3")))


@pytest.fixture(scope="module")
def full(path):
    return LLM(path, dtype="float32", device="cpu")


def paged_llm(path, **kw):
    # Small block and prefill chunk: paging across blocks, chunked prefill, batching.
    kw = dict(block_size=4, long_prefill_chunk=8, max_num_batched_tokens=24) | kw
    return LLM(path, dtype="float32", device="cpu", **kw)


def test_logits_match_transformers(path, full):
    # measured max |diff| 3e-6 on logits of max magnitude 3.9 (YaRN, q LoRA, absorbed MLA)
    ref = hf_logits(hf_model(path), SCORED)
    torch.testing.assert_close(full.engine.score(SCORED), ref, atol=1e-4, rtol=1e-4)


def test_logits_match_transformers_without_q_lora(tmp_path):
    # DeepSeek-V2-Lite style: plain q_proj; default RoPE, not interleaved.
    rope = dict(rope_type="default", rope_theta=10000.0)
    p = make_moe_checkpoint(
        "deepseek_v3", str(tmp_path), q_lora_rank=None, rope_parameters=rope, rope_interleave=False
    )
    ours = LLM(p, dtype="float32", device="cpu").engine.score(PROMPTS[1])
    torch.testing.assert_close(ours, hf_logits(hf_model(p), PROMPTS[1]), atol=1e-4, rtol=1e-4)


def test_yarn_matches_transformers_at_kimi_k2_values():
    """Kimi K2's published rope_scaling (beta_fast = beta_slow = 1, factor 32, 64 rope dims)."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from app.models.mla_rope import mla_inv_freq, softmax_mscale

    rope = dict(
        rope_type="yarn",
        rope_theta=50000.0,
        factor=32.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        original_max_position_embeddings=4096,
        beta_fast=1.0,
        beta_slow=1.0,
    )
    cfg = DeepseekV3Config(max_position_embeddings=131072, rope_parameters=rope)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    freq, factor = mla_inv_freq(64, 50000.0, rope, 131072)
    torch.testing.assert_close(freq, want_freq, atol=0, rtol=1e-6)
    assert factor == want_factor == 1.0
    scale = 192**-0.5 * softmax_mscale(rope)
    assert scale == pytest.approx(yarn_apply_mscale(cfg.rope_parameters, 192**-0.5), rel=1e-12)
    assert scale > 192**-0.5 * 1.7  # mscale(32, 1.0)**2 = 1.80: a real change


def test_greedy_batch_matches_transformers_generate(path):
    llm = paged_llm(path)
    spec = llm.engine.kv_spec
    assert (spec.use_mla, spec.num_kv_heads, spec.head_dim) == (True, 1, WIDTH)
    assert llm.engine.cache.kv.shape[:2] == (3, 1)  # one plane per layer: no separate V
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(hf_model(path), PROMPTS, NEW_TOKENS)
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_mla_cache_bytes_per_token(full):
    bf16 = full.engine.kv_spec.__class__(3, 1, WIDTH, 16, torch.bfloat16, use_mla=True)
    fp8 = full.engine.kv_spec.__class__(3, 1, WIDTH, 16, torch.float8_e4m3fn, use_mla=True)
    assert bf16.bytes_per_token() == 3 * WIDTH * 2
    assert fp8.bytes_per_token() == 3 * (WIDTH + 1)  # + one int8 scale exponent per token


def test_fp8_kv_cache_within_bounds(path, full):
    fp8 = paged_llm(path, kv_cache_dtype="fp8_e4m3")
    assert fp8.engine.cache.scales.shape[:2] == (3, 1)
    mean_err, kl, top1 = logit_errors(fp8.engine.score(SCORED), full.engine.score(SCORED))
    # Measured: mean |err| 6.8% of the logits' std, KL 6.3e-3, top-1 92%. With every layer
    # dense the same cache gives 3.2% / 7e-4 / 100%: MoE routing flips amplify the error.
    assert mean_err < 0.12 and kl < 0.012 and top1 >= 0.8
    assert teacher_forced_agreement(fp8, full, PROMPTS, GREEDY) >= 0.8  # measured 0.94


def test_int4_experts_within_bounds(path, full, tmp_path):
    llm = paged_llm(int4_experts_checkpoint(path, str(tmp_path / "int4")))
    mods = dict(llm.engine.model.named_modules())
    assert isinstance(mods["model.layers.1.mlp.experts.0.gate_up_proj"], Int4Linear)
    assert isinstance(mods["model.layers.2.mlp.experts.15.down_proj"], Int4Linear)
    assert not isinstance(mods["model.layers.1.mlp.shared_experts.gate_up_proj"], Int4Linear)
    assert not isinstance(mods["model.layers.1.self_attn.kv_b_proj"], Int4Linear)
    mean_err, kl, top1 = logit_errors(llm.engine.score(SCORED), full.engine.score(SCORED))
    # Measured (RTN, group 32, symmetric, as Kimi K2): mean |err| 9.0% of std, KL 6.8e-3,
    # top-1 80%.
    assert 0 < mean_err < 0.15 and kl < 0.014 and top1 >= 0.7
    assert teacher_forced_agreement(llm, full, PROMPTS, GREEDY) >= 0.7  # measured 0.83


def engine(path, kv_dtype="fp8_e4m3") -> Engine:
    cache = CacheConfig(
        block_size=4, kv_cache_dtype=kv_dtype, kv_cache_memory_bytes=1 << 20, chunk_tokens=16
    )
    return Engine(EngineConfig(model=path, dtype="float32", device="cpu", cache=cache))


def run(eng: Engine, request: Request):
    eng.add_request(request)
    deltas = []
    while eng.has_unfinished():
        deltas += eng.step()
    return deltas


def test_mla_chunk_accepted_by_mla_engine_rejected_by_gqa_engine(path, llama_path, caplog):
    prompt = PROMPTS[2]  # 61 tokens: 3 chunks of 16 + a partial of 13
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [t for d in run(engine(path), Request("ref", prompt, params)) for t in d.new_token_ids]
    first, done = run(engine(path), Request("p", prompt, params, prefill_only=True))
    chunks = [KVChunk.decode(c.encode()) for c in done.exported_chunks]  # across processes
    layout = chunks[0].meta.layout
    assert layout.endswith(":mla") and KVLayout.parse(layout).use_mla
    assert chunks[0].to_tensors()[0].shape == (3, 1, 16, 1, WIDTH)  # [L, 1 plane, n, 1, D]

    decode = engine(path)
    rest = run(decode, Request("d", prompt + first.new_token_ids, params, kv_import=chunks))
    assert rest[0].num_cached_tokens == 60  # 3 chunks + 3 whole blocks of the partial one
    got = first.new_token_ids + [t for d in rest for t in d.new_token_ids]
    assert got[: params.max_tokens] == want

    gqa = engine(llama_path)  # a GQA model (4 q / 2 KV heads): two planes, no ':mla'
    with pytest.raises(ChunkMismatchError, match=r"layout is '.*:mla', expected"):
        KVChunk.decode(chunks[0].encode(), expected_layout=gqa.kv_spec.layout)
    with caplog.at_level(logging.WARNING, logger="app.engine.kv_transfer"):
        rest = run(gqa, Request("g", prompt, params, kv_import=chunks))
    assert rest[0].num_cached_tokens == 0  # nothing imported; the prompt was computed
    assert ":mla" in caplog.text and "kv_import" in caplog.text


@pytest.mark.triton
def test_triton_attention_serves_the_mla_cache(path):
    """The Triton paged kernels (interpreter here) on MLA's one-plane FP8 cache: Hkv = 1,
    D = 72 (padded in-kernel), V read from K's plane; prefill and decode."""
    pytest.importorskip("triton")
    ref, tri = (
        paged_llm(path, kv_cache_dtype="fp8_e4m3", attention_backend=b)
        for b in ("reference", "triton")
    )
    want = ref.engine.score(PROMPTS[0])
    # measured max |diff| 3e-6 (same e4m3 bits: kv_write is bit-exact with the reference)
    torch.testing.assert_close(tri.engine.score(PROMPTS[0]), want, atol=1e-4, rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = tri.generate([PROMPTS[0]], params)[0].token_ids  # 2 blocks of 4: paged decode
    assert got == ref.generate([PROMPTS[0]], params)[0].token_ids
