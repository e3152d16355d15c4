"""Paged KV block pool with a prefix cache (no tensors, no model).

Blocks are reference-counted. A full block gets a chained hash (app/kv/keys.py) and stays
findable by its xxh3 key after its last user frees it, until the pool needs the space (LRU).
A prefix hit is accepted only if the cached block's BLAKE2b prefix digest equals the
prompt's, which proves the salt and every token up to the block's end equal: a key
collision, crafted or not, can never hand one prompt another prefix's KV.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from app.engine.sequence import Sequence
from app.kv.keys import BlockHash, next_hash


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: BlockHash | None = None  # set while the block is findable in the prefix cache


@dataclass(slots=True)
class ImportHold:
    """Blocks pinned for one request's imported KV, from import until admission or abort."""

    block_ids: list[int] = field(default_factory=list)  # in prompt order, whole blocks
    hashes: list[BlockHash] = field(default_factory=list)
    fresh: list[int] = field(default_factory=list)  # indices the transfer worker writes
    ready: bool = False  # written and committed: the request may be admitted

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


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
        self.num_held = 0  # blocks pinned by imports waiting for admission
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

    # --- import / export: KV that crosses processes (app/engine/transfers.py) ----------
    def hold_for_import(self, hashes: list[BlockHash], max_held: int) -> ImportHold:
        """Pins a block for each of hashes, in order: the cached one if the prefix cache
        has it, else a fresh one for the transfer worker to write (findable only once
        commit_import says it was written and verified). Stops when the pool is short or
        max_held blocks are held by imports. Held until release_hold (admission or abort)."""
        hold = ImportHold()
        for h in hashes if self.enable_prefix_caching else ():
            if self.num_held + 1 > max_held:
                break
            block = self.lookup(h)
            if block is not None:
                self._pin(block)
            elif self.num_free == 0:
                break
            else:
                block = self._take()
                hold.fresh.append(len(hold.block_ids))
            hold.block_ids.append(block.block_id)
            hold.hashes.append(h)
            self.num_held += 1
        return hold

    def commit_import(self, hold: ImportHold, num_valid: int) -> None:
        """The worker wrote the fresh blocks: those among the first num_valid become findable
        (the rest, after a chunk that failed its tag, stay anonymous); admission may run."""
        for i in hold.fresh:
            if i < num_valid:
                self._register(self.blocks[hold.block_ids[i]], hold.hashes[i])
        hold.ready = True

    def release_hold(self, hold: ImportHold) -> None:
        """Unpins an import's blocks (idempotent): after admission pinned them again, or on
        abort / failure (then the blocks go back to the pool)."""
        self.num_held -= len(hold.block_ids)
        self.release(hold.block_ids)
        hold.block_ids, hold.hashes, hold.fresh = [], [], []

    def pin_for_export(self, block_ids: list[int]) -> list[int]:
        """Pins blocks a running sequence still owns, for an export of its computed chunks
        to read while it goes on (a preempted or aborted sequence then frees nothing the
        reader is using); the exporter gives them back with release()."""
        for block_id in block_ids:
            self._pin(self.blocks[block_id])
        return list(block_ids)

    def hand_over(self, seq: Sequence) -> list[int]:
        """seq's blocks, still pinned, for an export to read after seq ends; the exporter
        gives them back with release()."""
        block_ids, seq.block_table = seq.block_table, []
        return block_ids

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
