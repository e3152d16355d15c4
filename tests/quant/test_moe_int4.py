"""INT4 experts (and MLA projections) in the MoE families, against their dequantized twins."""

import pytest
import torch
import transformers

from app import LLM
from app.models.layers import pack_cpu_linears
from app.quant.int4_linear import Int4Linear
from app.quant.quantize_cli import quantize_checkpoint
from tiny_models import make_tokenizer

IDS = list(range(10, 47))
MOE = dict(
    vocab_size=320,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    max_position_embeddings=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
)
FAMILIES = {
    "Glm4Moe": dict(num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5),
    "DeepseekV3": dict(
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=64,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_path(request, tmp_path_factory):
    name = request.param
    cfg = getattr(transformers, f"{name}Config")(**MOE, **FAMILIES[name])
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    out = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(out)
    make_tokenizer(out, 320)
    return out


def twin_logits(quant: LLM, dense_path: str) -> torch.Tensor:
    """The dense model with every INT4 layer's dequantized weight copied in."""
    twin = LLM(dense_path, dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    modules = dict(twin.engine.model.named_modules())
    for name, m in quant.engine.model.named_modules():
        if isinstance(m, Int4Linear):
            modules[name].weight.data.copy_(m.dequantized_weight())
    pack_cpu_linears(twin.engine.model)  # the C++ linear's panels are a copy: repack
    return twin.engine.score(IDS)


def test_int4_checkpoint_of_a_moe_model_matches_its_twin(moe_path, tmp_path):
    report = quantize_checkpoint(moe_path, str(tmp_path / "q"), "rtn", 32, symmetric=False)
    assert any(".experts." in m for m in report.quantized)
    assert any(m.endswith("mlp.gate") for m in report.ignored)  # the router stays dense
    quant = LLM(str(tmp_path / "q"), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    names = [n for n, m in quant.engine.model.named_modules() if isinstance(m, Int4Linear)]
    assert "model.layers.1.mlp.experts.7.down_proj" in names
    torch.testing.assert_close(
        quant.engine.score(IDS), twin_logits(quant, moe_path), atol=2e-4, rtol=1e-4
    )


def test_weight_quant_int4_on_load_quantizes_experts(moe_path):
    quant = LLM(
        moe_path, dtype="float32", device="cpu", weight_quant="int4", kv_cache_memory_bytes=8 << 20
    )
    experts = quant.engine.model.model.layers[1].mlp.experts
    assert all(isinstance(e.gate_up_proj, Int4Linear) for e in experts)
    torch.testing.assert_close(
        quant.engine.score(IDS), twin_logits(quant, moe_path), atol=2e-4, rtol=1e-4
    )
