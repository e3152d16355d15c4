"""slimserve: serve LLMs smaller (FP8 KV, INT4 weights), faster and safer."""

from app.engine.llm import LLM
from app.engine.request import RequestOutput
from app.engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
