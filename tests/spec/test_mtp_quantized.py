"""MTP speculation on pre-quantized checkpoints: the MTP layer is stored like the rest of
the model (INT4 compressed-tensors from our quantizer, DeepSeek-style FP8 blocks), loads as
Int4Linear / Fp8Linear under its own name (model.layers.{L} -> mtp.layers.0), greedy
output equals plain decoding of the same checkpoint, and every draft equals the draft of a
dense twin holding the dequantized weights (so the MTP weights were read, and read right).
"""

import os
import shutil

import pytest
import torch.nn.functional as F

from app import LLM, SamplingParams
from app.engine.spec.speculator import Speculator
from app.models.layers import pack_cpu_linears
from app.quant.fp8_linear import Fp8Linear
from app.quant.int4_linear import Int4Linear
from app.quant.quantize_cli import quantize_checkpoint
from tests.quant.builders import make_fp8_block
from tests.spec.mtp_checkpoints import make_mtp_checkpoint

PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 47))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 2, "backoff": False}
QUANT = {"int4": Int4Linear, "fp8": Fp8Linear}


def quantized(family: str, fmt: str, tmp) -> tuple[str, str]:
    """-> (quantized checkpoint, its dense source) with one MTP layer."""
    src, _ = make_mtp_checkpoint(family, str(tmp / "src"))
    out = str(tmp / fmt)
    if fmt == "int4":
        quantize_checkpoint(src, out, "rtn", 32, symmetric=False)
    else:  # the decoder blocks (MTP's too) in FP8; the MTP front end's shard copied as is
        make_fp8_block(src, out, str(tmp / "fp8-twin"))
        shutil.copy(os.path.join(src, "mtp.safetensors"), out)
    return out, src


def generate_recording_drafts(llm: LLM, monkeypatch) -> tuple[list, list]:
    seen = []
    verify = Speculator.verify

    def record(self, logits, seqs):
        seen.extend(list(s.spec_tokens) for s in seqs if s.spec_tokens)
        return verify(self, logits, seqs)

    monkeypatch.setattr(Speculator, "verify", record)
    tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    monkeypatch.undo()
    return tokens, seen


def dense_twin(quant: LLM, src: str) -> LLM:
    """The dense source with MTP, each quantized module's dequantized weight copied in; the
    MTP layer's dequantized weights must be close to the source's (read from the right
    tensors: a wrong expert or shard would not correlate)."""
    twin = LLM(src, dtype="float32", device="cpu", speculative_config=MTP)
    modules = dict(twin.engine.model.named_modules())
    for name, m in quant.engine.model.named_modules():
        if isinstance(m, tuple(QUANT.values())):
            w = m.dequantized_weight()
            if name.startswith("mtp."):
                cos = F.cosine_similarity(w.flatten(), modules[name].weight.flatten(), 0)
                assert cos > 0.95, (name, float(cos))
            modules[name].weight.data.copy_(w)
    pack_cpu_linears(twin.engine.model)  # the C++ linear's panels are a copy: repack
    return twin


@pytest.mark.parametrize("family,fmt", [("glm4_moe", "int4"), ("deepseek_v3", "fp8")])
def test_mtp_of_a_quantized_checkpoint(family, fmt, tmp_path, monkeypatch):
    """Seen failing before the fix in app/quant/formats.py (INT4: "quantized checkpoint
    tensors for 'model.layers.3.eh_proj', which is not a linear": the quantized modules were
    looked up under the checkpoint's names, not the MTP layer's; FP8 likewise), and with the
    INT4 converter negating the MTP layer's scales (cosine check)."""
    path, src = quantized(family, fmt, tmp_path)
    plain = LLM(path, dtype="float32", device="cpu").generate(PROMPTS, GREEDY)
    spec = LLM(path, dtype="float32", device="cpu", speculative_config=MTP)
    mtp_modules = dict(spec.engine.model.mtp.named_modules())
    assert isinstance(mtp_modules["layers.0.self_attn.o_proj"], QUANT[fmt])
    assert isinstance(mtp_modules["layers.0.mlp.experts.0.down_proj"], QUANT[fmt])
    tokens, drafts = generate_recording_drafts(spec, monkeypatch)
    assert tokens == [o.token_ids for o in plain]
    _, twin_drafts = generate_recording_drafts(dense_twin(spec, src), monkeypatch)
    assert len(drafts) >= len(PROMPTS) * 4
    assert drafts == twin_drafts
