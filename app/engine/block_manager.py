"""Paged KV block pool with a prefix cache (no tensors, no model).

Blocks are reference-counted. A full block gets a chained key (block_hash.py) and stays
findable after its last user frees it, until the pool needs the space (LRU). A prefix hit is
accepted only if the cached block's token ids equal the prompt's, so a hash collision can
never hand one prompt another prompt's KV.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from app.engine.block_hash import block_key
from app.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # full blocks looked up
    hits: int = 0
    evictions: int = 0
    collisions: int = 0  # key matched but token ids did not


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_plain: deque[int] = deque(range(num_blocks))  # hold nothing reusable
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.cached: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache -------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Pins the longest cached run of seq's full blocks; returns tokens covered.

        At least one token is left to compute, since sampling needs its logits.
        """
        if not self.enable_prefix_caching:
            return 0
        bs, tokens = self.block_size, seq.token_ids
        parent = None
        for start in range(0, len(tokens) - 1 - bs + 1, bs):
            chunk = tokens[start : start + bs]
            key = block_key(parent, chunk, seq.salt)
            self.stats.queries += 1
            block = self._lookup(key, chunk)
            if block is None:
                break
            self.stats.hits += 1
            self._pin(block)
            seq.block_table.append(block.block_id)
            seq.block_keys.append(key)
            parent = key
        covered = len(seq.block_table) * bs
        seq.num_computed_tokens = seq.num_cached_tokens = covered
        return covered

    def _lookup(self, key: bytes, chunk) -> Block | None:
        block_id = self.cached.get(key)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != tuple(chunk):
            self.stats.collisions += 1
            return None
        return block

    def _pin(self, block: Block) -> None:
        if block.ref_count == 0:
            self.free_cached.pop(block.block_id, None)
        block.ref_count += 1

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Gives every newly computed full block of seq a key and makes it findable."""
        bs = self.block_size
        n_full = seq.num_computed_tokens // bs
        for i in range(len(seq.block_keys), n_full):
            chunk = seq.token_ids[i * bs : (i + 1) * bs]
            parent = seq.block_keys[-1] if seq.block_keys else None
            key = block_key(parent, chunk, seq.salt)
            seq.block_keys.append(key)
            block = self.blocks[seq.block_table[i]]
            if block.key is None and self.enable_prefix_caching and key not in self.cached:
                block.key, block.token_ids = key, tuple(chunk)
                self.cached[key] = block.block_id

    # --- allocation ---------------------------------------------------------------
    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grows seq's block table to hold num_tokens; False (nothing taken) if short."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        seq.block_table.extend(self._take().block_id for _ in range(need))
        return True

    def allocate_blocks(self, n: int) -> list[int] | None:
        """n fresh blocks with ref_count 1 (for imports); None if the pool is short."""
        if n > self.num_free:
            return None
        return [self._take().block_id for _ in range(n)]

    def _take(self) -> Block:
        if self.free_plain:
            block = self.blocks[self.free_plain.popleft()]
        else:
            block_id, _ = self.free_cached.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached[block.key]
            block.key, block.token_ids = None, ()
            self.stats.evictions += 1
        block.ref_count = 1
        return block

    def free(self, seq: Sequence) -> None:
        """Releases seq's blocks, tail first, so a prefix's head is evicted last."""
        self.release(reversed(seq.block_table))
        seq.block_table = []

    def release(self, block_ids) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.key is not None:
                    self.free_cached[block_id] = None
                else:
                    self.free_plain.append(block_id)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks
