"""`slimserve eval` metrics on a tiny model: identity is perfect, quantization is not."""

import json

import pytest

from app.cli import main
from app.evaluation.evaluate import Evaluator, QuantConfig, windows

IDS = [(7 * i) % 300 + 3 for i in range(96)]


def test_windows_cut_text_and_drop_single_tokens():
    assert windows(list(range(10)), 4, 9) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert windows(list(range(10)), 4, 10) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.fixture(scope="module")
def evaluator(llama_path):
    return Evaluator(
        llama_path,
        IDS,
        "float32",
        window=48,
        max_tokens=96,
        prompt_len=8,
        gen_tokens=8,
        num_prompts=2,
        device="cpu",
        kv_cache_memory_bytes=8 << 20,
    )


def test_the_unquantized_configuration_agrees_perfectly(evaluator):
    r = evaluator.run(QuantConfig("same"))
    assert r.tokens == 94 and r.perplexity == pytest.approx(r.baseline_perplexity)
    assert r.mean_kl == pytest.approx(0.0, abs=1e-6)
    assert r.top1_agreement == 1.0 and r.greedy_exact_match == 1.0


def test_int4_weights_move_the_distribution(evaluator):
    r = evaluator.run(QuantConfig("int4", weight_quant="int4"))
    assert 0 < r.mean_kl < 0.5 and r.top1_agreement < 1.0
    assert r.perplexity != r.baseline_perplexity


def test_eval_cli_writes_json(llama_path, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 8)
    out = tmp_path / "q.json"
    args = [
        "eval",
        "--model",
        llama_path,
        "--text",
        str(text),
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--window",
        "32",
        "--max-tokens",
        "64",
        "--gen-tokens",
        "4",
        "--num-prompts",
        "1",
        "--prompt-len",
        "8",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    (row,) = json.loads(out.read_text())
    assert row["name"] == "fp8_e4m3" and row["kv_cache_dtype"] == "fp8_e4m3"
    assert 0 <= row["mean_kl"] < 0.1 and "mean KL" in capsys.readouterr().out
