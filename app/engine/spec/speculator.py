"""The engine side of speculative decoding: propose before a step, verify after it.

Per step: `propose` gives each running decode sequence up to k tokens (`seq.spec_tokens`);
the scheduler lets a decode compute 1 + k tokens (an extend over the paged cache) and the
runner returns k + 1 logit rows for it; `verify` turns the rows into the tokens the
sequence emits (exact: see verify.py); `settle` advances the computed tokens over the
accepted proposals only, commits full blocks to the prefix cache (which therefore never
sees a rejected token) and gives back the blocks that only rejected tokens used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from app.config import SpeculativeConfig
from app.engine.block_manager import BlockManager
from app.engine.request import TokenLogprob
from app.engine.sequence import Sequence
from app.engine.spec.cost import CostGovernor
from app.engine.spec.mtp import Span
from app.engine.spec.ngram import AcceptanceBackoff, NgramProposer
from app.engine.spec.sampling import target_tokens
from app.engine.spec.verify import verify_point_mass

Emitted = list[tuple[int, TokenLogprob | None]]


@dataclass(slots=True)
class SpecStats:
    proposed: int = 0  # tokens proposed and verified
    accepted: int = 0  # of those, accepted
    verify_steps: int = 0  # (sequence, step) pairs that verified at least one proposal
    emitted: int = 0  # tokens those steps produced (accepted + the target's own)
    cost: CostGovernor | None = None  # the cost policy's counters, when it is on

    def as_dict(self) -> dict[str, float]:
        return {
            **(self.cost.as_dict() if self.cost is not None else {}),
            "spec_proposed_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            "spec_verify_steps": self.verify_steps,
            "spec_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            # tokens per target forward for the sequences that speculated
            "spec_mean_accepted_length": (
                self.emitted / self.verify_steps if self.verify_steps else 0.0
            ),
        }


@dataclass(slots=True)
class StepTally:
    """What the cost policy needs of the current step (see cost.py)."""

    rows: int = 0  # logit rows verified: equals the step's tokens iff it only decoded
    verified: bool = False  # some sequence verified proposals
    emitted: int = 0  # tokens the step emitted


@dataclass(slots=True)
class SeqSpecState:
    backoff: AcceptanceBackoff
    drafts: list[int] = field(default_factory=list)  # model proposers: drafted after a step


class Speculator:
    def __init__(
        self, config: SpeculativeConfig, blocks: BlockManager, max_model_len: int, drafter=None
    ):
        """drafter: the model proposer (MTP, draft model) with after_step(); None: n-gram."""
        self.config, self.blocks, self.max_model_len = config, blocks, max_model_len
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.drafter = drafter
        # backoff off: k every step, whatever it costs (tests pin speculation on with it)
        cost_aware = config.backoff and config.cost_aware
        self.governor: CostGovernor | None = CostGovernor() if cost_aware else None
        self.stats = SpecStats(cost=self.governor)
        self.tally = StepTally()

    def propose(self, running: list[Sequence]) -> None:
        self.tally = StepTally()
        allowed = True
        if self.governor is not None:
            self.governor.start()
            allowed = self.governor.allow()
        for seq in running:
            seq.spec_tokens = []
            if not allowed or not seq.is_decode or not _may_speculate(seq):
                continue
            if seq.spec_state is None:
                seq.spec_state = SeqSpecState(AcceptanceBackoff(self.config.num_speculative_tokens))
            k = self._budget(seq)
            if k <= 0:
                continue
            if self.drafter is None:
                seq.spec_tokens = self.ngram.propose(seq.token_ids, k)
            else:
                seq.spec_tokens = seq.spec_state.drafts[:k]

    def _budget(self, seq: Sequence) -> int:
        """k for this step: backoff, and never past max_tokens or the context length (the
        target's own token comes on top of the proposals)."""
        k = self.config.num_speculative_tokens
        if self.config.backoff:
            k = seq.spec_state.backoff.num_to_propose()
        left = min(
            seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens
        )
        return min(k, left - 1)

    def verify(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Emitted]:
        """logits: [R, V] float32, 1 + len(spec_tokens) rows per sequence, in order."""
        self.tally.rows = logits.shape[0]
        self.tally.verified = any(s.spec_tokens for s in seqs)
        target, logprobs = target_tokens(logits, seqs)  # per sequence: k + 1 rows
        if not self.tally.verified:  # nothing proposed (e.g. paused): plain decoding's tokens
            return [[(t[0], lp[0])] for t, lp in zip(target, logprobs)]
        emitted, accepted = verify_point_mass(target, [s.spec_tokens for s in seqs])
        out = []
        for seq, tokens, lps, a in zip(seqs, emitted, logprobs, accepted):
            self._record(seq, a)
            out.append(list(zip(tokens, lps[: len(tokens)])))  # row j's logprob is token j's
        return out

    def _record(self, seq: Sequence, accepted: int) -> None:
        proposed = len(seq.spec_tokens)
        if proposed == 0:
            return
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        self.stats.verify_steps += 1
        self.stats.emitted += accepted + 1
        if seq.spec_state is not None:
            seq.spec_state.backoff.update(proposed, accepted)

    def settle(self, seq: Sequence, num_emitted: int) -> None:
        """After the emitted tokens were appended: the accepted proposals' KV is the
        sequence's; blocks that held only rejected slots go back to the pool."""
        self.tally.emitted += num_emitted
        if not seq.spec_tokens:  # a plain step (e.g. paused): no proposals, nothing to undo
            return
        seq.num_computed_tokens += num_emitted - 1
        seq.spec_tokens = []
        self.blocks.commit_full_blocks(seq)
        need = self.blocks.blocks_for(seq.num_tokens)
        if len(seq.block_table) > need:
            self.blocks.release(reversed(seq.block_table[need:]))
            del seq.block_table[need:]

    def after_step(self, scheduled: list, starts: list[int], hidden) -> None:
        """Model proposers draft for the next step from this step's hidden states [T, H]
        (scheduled: the step's (sequence, new tokens); starts: computed tokens before).
        Then the step's cost goes to the cost policy, if it only decoded."""
        if self.drafter is not None:
            self._draft(scheduled, starts, hidden)
        tally = self.tally
        if self.governor is not None and tally.rows == sum(n for _, n in scheduled):
            self.governor.finish(tally.verified, tally.emitted)

    def _draft(self, scheduled: list, starts: list[int], hidden) -> None:
        spans, rows, row = [], [], 0
        for (seq, n), start in zip(scheduled, starts):
            if not seq.finished and _may_speculate(seq):  # finished: its blocks are gone
                spans.append(Span(seq, start, seq.num_computed_tokens - start))
                rows.append(row)
            row += n
        draft = [s.seq for s in spans if s.seq.prompt_done and _may_speculate(s.seq)]
        for seq in draft:
            if seq.spec_state is None:
                seq.spec_state = SeqSpecState(AcceptanceBackoff(self.config.num_speculative_tokens))
        k = self.config.num_speculative_tokens
        # While the cost policy holds speculation back, only catch up (no drafts to pay for).
        drafting = draft if self.governor is None or self.governor.allow() else []
        drafts = self.drafter.after_step(spans, hidden, rows, drafting, k)
        for seq in draft:
            seq.spec_state.drafts = drafts.get(seq.seq_id, [])


def _may_speculate(seq: Sequence) -> bool:
    # Grammar-constrained sequences speculate too: each proposal row gets the mask of the
    # grammar state after the proposals before it (app/engine/structured/logits.py).
    return not seq.request.prefill_only
