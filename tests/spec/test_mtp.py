"""MTP speculation on tiny GLM-4.5 and DeepSeek-V3 checkpoints with one MTP layer.

1. The loaded MTP layer gives the same logits as an independent reference built on the
   transformers model's own decoder layer (tests/spec/mtp_checkpoints.py).
2. With MTP speculation the engine's greedy output equals plain decoding, and every draft
   it verified is exactly what the reference MTP drafts from that context (so the paged
   catch-up, positions and recursion are right, not only the final tokens). Seen failing:
   feeding the MTP token i instead of i + 1 (catch-up ids off by one) broke the draft check
   while the greedy output stayed equal (which is why the drafts are checked).
"""

import pytest
import torch
import torch.nn.functional as F

from app import LLM, SamplingParams
from app.engine.spec.speculator import Speculator
from app.quant.load import load_model
from tests.spec.mtp_checkpoints import make_mtp_checkpoint

PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 47)), [7, 8, 9, 7, 8, 9, 7, 8]]


@pytest.fixture(scope="module", params=["glm4_moe", "deepseek_v3"])
def checkpoint(request, tmp_path_factory):
    return make_mtp_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))


def dense_attention(scale: float):
    """attn(layer, q, k, v) for one whole causal sequence (no cache): q [T, Hq, D]."""

    def attn(layer, q, k, v):
        v = k if v is None else v  # MLA: the latent is key and value
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
        )
        return o.transpose(0, 1)

    return attn


def our_mtp_logits(model, ids: list[int]) -> torch.Tensor:
    attn = dense_attention(getattr(model, "attn_scale", None) or model.config.head_dim**-0.5)
    t = torch.tensor(ids)
    h = model(t, torch.arange(len(ids)), attn)
    layer = model.mtp.layers[0]
    embeds = model.model.embed_tokens(t[1:])
    out = layer.predict(torch.arange(len(ids) - 1), embeds, h[:-1], attn)
    return model.compute_logits(layer.shared_head.norm(out))


@torch.no_grad()
def test_mtp_layer_matches_the_transformers_reference(checkpoint):
    path, reference = checkpoint
    model, _ = load_model(path, torch.float32, "cpu", mtp=True)
    for ids in PROMPTS:
        ours, ref = our_mtp_logits(model, ids), reference(ids)
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max() < 1e-3 * ref.abs().max()


def test_mtp_greedy_equal_and_drafts_exact(checkpoint, monkeypatch):
    path, reference = checkpoint
    seen = []
    verify = Speculator.verify

    def record(self, logits, seqs):
        seen.extend((list(s.token_ids), list(s.spec_tokens)) for s in seqs if s.spec_tokens)
        return verify(self, logits, seqs)

    monkeypatch.setattr(Speculator, "verify", record)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = LLM(path, dtype="float32", device="cpu").generate(PROMPTS, p)
    spec = LLM(
        path,
        dtype="float32",
        device="cpu",
        speculative_config={"method": "mtp", "num_speculative_tokens": 3, "backoff": False},
    )
    got = spec.generate(PROMPTS, p)
    assert [o.token_ids for o in got] == [o.token_ids for o in base]
    assert len(seen) >= len(PROMPTS) * 3
    for ids, drafts in seen[:: max(1, len(seen) // 8)]:  # a spread of steps
        logits = reference(ids, drafts[:-1])
        n = len(ids)
        assert logits[n - 2 : n - 2 + len(drafts)].argmax(-1).tolist() == drafts
    stats = spec.stats()
    assert stats["spec_proposed_tokens"] >= stats["spec_accepted_tokens"]


def test_mtp_on_a_family_without_mtp_layers_is_refused(llama_path):
    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        LLM(llama_path, dtype="float32", device="cpu", speculative_config={"method": "mtp"})
