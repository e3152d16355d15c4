"""Quality of a quantized configuration against the unquantized run of the same model.

Logits come from `Engine.score(token_ids)`: one prefill through the real engine (paged KV
cache in the configured dtype, write-then-read attention, INT4 linears if configured), so an
FP8 KV cache affects every position's logits exactly as it does in serving. The text is cut
into windows of `window` tokens, each scored from an empty cache.

Metrics, over all predicted positions:
- perplexity: exp(mean NLL of the next token), for the candidate and the baseline;
- mean KL(baseline || candidate) of the next-token distributions;
- top-1 agreement: the candidate's argmax equals the baseline's;
- greedy agreement: from the first `prompt_len` tokens of some windows, both generate
  `gen_tokens` greedily; the mean fraction of the baseline's tokens reproduced before the
  first divergence, and the share of prompts reproduced exactly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from app.engine.llm import LLM
from app.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class QuantConfig:
    name: str
    kv_cache_dtype: str = "auto"
    weight_quant: str | None = None
    model: str | None = None  # another checkpoint of the same model (e.g. GPTQ output)


BASELINE = QuantConfig("baseline")
MATRIX = (
    QuantConfig("bf16"),
    QuantConfig("fp8 KV", kv_cache_dtype="fp8_e4m3"),
    QuantConfig("int4", weight_quant="int4"),
    QuantConfig("int4 + fp8 KV", kv_cache_dtype="fp8_e4m3", weight_quant="int4"),
)


@dataclass(slots=True)
class QualityResult:
    name: str
    kv_cache_dtype: str
    weight_quant: str | None
    tokens: int
    perplexity: float
    baseline_perplexity: float
    mean_kl: float
    top1_agreement: float
    greedy_prefix_agreement: float
    greedy_exact_match: float

    def as_dict(self) -> dict:
        return asdict(self)


def windows(ids: list[int], window: int, max_tokens: int) -> list[list[int]]:
    ids = ids[:max_tokens]
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i:]) >= 2]


def _logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    return llm.engine.score(ids).float().log_softmax(-1)  # [T, V]


def _greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def _prefix_fraction(a: list[int], b: list[int]) -> float:
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(len(b), 1)


class Evaluator:
    """Holds the baseline's log-probs and greedy outputs so each candidate runs once."""

    def __init__(
        self,
        model: str,
        ids: list[int],
        dtype: str = "auto",
        window: int = 256,
        max_tokens: int = 4096,
        prompt_len: int = 32,
        gen_tokens: int = 32,
        num_prompts: int = 8,
        **llm_kwargs,
    ):
        self.model, self.dtype, self.llm_kwargs = model, dtype, llm_kwargs
        self.windows = windows(ids, window, max_tokens)
        if not self.windows:
            raise ValueError("evaluation text is too short (needs at least 2 tokens)")
        self.prompts = [w[:prompt_len] for w in self.windows[:num_prompts]]
        self.gen_tokens = gen_tokens
        base = self._llm(BASELINE)
        self.base_logprobs = [_logprobs(base, w) for w in self.windows]
        self.base_greedy = _greedy(base, self.prompts, gen_tokens)
        del base

    def _llm(self, cfg: QuantConfig) -> LLM:
        return LLM(
            cfg.model or self.model,
            dtype=self.dtype,
            kv_cache_dtype=cfg.kv_cache_dtype,
            weight_quant=cfg.weight_quant,
            **self.llm_kwargs,
        )

    def run(self, cfg: QuantConfig) -> QualityResult:
        llm = self._llm(cfg)
        nll = base_nll = kl = agree = 0.0
        count = 0
        for w, base in zip(self.windows, self.base_logprobs):
            lp = _logprobs(llm, w)[:-1]  # position t predicts token t+1
            base = base[:-1]
            target = torch.tensor(w[1:], device=lp.device).unsqueeze(1)
            nll -= float(lp.gather(1, target).sum())
            base_nll -= float(base.gather(1, target).sum())
            kl += float((base.exp() * (base - lp)).sum(-1).clamp_min(0).sum())
            agree += float((lp.argmax(-1) == base.argmax(-1)).sum())
            count += len(w) - 1
        greedy = _greedy(llm, self.prompts, self.gen_tokens)
        prefix = [_prefix_fraction(g, b) for g, b in zip(greedy, self.base_greedy)]
        return QualityResult(
            name=cfg.name,
            kv_cache_dtype=cfg.kv_cache_dtype,
            weight_quant=cfg.weight_quant,
            tokens=count,
            perplexity=math.exp(nll / count),
            baseline_perplexity=math.exp(base_nll / count),
            mean_kl=kl / count,
            top1_agreement=agree / count,
            greedy_prefix_agreement=sum(prefix) / len(prefix),
            greedy_exact_match=sum(g == b for g, b in zip(greedy, self.base_greedy)) / len(prefix),
        )


def format_table(results: list[QualityResult]) -> str:
    head = f"{'config':<20}{'ppl':>9}{'base ppl':>10}{'mean KL':>10}{'top-1':>8}{'greedy':>8}"
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(
            f"{r.name:<20}{r.perplexity:>9.3f}{r.baseline_perplexity:>10.3f}{r.mean_kl:>10.5f}"
            f"{r.top1_agreement:>8.3f}{r.greedy_prefix_agreement:>8.3f}"
        )
    return "\n".join(rows)
