"""Paged KV block pool with a prefix cache (no tensors, no model).

Blocks are reference-counted. A full block gets a chained hash (app/kv/keys.py) and stays
findable by its xxh3 key after its last user frees it, until the pool needs the space (LRU).
A prefix hit is accepted only if the cached block's BLAKE2b prefix digest equals the
prompt's, which proves the salt and every token up to the block's end equal: a key
collision, crafted or not, can never hand one prompt another prefix's KV.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from app.engine.sequence import Sequence
from app.kv.keys import BlockHash, next_hash


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: BlockHash | None = None  # set while the block is findable in the prefix cache


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # full blocks looked up
    hits: int = 0
    evictions: int = 0
    collisions: int = 0  # key matched but the prefix digest did not


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
            parent = next_hash(parent, tokens[start : start + bs], seq.salt)
            self.stats.queries += 1
            block = self.lookup(parent)
            if block is None:
                break
            self.stats.hits += 1
            self._pin(block)
            seq.block_table.append(block.block_id)
            seq.block_hashes.append(parent)
        covered = len(seq.block_table) * bs
        seq.num_computed_tokens = seq.num_cached_tokens = covered
        return covered

    def lookup(self, h: BlockHash) -> Block | None:
        """The cached block for h, only if its prefix digest equals h's (else a collision)."""
        block_id = self.cached.get(h.key)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.hash.digest != h.digest:
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
        for i in range(len(seq.block_hashes), n_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = next_hash(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.salt)
            seq.block_hashes.append(h)
            self._register(self.blocks[seq.block_table[i]], h)

    def _register(self, block: Block, h: BlockHash) -> bool:
        """Makes block findable under h unless caching is off or h's key is taken."""
        if block.hash is not None or not self.enable_prefix_caching or h.key in self.cached:
            return False
        block.hash = h
        self.cached[h.key] = block.block_id
        return True

    # --- import: KV computed elsewhere (app/engine/kv_transfer.py) -------------------
    def is_cached(self, h: BlockHash) -> bool:
        return not self.enable_prefix_caching or h.key in self.cached

    def take_for_import(self, h: BlockHash) -> int | None:
        """A fresh block registered under h, pinned until release(); None if the pool is
        short. The caller writes the block's KV before anything else can look it up."""
        if self.num_free == 0:
            return None
        block = self._take()
        self._register(block, h)
        return block.block_id

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

    def _take(self) -> Block:
        if self.free_plain:
            block = self.blocks[self.free_plain.popleft()]
        else:
            block_id, _ = self.free_cached.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached[block.hash.key]
            block.hash = None
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
                if block.hash is not None:
                    self.free_cached[block_id] = None
                else:
                    self.free_plain.append(block_id)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks
