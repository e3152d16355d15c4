"""FP8 weights stay FP8: block-scaled checkpoints, `weight_quant="fp8"`, TP slicing of scales."""

import pytest
import torch

from app import LLM
from app.models.layers import pack_cpu_linears
from app.models.parallel import TPContext
from app.quant.fp8_linear import Fp8Linear
from app.quant.int4_linear import Int4Linear
from app.quant.load import load_model
from quant.builders import hf_logits, make_fp8_block

IDS = list(range(10, 47))
ATOL = 2e-4  # float32 end to end


def fp8_modules(model) -> dict[str, Fp8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def score(path: str, **kw) -> tuple[LLM, torch.Tensor]:
    llm = LLM(path, dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, **kw)
    return llm, llm.engine.score(IDS)


@pytest.mark.parametrize("block", [(32, 32), (48, 32)], ids=["aligned", "unaligned-rows"])
def test_fp8_block_checkpoint_stays_fp8_and_matches_twin(llama_path, tmp_path, block):
    """(48, 32): 48-row blocks straddle q/k/v and gate/up shards, so those layers keep one
    scale row per weight row (block (1, 32)); down/o (64 rows) keep (48, 32)."""
    path, twin = make_fp8_block(llama_path, str(tmp_path / "q"), str(tmp_path / "t"), block)
    llm, ours = score(path)
    mods = fp8_modules(llm.engine.model)
    assert len(mods) == 8  # qkv, o, gate_up, down x 2 layers
    for name, m in mods.items():
        assert m.weight.dtype == torch.float8_e4m3fn and m.weight_scale_inv.dtype == torch.float32
        merged = name.endswith(("qkv_proj", "gate_up_proj"))
        want = (1, 32) if merged and block == (48, 32) else block
        assert m.block == want, (name, m.block)
    weights = {n: p.dtype for n, p in llm.engine.model.named_parameters() if "layers." in n}
    assert {d for n, d in weights.items() if n.endswith("proj.weight")} == {torch.float8_e4m3fn}
    torch.testing.assert_close(ours, hf_logits(twin, IDS), atol=ATOL, rtol=1e-4)


def test_fp8_checkpoint_tp_slices_scales_like_weights(llama_path, tmp_path):
    """Each rank's dequantized FP8 weight is exactly its slice of the TP=1 weight (merged q/k/v
    with a KV head per rank: unaligned -> per-row scales; gate/up, o, down: 32-row blocks).
    Seen failing: copying the scale rows into the buffer directly instead of through the
    layer's weight loader (so not sliced like the weight) in `_load_scale_rows`."""
    path, _ = make_fp8_block(llama_path, str(tmp_path / "q"), str(tmp_path / "t"), (32, 32))
    full, _ = load_model(path, torch.float32, "cpu")
    ref = {n: m.dequantized_weight() for n, m in fp8_modules(full).items()}
    for rank in range(2):
        model, _ = load_model(path, torch.float32, "cpu", TPContext(rank, 2))
        mods = fp8_modules(model)
        assert mods.keys() == ref.keys()
        for name, m in mods.items():
            w, n, k = ref[name], m.out_features, m.in_features
            if name.endswith(("o_proj", "down_proj")):  # row parallel: K slice
                want = w[:, rank * k : (rank + 1) * k]
            elif name.endswith("qkv_proj"):  # q | k | v, each sliced per rank
                q, kv = 64 // 2, 32 // 2
                parts = [w[:64][rank * q : (rank + 1) * q], w[64:96][rank * kv : (rank + 1) * kv]]
                want = torch.cat(parts + [w[96:][rank * kv : (rank + 1) * kv]])
            else:  # gate | up
                h = n // 2
                want = torch.cat(
                    [w[:128][rank * h : (rank + 1) * h], w[128:][rank * h : (rank + 1) * h]]
                )
            torch.testing.assert_close(m.dequantized_weight(), want, atol=0, rtol=0)


def test_weight_quant_fp8_quantizes_on_load(llama_path):
    """FP8 on load == the dense model given the dequantized FP8 weights (so the kernels and
    loaders are exact); the quantization itself costs a small KL (measured 1.2e-3)."""
    twin, ref = score(llama_path)
    llm, ours = score(llama_path, weight_quant="fp8")
    mods = fp8_modules(llm.engine.model)
    assert len(mods) == 8 and all(m.block == (128, 128) for m in mods.values())
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in mods.values())
    logp, logq = ours.log_softmax(-1), ref.log_softmax(-1)
    kl = float((logq.exp() * (logq - logp)).sum(-1).mean())
    assert 0 < kl < 0.02, kl
    modules = dict(twin.engine.model.named_modules())
    for name, m in mods.items():
        modules[name].weight.data.copy_(m.dequantized_weight())
    pack_cpu_linears(twin.engine.model)  # the C++ linear's panels are a copy: repack
    torch.testing.assert_close(ours, twin.engine.score(IDS), atol=ATOL, rtol=1e-4)


def test_int4_from_fp8_checkpoint_dequantizes_fp8_modules(llama_path, tmp_path):
    path, twin = make_fp8_block(llama_path, str(tmp_path / "q"), str(tmp_path / "t"))
    llm, _ = score(path, weight_quant="int4")
    model = llm.engine.model
    assert not fp8_modules(model)
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 8


def test_fp8_linear_cpu_forward_equals_dequantized_matmul():
    gen = torch.Generator().manual_seed(0)
    layer = Fp8Linear(72, 40, (32, 32), bias=True, params_dtype=torch.float32)
    w = (torch.randn(40, 72, generator=gen) * 50).to(torch.float8_e4m3fn)
    s = torch.exp2(torch.randint(-4, 3, (2, 3), generator=gen).float())
    layer.set_weight(w, s, torch.randn(40, generator=gen))
    x = torch.randn(3, 5, 72, generator=gen)
    want = x @ layer.dequantized_weight().T + layer.bias
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    assert layer.weight.dtype == torch.float8_e4m3fn  # forward did not replace the storage
