"""Loading any checkpoint, quantized ones included: the models' loader with app.quant's
converters plugged in (quantization sits above the models, so the loader cannot import it)."""

from __future__ import annotations

from app.models import loader
from app.models.parallel import SINGLE, TPContext
from app.quant.formats import prepare_quantized


def load_model(path: str, dtype, device, tp: TPContext = SINGLE, progress=False, mtp=False):
    """-> (model, ModelConfig); INT4 / FP8 / 8-bit checkpoints converted as they stream."""
    return loader.load_model(path, dtype, device, tp, progress, mtp, prepare_quantized)
