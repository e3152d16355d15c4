"""`slimserve quantize` writes compressed-tensors pack-quantized that the library reads."""

import glob
import json
import os
import struct

import pytest
import torch

from app import LLM
from app.cli import main
from app.quant.int4_linear import Int4Linear
from app.quant.quantize_cli import quantize_checkpoint
from quant.builders import hf_dequantized_logits, make_fp8_block

IDS = list(range(10, 47))


def read_config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def tensor_bytes_on_disk(folder: str) -> int:
    """Bytes of tensor data in the folder's safetensors files: file size minus header."""
    total = 0
    for f in glob.glob(os.path.join(folder, "*.safetensors")):
        with open(f, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
        total += os.path.getsize(f) - 8 - header_len
    return total


def test_rtn_cli_output_loads_in_compressed_tensors_and_here(llama_path, tmp_path, capsys):
    out = str(tmp_path / "int4")
    assert main(["quantize", "--model", llama_path, "--out", out, "--group-size", "32"]) == 0
    printed = capsys.readouterr().out
    assert "quantized 14 linear modules, kept 1 dense" in printed and "size:" in printed
    qcfg = read_config(out)["quantization_config"]
    assert qcfg["format"] == "pack-quantized" and qcfg["ignore"] == ["lm_head"]
    assert qcfg["config_groups"]["group_0"]["weights"]["symmetric"] is False
    llm = LLM(out, dtype="float32", device="cpu")
    assert sum(isinstance(m, Int4Linear) for m in llm.engine.model.modules()) == 8
    ours = llm.engine.score(IDS)
    torch.testing.assert_close(ours, hf_dequantized_logits(out, IDS), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("group", [32, 64])
def test_reported_size_matches_files_on_disk(llama_path, tmp_path, group):
    out = str(tmp_path / "int4")
    report = quantize_checkpoint(llama_path, out, "rtn", group, symmetric=True)
    assert report.bytes_in == tensor_bytes_on_disk(llama_path)
    assert report.bytes_out == tensor_bytes_on_disk(out)
    assert report.ratio == pytest.approx(
        tensor_bytes_on_disk(out) / tensor_bytes_on_disk(llama_path)
    )
    # fp32 source: linears shrink ~7x, embeddings/lm_head (2 x 320 x 64) stay
    assert 0.35 < report.ratio < 0.6


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_gptq_from_fp8_block_checkpoint(llama_path, tmp_path):
    """The FP8 source stays FP8 while calibrating (`Fp8Linear`); GPTQ quantizes its
    dequantized weight and splits merged q/k/v, gate/up rows back into checkpoint names.
    Seen to fail: GPTQ fed the raw FP8 codes (scales dropped) is 4.5x further from the FP8
    model than RTN of its dense twin; before `output_shards` it raised AttributeError."""
    fp8, twin = make_fp8_block(llama_path, str(tmp_path / "fp8"), str(tmp_path / "twin"))
    out = str(tmp_path / "int4")
    report = quantize_checkpoint(fp8, out, "gptq", 32, symmetric=True, calib_seqs=4, calib_len=64)
    assert len(report.quantized) == 14 and report.ignored == ["lm_head"]
    cfg = read_config(out)
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    ours = LLM(out, dtype="float32", device="cpu").engine.score(IDS)
    # The library dequantizes in the scales' dtype (bf16 here), we in float32.
    torch.testing.assert_close(ours, hf_dequantized_logits(out, IDS), atol=0.05, rtol=0.02)
    rtn = str(tmp_path / "rtn")
    quantize_checkpoint(twin, rtn, "rtn", 32, symmetric=True)
    source = LLM(twin, dtype="float32", device="cpu").engine.score(IDS)
    rtn_err = rel_err(LLM(rtn, dtype="float32", device="cpu").engine.score(IDS), source)
    assert rel_err(ours, source) < 2 * rtn_err


def test_an_int4_source_is_refused(llama_path, tmp_path):
    out = str(tmp_path / "int4")
    quantize_checkpoint(llama_path, out, "rtn", 32)
    with pytest.raises(ValueError, match="already INT4"):
        quantize_checkpoint(out, str(tmp_path / "again"), "rtn", 32)


def test_sharded_output_with_index(llama_path, tmp_path):
    out = str(tmp_path / "int4")
    report = quantize_checkpoint(llama_path, out, "rtn", 32, shard_bytes=64 << 10)
    assert len(report.files) > 2 and all(os.path.exists(f) for f in report.files)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == {os.path.basename(f) for f in report.files}
    assert report.bytes_out == tensor_bytes_on_disk(out)
    ours = LLM(out, dtype="float32", device="cpu").engine.score(IDS)
    torch.testing.assert_close(ours, hf_dequantized_logits(out, IDS), atol=2e-4, rtol=1e-4)
