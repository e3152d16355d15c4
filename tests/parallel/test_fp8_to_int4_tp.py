"""An FP8-block checkpoint served as INT4 (`weight_quant="int4"`: its Fp8Linear layers are
replaced by Int4Linear after loading) under tensor parallelism gives TP=1's logits."""

import pytest

from tests.parallel.helpers import compare
from tests.quant.builders import make_fp8_block


@pytest.fixture(scope="module")
def fp8_llama(checkpoint_factory, tmp_path_factory):
    # Hidden 256: INT4 groups (128, chosen on the full input) stay whole on each of 2 ranks.
    src = checkpoint_factory(
        "llama",
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    root = tmp_path_factory.mktemp("fp8_llama")
    path, _ = make_fp8_block(src, str(root / "q"), str(root / "t"))
    return path


def test_fp8_checkpoint_as_int4_tp2_matches_tp1(fp8_llama):
    """Seen failing before LinearRole.of read a quantized layer's own role: the INT4 layers
    replacing row-parallel FP8 ones did not sum the ranks' outputs (every logit differed,
    by up to 6.0)."""
    compare(fp8_llama, 2, weight_quant="int4")
