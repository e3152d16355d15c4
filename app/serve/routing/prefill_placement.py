"""Load-aware prefill placement: prefill a prompt on a prefill replica or on its decode replica.

A prefill replica that is saturated while a decode replica idles must not add seconds of
TTFT (issue 34: 32 x 600-token prompts waited 3.4 s behind one prefill replica). So each
request compares two estimates of its time to first token (TTFT), from measured load:

    remote = (prefill.queued_tokens + work_remote) / prefill.rate + handoff_s
             + handoff_s_per_token * prompt.num_tokens
    local  = (decode.queued_prefill_tokens + work_local) / decode.prefill_rate

``work_*`` is the prompt's tokens not cached on that side (>= 1: the engine computes at
least the last one). The rates are the replicas' own measured prefill rates
(app/engine/step_rates.py); an unmeasured one (None or 0) is the other side's (the same
model: a decode replica that never prefilled is as fast as its prefill replica), and with
neither measured ``fallback_prefill_rate``. The
decode replica may prefill only what it can hold now, ``decode.headroom_tokens >=
num_tokens + kv_headroom_tokens`` (the rest stays free for its running sequences' growth),
and only while its running batch is below ``max_decode_running`` and its next steps slow
down at most ``max_itl_slowdown``x:

    (step_time_s + min(step_prefill_tokens, queued + work_local) / decode.prefill_rate)
        / step_time_s

Rules, in order: no prefill replica -> local; the decode replica cannot hold the prompt ->
remote; a prompt of at most ``short_prompt_tokens`` (it fills no KV chunk, so nothing to
share) -> local; a longer one that would eat into the headroom kept for the running
sequences -> remote; batch or ITL cap reached -> remote; the prefill replica shares the
decode replica's compute (``prefill.shares_compute``: the same cores or GPU, so a remote
prefill buys no compute and adds the hand-off's work; app/serve/routing/compute.py) and
``config.local_on_shared_compute`` -> local; else local only if clearly faster,
``local * (1 + local_margin) + local_min_gain_s < remote``. The margins keep small load
swings (and the ingress's own placements not yet reported done) from flipping
placements; at equal estimates remote wins, as its chunks reach the store for every replica.
A prompt placed local as faster that an idle prefill replica would have taken counts as
``spilled_tokens``: demand for more prefill replicas (the prefill autoscaler counts it:
app/serve/routing/autoscaling.py). Other local placements do not: a short prompt asks for
no prefill replica, and where local beats even an idle one, or the two share compute, one
more replica like those running would not take the prompt.
The function is pure: the same inputs give the same answer. The loads must include what the
caller placed since the replicas last reported (as TokenAwareRouter does with ``_sent``),
or a burst decided on one stale report would all go to one side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from app.serve.config import ServeArgs

# Metric names for app/serve/metrics.py: gauges hold the last decision's inputs.
PLACEMENTS = "slimserve:prefill_placements"  # counter, tags where, reason
PREFILL_QUEUE_TOKENS = "slimserve:prefill_queue_tokens"  # least-loaded prefill replica
PREFILL_RATE = "slimserve:prefill_rate_tokens_per_second"  # each replica's, measured
DECODE_HEADROOM_TOKENS = "slimserve:decode_headroom_tokens"  # free KV minus queued prefill
DECODE_STEP_SECONDS = "slimserve:decode_step_seconds"  # each replica's, measured
SHARES_COMPUTE = "slimserve:prefill_shares_compute"  # 1: on the decode replica's compute
TTFT_ESTIMATE = "slimserve:prefill_placement_ttft_estimate_seconds"  # histogram, tag where

# Reasons (a bounded label set).
NO_PREFILL_REPLICA, DECODE_KV_FULL, SHORT_PROMPT = "no_prefill_replica", "decode_kv_full", "short"
DECODE_BATCH_FULL, DECODE_ITL_CAP = "decode_batch_full", "decode_itl_cap"
LOCAL_FASTER, SHARED_COMPUTE = "local_faster", "shared_compute"
REMOTE_DEFAULT = "remote_default"  # local not faster by the margin: remote faster, equal, close


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    queued_tokens: int  # prompt tokens still to compute on the least-loaded prefill replica
    num_replicas: int  # running prefill replicas; 0: every prompt prefills locally
    rate: float | None = None  # measured prefill tokens/s (EWMA); None: not measured yet
    shares_compute: bool = False  # it runs on the decode replica's cores or GPU

    def __post_init__(self):
        assert self.queued_tokens >= 0 and self.num_replicas >= 0, self


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    free_kv_tokens: int  # free KV blocks x block_size on the chosen decode replica
    num_running: int  # sequences in its decode batch
    queued_prefill_tokens: int = 0  # local prefill tokens admitted, not yet computed
    step_time_s: float | None = None  # recent decode step time (EWMA); None: not measured
    prefill_rate: float | None = None  # its own measured prefill tokens/s while decoding

    def __post_init__(self):
        assert min(self.free_kv_tokens, self.num_running, self.queued_prefill_tokens) >= 0, self

    @property
    def headroom_tokens(self) -> int:
        """KV tokens a new prompt could take now: free, less what queued prefills claim."""
        return self.free_kv_tokens - self.queued_prefill_tokens


@dataclass(frozen=True, slots=True)
class PromptLoad:
    num_tokens: int
    cached_local_tokens: int = 0  # prefix already in the decode replica's cache, if known
    cached_remote_tokens: int = 0  # prefix the prefill replica holds (router's affinity)

    def __post_init__(self):
        assert self.num_tokens >= 1, self
        assert min(self.cached_local_tokens, self.cached_remote_tokens) >= 0, self


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    short_prompt_tokens: int = 0  # ServeArgs.local_prefill_tokens: at most this goes local
    fallback_prefill_rate: float = 4096.0  # tokens/s assumed until a rate is measured
    max_decode_running: int | None = 48  # DecodeKVPolicy's target_running_per_replica
    max_itl_slowdown: float | None = None  # None: the batch cap alone guards ITL
    step_prefill_tokens: int = 2048  # prefill tokens one step may carry (max_num_batched)
    kv_headroom_tokens: int = 256  # KV left free for the running sequences to grow
    handoff_s: float = 0.0  # fixed cost of a remote prefill's hand-off
    handoff_s_per_token: float = 0.0  # KV transfer + import per prompt token
    local_margin: float = 0.2  # local must beat remote by this fraction
    # ... and by this much: a short remote queue (a few requests' worth, or the ingress's own
    # placements between two load reports) is no reason to prefill beside running decodes
    local_min_gain_s: float = 0.05
    # A prefill replica on the decode replica's compute: prefill locally (what the decode
    # replica can hold and its caps allow); False: compare the two queues as for separate
    # compute (ServeArgs.prefill_on_shared_compute)
    local_on_shared_compute: bool = True

    def __post_init__(self):
        assert self.short_prompt_tokens >= 0 and self.fallback_prefill_rate > 0, self
        assert self.step_prefill_tokens > 0 and self.kv_headroom_tokens >= 0, self
        assert min(self.handoff_s, self.handoff_s_per_token, self.local_margin) >= 0, self
        assert self.local_min_gain_s >= 0, self

    @classmethod
    def from_args(cls, args: ServeArgs) -> PlacementConfig:
        """The disaggregated Ingress's policy, from its settings (app/serve/config.py)."""
        return cls(
            short_prompt_tokens=args.local_prefill_tokens,
            step_prefill_tokens=args.engine.max_num_batched_tokens,
            max_decode_running=args.max_ongoing_requests,
            local_on_shared_compute=args.prefill_on_shared_compute == "local",
            max_itl_slowdown=args.prefill_max_itl_slowdown,
        )

    def rate(self, rate: float | None) -> float:
        return measured(rate) or self.fallback_prefill_rate


@dataclass(frozen=True, slots=True)
class Placement:
    where: Literal["local", "remote"]
    ttft_local_s: float
    ttft_remote_s: float  # inf when no prefill replica runs
    reason: str  # one of the reasons above
    # Local only because of the prefill replicas' queue (an idle one would have taken it):
    # the tokens it would have computed there, the prefill autoscaler's spilled demand
    spilled_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        """The estimate for where it goes (TTFT_ESTIMATE records it)."""
        return self.ttft_local_s if self.where == "local" else self.ttft_remote_s

    @property
    def labels(self) -> dict[str, str]:
        """The tags of its PLACEMENTS count."""
        return {"where": self.where, "reason": self.reason}


def spilled_tokens(
    prompt: PromptLoad, prefill: PrefillLoad, local_s: float, config: PlacementConfig
) -> int:
    """A prompt placed local as faster: the tokens it would have had computed remotely if
    an idle prefill replica would have taken it (the queue alone made local faster: more
    prefill replicas would serve it), else 0 (local wins anyway: more would not)."""
    idle = ttft_remote_s(prompt, replace(prefill, queued_tokens=0), config)
    if _clearly_faster(local_s, idle, config):
        return 0
    return _work(prompt.num_tokens, prompt.cached_remote_tokens)


def _clearly_faster(local_s: float, remote_s: float, config: PlacementConfig) -> bool:
    return local_s * (1 + config.local_margin) + config.local_min_gain_s < remote_s


def ttft_local_s(prompt: PromptLoad, decode: DecodeLoad, config: PlacementConfig) -> float:
    work = decode.queued_prefill_tokens + _work(prompt.num_tokens, prompt.cached_local_tokens)
    return work / config.rate(decode.prefill_rate)


def ttft_remote_s(prompt: PromptLoad, prefill: PrefillLoad, config: PlacementConfig) -> float:
    if prefill.num_replicas == 0:
        return math.inf
    work = prefill.queued_tokens + _work(prompt.num_tokens, prompt.cached_remote_tokens)
    handoff = config.handoff_s + config.handoff_s_per_token * prompt.num_tokens
    return work / config.rate(prefill.rate) + handoff


def place_prefill(
    prompt: PromptLoad, prefill: PrefillLoad, decode: DecodeLoad, config: PlacementConfig
) -> Placement:
    """Where ``prompt`` prefills, given the least-loaded prefill replica and its decode
    replica (the rules and formulas are in the module's docstring)."""
    prefill, decode = with_rates(prefill, decode)
    local = ttft_local_s(prompt, decode, config)
    remote = ttft_remote_s(prompt, prefill, config)

    def placed(where: Literal["local", "remote"], reason: str, spilled: int = 0) -> Placement:
        return Placement(where, local, remote, reason, spilled)

    if prefill.num_replicas == 0:
        return placed("local", NO_PREFILL_REPLICA)
    if decode.headroom_tokens < prompt.num_tokens:
        return placed("remote", DECODE_KV_FULL)
    if prompt.num_tokens <= config.short_prompt_tokens:
        return placed("local", SHORT_PROMPT)
    if decode.headroom_tokens < prompt.num_tokens + config.kv_headroom_tokens:
        return placed("remote", DECODE_KV_FULL)  # a long prompt leaves the running room
    cap = config.max_decode_running
    if cap is not None and decode.num_running >= cap:
        return placed("remote", DECODE_BATCH_FULL)
    step = decode.step_time_s
    if config.max_itl_slowdown is not None and decode.num_running > 0 and step:
        # a step carries at most step_prefill_tokens of the queued work (local, in seconds)
        prefill_s = min(config.step_prefill_tokens / config.rate(decode.prefill_rate), local)
        if (step + prefill_s) / step > config.max_itl_slowdown:
            return placed("remote", DECODE_ITL_CAP)
    if prefill.shares_compute and config.local_on_shared_compute:
        return placed("local", SHARED_COMPUTE)
    if _clearly_faster(local, remote, config):
        return placed("local", LOCAL_FASTER, spilled_tokens(prompt, prefill, local, config))
    return placed("remote", REMOTE_DEFAULT)


def with_rates(prefill: PrefillLoad, decode: DecodeLoad) -> tuple[PrefillLoad, DecodeLoad]:
    """An unmeasured prefill rate on one side taken from the other side's measurement."""
    remote, local = measured(prefill.rate), measured(decode.prefill_rate)
    if remote is None and local is not None:
        prefill = replace(prefill, rate=local)
    elif local is None and remote is not None:
        decode = replace(decode, prefill_rate=remote)
    return prefill, decode


def measured(value: Any) -> float | None:
    """A measurement as reported: a positive number, else None (not measured yet, or absent
    from an older replica's report)."""
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def _work(num_tokens: int, cached_tokens: int) -> int:
    return max(1, num_tokens - cached_tokens)  # the engine computes at least the last token
