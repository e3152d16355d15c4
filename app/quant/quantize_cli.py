"""`slimserve quantize`: BF16/FP16/FP32 or FP8 block-scaled checkpoint -> INT4
compressed-tensors `pack-quantized` (RTN, or GPTQ on calibration text)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from app.quant.apply import matches_any
from app.quant.export import DEFAULT_SKIP, SHARD_BYTES, ExportReport, export_compressed_tensors
from app.quant.int4 import quantize_rtn

CALIB_PATH = os.path.join(os.path.dirname(__file__), "calib.txt")
DTYPE_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}


def checkpoint_tensor_bytes(path: str) -> int:
    """Sum of tensor bytes over the folder's safetensors files (from headers, no data)."""
    from app.models.loader import safetensors_files

    total = 0
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                s = f.get_slice(name)
                total += DTYPE_BYTES.get(s.get_dtype(), 1) * int(torch.tensor(s.get_shape()).prod())
    return total


def _source(src: str) -> tuple[dict, torch.dtype]:
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    qcfg = cfg.get("quantization_config")
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, str(name), torch.bfloat16)
    if qcfg or not dtype.is_floating_point or dtype.itemsize < 2:
        dtype = torch.bfloat16  # FP8 (and other quantized) sources are written as BF16
    return qcfg, dtype


def _stream(src: str, qcfg: dict | None, dtype: torch.dtype, progress: bool) -> Iterator:
    from app.models.loader import iter_checkpoint
    from app.quant.formats import prepare_quantized

    stream = iter_checkpoint(src)
    if qcfg:  # FP8 / 8-bit: dense on the fly; INT4 sources are refused here
        stream = prepare_quantized(None, qcfg, src, dtype)(stream)
    return tqdm(stream, desc="quantizing", unit=" tensors", disable=not progress)


def quantize_checkpoint(
    src: str,
    out: str,
    method: str = "rtn",
    group_size: int = 128,
    symmetric: bool = False,
    calib: str | None = None,
    act_order: bool = False,
    skip: tuple[str, ...] = DEFAULT_SKIP,
    calib_seqs: int = 32,
    calib_len: int = 512,
    device: str = "cpu",
    progress: bool = False,
    shard_bytes: int = SHARD_BYTES,
) -> ExportReport:
    qcfg, dtype = _source(src)
    table = None
    if method == "gptq":
        table = _gptq_table(
            src,
            group_size,
            symmetric,
            act_order,
            calib,
            calib_seqs,
            calib_len,
            dtype,
            device,
            progress,
        )
    elif method != "rtn":
        raise ValueError(f"unknown method {method!r} (rtn, gptq)")

    def quantize(module: str, w: torch.Tensor):
        if matches_any(module, skip) or w.shape[1] % group_size:
            return None
        if table is not None:
            return table.get(module)
        return quantize_rtn(w.to(device), group_size, symmetric, scale_dtype=dtype)

    return export_compressed_tensors(
        src,
        out,
        _stream(src, qcfg, dtype, progress),
        quantize,
        group_size,
        symmetric,
        checkpoint_tensor_bytes(src),
        dtype,
        shard_bytes,
    )


def _gptq_table(src, group_size, symmetric, act_order, calib, n, seq_len, dtype, device, progress):
    from app.quant.calibrate import calibration_sequences, gptq_model
    from app.quant.load import load_model
    from app.tokenizer import Tokenizer

    # BF16 on GPU is enough for activations: Hessians and GPTQ itself run in float32.
    model, _ = load_model(
        src, torch.bfloat16 if device.startswith("cuda") else torch.float32, device
    )
    with open(calib or CALIB_PATH, encoding="utf-8") as f:
        ids = Tokenizer.from_path(src).encode(f.read())
    seqs = calibration_sequences(ids, seq_len, n)
    table = gptq_model(model, seqs, group_size, symmetric, act_order, (), dtype, progress)
    return {k: _to_cpu(v) for k, v in table.items()}


def _to_cpu(qw):
    from app.quant.int4 import Int4Weight

    zeros = None if qw.zeros is None else qw.zeros.cpu()
    return Int4Weight(qw.qweight.cpu(), qw.scales.cpu(), zeros, qw.group_size)


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**27 else f"{n / 2**20:.2f} MiB"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="source checkpoint folder (HF layout)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--method", choices=["rtn", "gptq"], default="rtn")
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=128)
    p.add_argument("--symmetric", action="store_true", help="no zero points (default: asym)")
    p.add_argument("--act-order", action="store_true", help="GPTQ: visit columns by H diag")
    p.add_argument("--calib", help=f"calibration text for GPTQ (default: {CALIB_PATH})")
    p.add_argument("--calib-seqs", type=int, default=32, help="max calibration sequences")
    p.add_argument("--calib-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--skip", action="append", default=[], help="extra module pattern to keep")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def run(args: argparse.Namespace) -> int:
    report = quantize_checkpoint(
        args.model,
        args.out,
        args.method,
        args.group_size,
        args.symmetric,
        args.calib,
        args.act_order,
        DEFAULT_SKIP + tuple(args.skip),
        args.calib_seqs,
        args.calib_len,
        args.device,
        progress=True,
    )
    change = 100 * (report.ratio - 1)
    print(f"quantized {len(report.quantized)} linear modules, kept {len(report.ignored)} dense")
    print(f"size: {_gib(report.bytes_in)} -> {_gib(report.bytes_out)} ({change:+.1f}%)")
    print(f"wrote {args.out} (compressed-tensors pack-quantized, group {args.group_size})")
    return 0
