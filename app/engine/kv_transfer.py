"""KV import/export between the paged cache and KVChunks (the disaggregation seams; no Ray,
no Engine: the BlockManager owns the blocks, app/engine/transfers.py runs these off the step).

Import: ``plan_import`` checks a request's ``kv_import`` chunks against its prompt (header
work only); the BlockManager pins a block per whole block (``hold_for_import``), the
transfer worker writes the fresh ones (``write_import``), and the BlockManager makes them
findable (``commit_import``); admission's prefix match pins them again and the hold is
dropped, so only the uncovered tokens are computed. Every chunk's key
and prefix digest are recomputed from the request's own prompt and salt, so a chunk made for
another model, format, tenant (cache_salt) or earlier prefix is never used: the digest
covers every token from position 0, not only the chunk's own. Only whole blocks are
imported; a partial block at the end is recomputed (fewer than block_size tokens).

Export: after a ``prefill_only`` sequence samples its first token, its prompt KV is read out
as chunks of ``chunk_tokens`` (the last may be partial). A full chunk's hash is the hash of
its last block; a partial chunk's is next_hash(previous chunk's hash, its tokens).
"""

from __future__ import annotations

import logging

import torch

from app.engine.kv_cache import KVCache
from app.kv.chunk import ChunkIntegrityError, ChunkMismatchError, KVChunk
from app.kv.chunk_format import ChunkFormat
from app.kv.keys import BlockHash, chain_hashes, chunk_hash, next_hash

log = logging.getLogger(__name__)


def plan_import(
    fmt: ChunkFormat, request_id: str, prompt: list[int], chunks: list[KVChunk], salt: bytes
) -> tuple[list[KVChunk], list[BlockHash]]:
    """The chunks that continue the prompt under this salt, and the hashes of the whole
    blocks they cover (a partial block at the end is recomputed). Header work only: no
    payload byte is touched, so this runs on the caller's thread.

    Stops at the first chunk that does not continue the prompt under this salt.
    """
    bs, pos, parent = fmt.spec.block_size, 0, None
    run: list[KVChunk] = []
    hashes: list[BlockHash] = []
    for chunk in chunks:
        try:
            chunk_hashes = _verified_hashes(fmt, chunk, prompt, pos, parent, salt)
        except ChunkMismatchError as e:
            log.warning("kv_import of %s stopped at token %d: %s", request_id, pos, e)
            break
        run.append(chunk)
        n = chunk.meta.num_tokens
        hashes += chunk_hashes[: n // bs]
        pos += n
        if n % bs:  # a partial block ends the importable prefix
            break
        parent = chunk_hashes[-1]
    return run, hashes


def write_import(
    cache: KVCache, fmt: ChunkFormat, chunks: list[KVChunk], hold
) -> tuple[int, list[tuple[bytes, str]]]:
    """Writes the hold's fresh blocks from chunks (the transfer worker's half of an import;
    hold: block_manager.ImportHold over chunks' whole blocks, in order).

    A chunk decoded without its tag check (``verified`` False) is checked here, in the same
    pass as the write. Returns (blocks of the hold that are valid: all, or those before the
    first chunk whose tag does not match its bytes; [(key, why)] of that chunk)."""
    bs, first, fresh = fmt.spec.block_size, 0, set(hold.fresh)
    for chunk in chunks:
        mine = range(first, min(first + chunk.meta.num_tokens // bs, hold.num_blocks))
        todo = [i - first for i in mine if i in fresh]  # block offsets inside the chunk
        try:
            if todo:
                _write_chunk(cache, chunk, todo, [hold.block_ids[first + j] for j in todo], bs)
            elif not chunk.verified:  # not needed here, but a damaged chunk must be reported
                chunk.verify_tag()  # (and dropped from the store) by whoever fetched it
        except ChunkIntegrityError as e:
            log.warning("kv_import stopped at token %d: %s", first * bs, e)
            return min(first, hold.num_blocks), [(chunk.key or b"", str(e))]
        first += chunk.meta.num_tokens // bs
    return hold.num_blocks, []


def _write_chunk(cache: KVCache, chunk: KVChunk, todo: list[int], ids: list[int], bs: int):
    """Writes the chunk's blocks todo (offsets) into cache blocks ids; checks the tag first
    if the chunk is unverified (layer by layer, right before each layer's write)."""
    kv, scales = chunk.to_tensors()  # kv: [L, P, n, Hkv, D], CPU views of the payload
    if not cache.layer_writes:  # a TP shard: verify, then write_tokens splits the heads
        if not chunk.verified:
            chunk.verify_tag()
        for j, block_id in zip(todo, ids):
            sl = slice(j * bs, (j + 1) * bs)
            cache.write_tokens(
                [block_id], kv[:, :, sl], None if scales is None else scales[:, :, sl]
            )
        return
    hasher = None if chunk.verified else chunk.tag_hasher()
    per_layer = kv[0].numel() * kv.element_size()  # payload: kv layer by layer, then scales
    pairs = list(zip(todo, ids))
    for layer in range(kv.shape[0]):
        if hasher is not None:
            hasher.update(chunk.payload[layer * per_layer : (layer + 1) * per_layer])
        sc = None if scales is None else scales[layer]
        cache.write_layer_blocks(layer, pairs, kv[layer], sc)
    if hasher is not None:
        if scales is not None:
            hasher.update(chunk.payload[kv.numel() * kv.element_size() :])
        chunk.check_tag(hasher.intdigest())


def _verified_hashes(
    fmt: ChunkFormat, chunk: KVChunk, prompt, pos: int, parent: BlockHash | None, salt: bytes
) -> list[BlockHash]:
    """The hashes of the chunk's whole blocks, recomputed from the prompt; raises
    ChunkMismatchError unless the chunk is exactly this prompt's KV at pos."""
    fmt.check(chunk)
    m = chunk.meta
    if m.start_pos != pos or tuple(prompt[pos : pos + m.num_tokens]) != m.token_ids:
        raise ChunkMismatchError("chunk tokens do not continue the prompt")
    hashes = chain_hashes(m.token_ids, fmt.spec.block_size, salt, parent)
    full = fmt.is_full(m.num_tokens)
    want = hashes[-1] if full else next_hash(parent, m.token_ids, salt)
    if chunk.key != want.key:
        raise ChunkMismatchError("chunk key does not match the prompt under this request's salt")
    if m.digest != want.digest:  # same key, other prefix or salt: a (crafted) collision
        raise ChunkMismatchError("chunk prefix digest does not match the prompt and salt")
    return hashes


def export_chunks(
    cache: KVCache, fmt: ChunkFormat, token_ids: list[int], block_table: list[int], salt: bytes
) -> list[KVChunk]:
    """token_ids' KV as chunks of chunk_tokens (full ones, then a partial last one)."""
    kv, scales = cache.read_tokens(block_table, len(token_ids))  # [L, P, n, Hkv, D]
    return encode_chunks(fmt, token_ids, kv, scales, salt)


def encode_chunks(
    fmt: ChunkFormat, token_ids: list[int], kv: torch.Tensor, scales, salt: bytes
) -> list[KVChunk]:
    """kv [L, P, n, Hkv, D] (scales [L, P, n, Hkv] or None) of token_ids -> chunks."""
    n, ct = len(token_ids), fmt.chunk_tokens
    chunks, parent = [], None
    for start in range(0, n, ct):
        end = min(start + ct, n)
        tokens = tuple(token_ids[start:end])
        h = chunk_hash(parent, tokens, salt, fmt.spec.block_size, fmt.is_full(len(tokens)))
        meta = fmt.meta(tokens, start, h, parent)
        sc = None if scales is None else scales[:, :, start:end]
        chunks.append(KVChunk.from_tensors(meta, kv[:, :, start:end], sc))
        parent = h
    return chunks
