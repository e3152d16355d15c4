"""Maps a checkpoint's `architectures[0]` to the class that implements it."""

from __future__ import annotations

from torch import nn

from app.models.deepseek_v3 import DeepseekV3ForCausalLM
from app.models.glm4_moe import Glm4MoeForCausalLM
from app.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,  # DeepSeek-V3/R1, Kimi K2
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,  # GLM-4.5/4.6/4.5-Air
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {supported}")
    return MODEL_REGISTRY[architecture]
