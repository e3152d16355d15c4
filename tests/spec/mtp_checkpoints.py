"""Tiny GLM-4.5 / DeepSeek-V3 checkpoints with one multi-token-prediction layer, and an
independent reference of that layer built on the transformers model.

transformers does not build MTP layers, so the checkpoint is made with L + 1 decoder layers
(the last one becomes the MTP layer's decoder block), its config is rewritten to L layers
and `num_nextn_predict_layers: 1`, and the MTP front end (enorm, hnorm, eh_proj,
shared_head.norm) plus the checkpoint's copies of the embedding and head are added in a
second shard, named as in the released checkpoints (`model.layers.{L}.*`).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from transformers.masking_utils import create_causal_mask

from tests.models.moe_checkpoints import hf_model, make_moe_checkpoint

LAYERS = 3


def make_mtp_checkpoint(family: str, out: str, seed: int = 0):
    """-> (path, reference): reference(ids) = MTP logits [len(ids) - 1, V] from HF."""
    make_moe_checkpoint(family, out, seed, num_hidden_layers=LAYERS + 1)
    hf = hf_model(out)  # L + 1 layers
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    h = cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed + 1)
    p = f"model.layers.{LAYERS}"
    extra = {
        f"{p}.enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        f"{p}.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        f"{p}.eh_proj.weight": 0.08 * torch.randn(h, 2 * h, generator=g),
        f"{p}.shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        f"{p}.embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone(),
        f"{p}.shared_head.head.weight": hf.lm_head.weight.detach().clone(),
    }
    save_file(extra, os.path.join(out, "mtp.safetensors"))
    hf.config.num_hidden_layers = LAYERS  # the main model's forward stops before the MTP layer
    return out, lambda ids, drafts=(): hf_mtp_logits(hf, extra, p, ids, list(drafts))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def hf_mtp_logits(hf, w: dict, p: str, ids: list[int], drafts: list[int]) -> torch.Tensor:
    """MTP logits at positions 0 .. len(ids) - 2 + len(drafts): position i reads token i + 1
    and the main hidden state at i; past the end it reads the drafts and its own previous
    output (the recursion a proposer runs)."""
    eps = hf.config.rms_norm_eps
    main = hf.model(torch.tensor([ids])).last_hidden_state[0]  # [n, H], normed
    tokens = torch.tensor(ids[1:] + drafts)
    prev = main[:-1]
    layer = hf.model.layers[LAYERS]
    for _ in range(len(drafts) + 1):
        n = len(prev)
        e = _rms(hf.model.embed_tokens(tokens[:n]), w[f"{p}.enorm.weight"], eps)
        x = torch.cat([e, _rms(prev, w[f"{p}.hnorm.weight"], eps)], -1) @ w[f"{p}.eh_proj.weight"].T
        pos = torch.arange(n)[None]
        mask = create_causal_mask(
            config=hf.config,
            inputs_embeds=x[None],
            attention_mask=None,
            cache=None,
            position_ids=pos,
        )
        out = layer(
            x[None],
            attention_mask=mask,
            position_ids=pos,
            position_embeddings=hf.model.rotary_emb(x[None], pos),
        )
        out = (out[0] if isinstance(out, tuple) else out)[0]  # [n, H]
        if n == len(tokens):
            break
        prev = torch.cat([prev, out[-1:]])  # recursion: own output at the last position
    return hf.lm_head(_rms(out, w[f"{p}.shared_head.norm.weight"], eps))
