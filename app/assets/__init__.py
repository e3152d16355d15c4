"""Files shipped inside the package: the embedded default model and its held-out text.

The model folder is a standard Hugging Face `LlamaForCausalLM` checkpoint made by
`scripts/train_default_model.py`; see `default_model/MODEL_CARD.md`.
"""

from __future__ import annotations

from pathlib import Path

_DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"


def default_model_path() -> str:
    """Path of the embedded default model (the default `--model`)."""
    return str(_DEFAULT_MODEL_DIR)


def default_heldout_path() -> str:
    """Held-out evaluation text of the default model (never seen in training)."""
    return str(_DEFAULT_MODEL_DIR / "heldout.txt")
