"""app/quant/linear.py: the role a quantized linear takes over from the layer it replaces."""

import torch

from app.models.layers import ColumnParallelLinear, RowParallelLinear
from app.models.parallel import TPContext
from app.quant.fp8_linear import Fp8Linear
from app.quant.int4_linear import Int4Linear
from app.quant.linear import LinearRole

TP2 = TPContext(rank=0, size=2)


def test_role_of_parallel_layers():
    row = RowParallelLinear(256, 64, tp=TP2)
    col = ColumnParallelLinear(64, 256, tp=TP2, gather_output=True)
    assert LinearRole.of(row) == LinearRole(TP2, row_parallel=True, reduce_output=True)
    assert LinearRole.of(col) == LinearRole(TP2, gather_output=True)


def test_int4_replacing_fp8_keeps_the_row_parallel_reduce():
    """An FP8 checkpoint quantized to INT4 (weight_quant="int4") replaces Fp8Linear layers:
    the row-parallel ones must still sum the ranks' partial outputs. Seen failing before
    LinearRole.of read a quantized layer's own role: reduce_output was False, and at TP=2
    the logits differed from TP=1 everywhere (tests/parallel/test_fp8_to_int4_tp.py)."""
    with torch.device("cpu"):
        fp8 = Fp8Linear.like(RowParallelLinear(256, 64, tp=TP2), (128, 128))
    assert fp8.reduce_output and fp8.row_parallel
    int4 = Int4Linear.like(fp8, 32, symmetric=True)
    assert int4.role == fp8.role and int4.reduce_output and int4.tp == TP2
