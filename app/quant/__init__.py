"""Weight quantization: INT4 (RTN, GPTQ), checkpoint formats, `Int4Linear` (no Ray)."""

from app.quant.apply import apply_weight_quant, quantize_model
from app.quant.fp8_linear import set_fp8_activations
from app.quant.int4 import Int4Weight, pack_int4, quantize_rtn
from app.quant.int4_linear import Int4Linear

__all__ = [
    "Int4Linear",
    "Int4Weight",
    "apply_weight_quant",
    "pack_int4",
    "quantize_model",
    "quantize_rtn",
    "set_fp8_activations",
]
