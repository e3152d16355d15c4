"""Published quantized checkpoint formats load and match their dequantized reference."""

import json
import shutil

import pytest
import torch

from app import LLM, SamplingParams
from app.models.layers import pack_cpu_linears
from app.quant.int4_linear import Int4Linear
from quant.builders import (
    hf_dequantized_logits,
    hf_logits,
    make_awq,
    make_compressed_tensors,
    make_fp8_block,
    make_gptq,
)

IDS = list(range(10, 47))
ATOL = 2e-4  # float32 end to end; observed ~2e-6
KV_BYTES = 8 << 20


def score(path: str, **kw) -> tuple[LLM, torch.Tensor]:
    llm = LLM(path, dtype="float32", device="cpu", kv_cache_memory_bytes=KV_BYTES, **kw)
    return llm, llm.engine.score(IDS)


def int4_modules(llm: LLM) -> list[Int4Linear]:
    return [m for m in llm.engine.model.modules() if isinstance(m, Int4Linear)]


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_pack_quantized_matches_library(llama_path, tmp_path, symmetric):
    path = make_compressed_tensors(llama_path, str(tmp_path / "ct"), symmetric, group_size=32)
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "pack-quantized"
    llm, ours = score(path)
    mods = int4_modules(llm)
    assert len(mods) == 8  # qkv, o, gate_up, down x 2 layers
    assert all((m.zeros is None) == symmetric and m.group_size == 32 for m in mods)
    torch.testing.assert_close(ours, hf_dequantized_logits(path, IDS), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize(
    "kwargs,int4",
    [
        (dict(symmetric=True, group_size=None), True),  # channel-wise INT4: group = K
        (
            dict(symmetric=True, group_size=None, num_bits=8, kind="float", fmt="float-quantized"),
            False,
        ),
        (dict(symmetric=False, group_size=None, num_bits=8, fmt="naive-quantized"), False),
    ],
    ids=["int4-channel", "fp8-float-quantized", "int8-naive-quantized"],
)
def test_other_compressed_tensors_formats_match_library(llama_path, tmp_path, kwargs, int4):
    path = make_compressed_tensors(llama_path, str(tmp_path / "ct"), **kwargs)
    llm, ours = score(path)
    assert len(int4_modules(llm)) == (8 if int4 else 0)
    torch.testing.assert_close(ours, hf_dequantized_logits(path, IDS), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_layout_matches_dequantized_twin(llama_path, tmp_path, desc_act):
    path, twin = make_gptq(llama_path, str(tmp_path / "q"), str(tmp_path / "t"), 32, desc_act)
    llm, ours = score(path)
    assert all((m.perm is not None) == desc_act for m in int4_modules(llm))
    torch.testing.assert_close(ours, hf_logits(twin, IDS), atol=ATOL, rtol=1e-4)


def test_awq_gemm_layout_matches_dequantized_twin(llama_path, tmp_path):
    path, twin = make_awq(llama_path, str(tmp_path / "q"), str(tmp_path / "t"), 64)
    llm, ours = score(path)
    assert {m.group_size for m in int4_modules(llm)} == {64}
    torch.testing.assert_close(ours, hf_logits(twin, IDS), atol=ATOL, rtol=1e-4)


def test_fp8_block_scaled_matches_twin_and_converts_to_int4(llama_path, tmp_path):
    path, twin = make_fp8_block(llama_path, str(tmp_path / "q"), str(tmp_path / "t"))
    ref = hf_logits(twin, IDS)
    llm, ours = score(path)
    assert not int4_modules(llm)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=1e-4)
    llm4, ours4 = score(path, weight_quant="int4")
    assert len(int4_modules(llm4)) == 8
    # INT4 of a random tiny model: close in distribution, not bitwise
    logp, logq = ours4.log_softmax(-1), ref.log_softmax(-1)
    kl = (logq.exp() * (logq - logp)).sum(-1).mean()
    assert 0 < float(kl) < 0.05


def test_int4_model_generates_like_its_dequantized_twin(llama_path):
    quant = LLM(llama_path, dtype="float32", device="cpu", weight_quant="int4")
    twin = LLM(llama_path, dtype="float32", device="cpu")
    modules = dict(twin.engine.model.named_modules())
    for name, m in quant.engine.model.named_modules():
        if isinstance(m, Int4Linear):
            modules[name].weight.data.copy_(m.dequantized_weight())
    pack_cpu_linears(twin.engine.model)  # the C++ linear's panels are a copy: repack
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 17, 42, 99, 3], list(range(10, 40))]
    a = [o.token_ids for o in quant.generate(prompts, params)]
    b = [o.token_ids for o in twin.generate(prompts, params)]
    assert len(int4_modules(quant)) == 8 and not int4_modules(twin)
    assert a == b


def _with_config(src: str, dst, quantization_config: dict) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize(
    "qcfg,message",
    [
        (
            {"quant_method": "bitsandbytes"},
            "unsupported quantization_config quant_method='bitsandbytes'",
        ),
        ({"quant_method": "gptq", "bits": 8}, "GPTQ with bits=8"),
        ({"quant_method": "awq", "bits": 4, "version": "exllama"}, "version='exllama'"),
        ({"quant_method": "fp8"}, "needs weight_block_size"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 64}, "group_size=64 does not fit"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32}, "no tensor ends in .qweight"),
    ],
)
def test_bad_quantization_config_is_a_clear_error(llama_path, tmp_path, qcfg, message):
    src, _ = make_gptq(llama_path, str(tmp_path / "q"), str(tmp_path / "t"), 32, False)
    if qcfg.get("quant_method") == "awq" and qcfg.get("group_size") == 32:
        src = llama_path  # a dense checkpoint claiming to be AWQ
    path = _with_config(src, tmp_path / "bad", qcfg)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", device="cpu")


def test_compressed_tensors_activation_quantization_is_rejected(llama_path, tmp_path):
    w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    act = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
    group = {"targets": ["Linear"], "weights": w, "input_activations": act}
    qcfg = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    qcfg["config_groups"] = {"group_0": group}
    path = _with_config(llama_path, tmp_path / "bad", qcfg)
    with pytest.raises(ValueError, match="only W4A16"):
        LLM(path, dtype="float32", device="cpu")
