"""Speculative decoding: proposers (n-gram, MTP, draft model) and exact verification.

A proposer guesses the next k tokens of a sequence cheaply; the target model scores all k
in one batched forward (the extend path of paged attention) and verification keeps the
longest prefix the target agrees with, plus one token of the target's own. Verification
is exact: greedy output equals non-speculative greedy output, and sampled output has the
target's distribution (docs/speculative_decoding.md).
"""
