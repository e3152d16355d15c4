"""app/models/layers.py: the CPU weight layout (column_major_linears)."""

from __future__ import annotations

import pytest
import torch

from app.models.layers import ParallelLMHead, RMSNorm, column_major_linears
from app.models.loader import load_model
from tiny_models import make_checkpoint


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return make_checkpoint("llama", str(tmp_path_factory.mktemp("llama")), head_dim=32)


def _logits(model, ids: list[int]) -> torch.Tensor:
    """A whole-prompt forward without the KV cache: attention is plain causal SDPA."""

    def attn(layer, q, k, v):  # q [T, Hq, D], k/v [T, Hkv, D]
        g = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(g, 1).transpose(0, 1) for x in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k, v, is_causal=True
        )
        return out.transpose(0, 1)

    with torch.inference_mode():
        t = torch.tensor(ids)
        return model.compute_logits(model(t, torch.arange(len(ids)), attn))


def test_column_major_linears_moves_layout_not_values(llama_path):
    """Seen failing: with the `w.data = ...` line removed, nothing is column-major; with
    `.t().contiguous()` (no transpose back) the shapes and logits are wrong."""
    model, _ = load_model(llama_path, torch.float32, "cpu")
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    ids = [5, 17, 42, 99, 3, 7, 8, 9, 10, 11]
    ref = _logits(model, ids)

    moved = column_major_linears(model)

    linears = [n for n in params if n.endswith("_proj.weight") or n == "lm_head.weight"]
    assert moved == len(linears) > 0
    for name, p in model.named_parameters():
        assert p is params[name]  # the same Parameter objects (loaders, tied weights)
        assert torch.equal(p, before[name]) and p.shape == before[name].shape
        if p.dim() == 2:  # linears: W.t() contiguous; the embedding table: rows contiguous
            assert p.t().is_contiguous() == (name in linears) != p.is_contiguous(), name
    torch.testing.assert_close(_logits(model, ids), ref, atol=1e-5, rtol=1e-5)
    assert column_major_linears(model) == 0  # idempotent: already column-major


def test_tied_tables_and_narrow_dtypes_keep_their_layout(llama_path):
    model, cfg = load_model(llama_path, torch.float32, "cpu")
    head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
    head.weight = model.model.embed_tokens.weight  # tied: an embedding gathers its rows
    model.lm_head = head
    column_major_linears(model)
    assert model.model.embed_tokens.weight.is_contiguous()
    bf16, _ = load_model(llama_path, torch.bfloat16, "cpu")
    assert column_major_linears(bf16) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_hf_formula(dtype):
    """float32 goes through F.rms_norm, narrower dtypes through the written-out form."""
    norm = RMSNorm(64, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = (torch.randn(5, 3, 64) * 4).to(dtype)
    xf = x.float()
    ref = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    out = norm(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
