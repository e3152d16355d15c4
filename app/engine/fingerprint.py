"""A model fingerprint: KV computed by one model/precision is never reused by another."""

from __future__ import annotations

import glob
import json
import os

import torch
import xxhash


def model_fingerprint(path: str, dtype: torch.dtype, weight_quant: str | None) -> str:
    """xxh3_64 over config.json, the weight files' names and sizes, dtype and quantization.

    Hashing every weight byte would cost seconds per GB at start-up; names and sizes change
    whenever a checkpoint is replaced in practice, and config.json pins the architecture.
    """
    h = xxhash.xxh3_64()
    with open(os.path.join(path, "config.json"), "rb") as f:
        h.update(f.read())
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        h.update(f"{os.path.basename(file)}:{os.path.getsize(file)};".encode())
    h.update(f"{dtype}|{weight_quant}".encode())
    return h.hexdigest()


def eos_token_ids(path: str, config_eos: tuple[int, ...], tokenizer_eos: tuple[int, ...]):
    """Union of the eos ids in config.json, generation_config.json and the tokenizer."""
    ids = set(config_eos) | set(tokenizer_eos)
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    return tuple(sorted(ids))
