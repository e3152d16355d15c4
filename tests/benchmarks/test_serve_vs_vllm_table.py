"""bench/serve_vs_vllm.py's table for docs/performance.md: each cell bold exactly where it
meets issue 34's goal against the vLLM run beside its mode."""

from __future__ import annotations

from bench.serve_vs_vllm import markdown


def level(tok_s: float, ttft_s: float, itl_s: float) -> dict:
    return {"output_tok_s": tok_s, "ttft_p50_s": ttft_s, "ttft_p99_s": None, "itl_p50_s": itl_s}


def table(mode: str, plen: int, ours: dict, theirs: dict) -> list[str]:
    """The row's three cells for one level."""
    summary = {
        f"slimserve-{mode}": {"ours": {str(plen): {"8": ours}}},
        f"vllm|{mode}": {"ours": {str(plen): {"8": theirs}}},
    }
    row = markdown({"summary": summary}).splitlines()[2]
    return [cell.strip() for cell in row.strip("|").split("|")][3:]


def test_tok_s_is_bold_from_vllms_rate_up():
    vllm = level(100.0, 0.1, 0.01)
    assert table("colocated", 128, level(100.0, 0.1, 0.01), vllm)[0] == "**1.00x**"
    assert table("colocated", 128, level(99.0, 0.1, 0.01), vllm)[0] == "0.99x"


def test_ttft_goal_is_1_2x_colocated_and_1_5x_disaggregated():
    vllm = level(100.0, 0.100, 0.01)
    assert table("colocated", 128, level(100.0, 0.120, 0.01), vllm)[1] == "**1.20x**"
    assert table("colocated", 128, level(100.0, 0.130, 0.01), vllm)[1] == "1.30x"
    assert table("disaggregated", 128, level(100.0, 0.130, 0.01), vllm)[1] == "**1.30x**"
    assert table("disaggregated", 128, level(100.0, 0.160, 0.01), vllm)[1] == "1.60x"


def test_itl_goal_only_in_long_prompt_cells_of_the_disaggregated_mode():
    vllm = level(100.0, 0.1, 0.010)
    fast = level(100.0, 0.1, 0.006)
    assert table("disaggregated", 512, fast, vllm)[2] == "**6.0 vs 10.0**"
    assert table("disaggregated", 512, level(100.0, 0.1, 0.0061), vllm)[2] == "6.1 vs 10.0"
    assert table("disaggregated", 128, fast, vllm)[2] == "6.0 vs 10.0"  # a short prompt
    assert table("colocated", 1000, fast, vllm)[2] == "6.0 vs 10.0"


def test_a_cell_without_a_peer_run_is_not_bold():
    cells = table("colocated", 128, level(100.0, 0.1, 0.01), {})
    assert cells == ["-", "-", "10.0 vs -"]
