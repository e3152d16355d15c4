"""slimserve: serve LLMs smaller (FP8 KV, INT4 weights), faster and safer.

The public names load lazily, so importing a light submodule (the gRPC servicer in Serve's
proxy, the configs) does not pull in torch and the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": "app.engine.llm",
    "RequestOutput": "app.engine.request",
    "SamplingParams": "app.engine.sampling_params",
}
__all__ = ["LLM", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from app.engine.llm import LLM
    from app.engine.request import RequestOutput
    from app.engine.sampling_params import SamplingParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'app' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
