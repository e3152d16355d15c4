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
from collections.abc import Sequence
from concurrent.futures import Executor, Future

import torch

from app.engine.kv_cache import KVCache
from app.kv.chunk import ChunkIntegrityError, ChunkMismatchError, KVChunk
from app.kv.chunk_format import ChunkFormat
from app.kv.keys import BlockHash, chain_hashes, chunk_hash, next_hash
from app.kv.tagging import ThreadedTag
from slimserve_kernels.cpu_tag import CopyingTag

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
    cache: KVCache, fmt: ChunkFormat, chunks: list[KVChunk], hold, tagger: Executor | None = None
) -> tuple[int, list[tuple[bytes, str]]]:
    """Writes the hold's fresh blocks from chunks (the transfer worker's half of an import;
    hold: block_manager.ImportHold over chunks' whole blocks, in order).

    A chunk decoded without its tag check (``verified`` False) is checked here, in the same
    pass as the write: hashed on this thread, or on ``tagger`` (a one-thread executor)
    beside the writes. Either way nothing is findable before the check: the caller commits only the
    valid blocks. Returns (blocks of the hold that are valid: all, or those before the first
    chunk whose tag does not match its bytes; [(key, why)] of that chunk)."""
    bs, first, fresh, bad = fmt.spec.block_size, 0, set(hold.fresh), None
    starts, tags = [], []  # tags: the tagger's Future per chunk (None: checked here / no need)
    for chunk in chunks:
        starts.append(first)
        mine = range(first, min(first + chunk.meta.num_tokens // bs, hold.num_blocks))
        todo = [i - first for i in mine if i in fresh]  # block offsets inside the chunk
        tag = None
        try:
            if todo:
                ids = [hold.block_ids[first + j] for j in todo]
                tag = _write_chunk(cache, chunk, todo, ids, bs, tagger)
            elif not chunk.verified:  # not needed here, but a damaged chunk must be reported
                # (and dropped from the store) by whoever fetched it
                tag = tagger.submit(chunk.content_tag) if tagger else chunk.verify_tag()
        except ChunkIntegrityError as e:
            bad = (len(starts) - 1, e)
            break
        tags.append(tag)
        first += chunk.meta.num_tokens // bs
    if bad is None:  # the tagger's tags, in chunk order: the first mismatch
        bad = _first_mismatch(chunks[: len(starts)], tags)
    if bad is None:
        return hold.num_blocks, []
    i, e = bad
    log.warning("kv_import stopped at token %d: %s", starts[i] * bs, e)
    return min(starts[i], hold.num_blocks), [(chunks[i].key or b"", str(e))]


def _first_mismatch(chunks: list[KVChunk], tags: list) -> tuple[int, Exception] | None:
    for i, (chunk, tag) in enumerate(zip(chunks, tags)):
        try:
            if tag is not None:
                chunk.check_tag(tag.result())
        except ChunkIntegrityError as e:
            return i, e
    return None


def _write_chunk(
    cache: KVCache, chunk: KVChunk, todo: list[int], ids: list[int], bs: int, tagger
) -> Future | None:
    """Writes the chunk's blocks todo (offsets) into cache blocks ids. An unverified chunk's
    tag is computed in the write: folded into the C++ copy (a CPU cache where the kernels
    build), or fed each layer right after that layer's write, or hashed on tagger (its
    tag's Future returned); checked here at the end otherwise."""
    kv, scales = chunk.to_tensors()  # kv: [L, P, n, Hkv, D], CPU views of the payload
    if not cache.layer_writes:  # a TP shard: verify, then write_tokens splits the heads
        if not chunk.verified:
            chunk.verify_tag()
        for j, block_id in zip(todo, ids):
            sl = slice(j * bs, (j + 1) * bs)
            cache.write_tokens(
                [block_id], kv[:, :, sl], None if scales is None else scales[:, :, sl]
            )
        return None
    in_kernel = cache.copies_in_kernel(kv)  # every layer in one C++ call per tensor
    hasher = None
    if not chunk.verified:
        if tagger is not None:
            hasher = ThreadedTag(chunk.tag_hasher(), tagger)
        else:  # in the kernel: the tag folded into the copy, each byte read once
            hasher = chunk.tag_hasher(copying=in_kernel)
    if in_kernel and (hasher is None or isinstance(hasher, CopyingTag)):
        cache.write_blocks(list(zip(todo, ids)), kv, scales, hasher)
    else:
        _write_layers(cache, chunk, kv, scales, list(zip(todo, ids)), hasher)
    if hasher is None:
        return None
    if tagger is not None:
        return hasher.finish()
    chunk.check_tag(hasher.intdigest())
    return None


def _write_layers(cache: KVCache, chunk: KVChunk, kv, scales, pairs, hasher) -> None:
    """The write layer by layer in torch ops, hasher (if any) fed each layer's payload bytes
    right after its write (they are still in cache), then the scales'."""
    per_layer = kv[0].numel() * kv.element_size()  # payload: kv layer by layer, then scales
    for layer in range(kv.shape[0]):
        sc = None if scales is None else scales[layer]
        cache.write_layer_blocks(layer, pairs, kv[layer], sc)
        if hasher is not None:
            hasher.update(chunk.payload[layer * per_layer : (layer + 1) * per_layer])
    if hasher is not None and scales is not None:
        hasher.update(chunk.payload[kv.numel() * kv.element_size() :])


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
    fmt: ChunkFormat,
    token_ids: list[int],
    kv: torch.Tensor,
    scales,
    salt: bytes,
    tagger: Executor | None = None,
    block_hashes: Sequence[BlockHash] = (),
    first: int = 0,
) -> list[KVChunk]:
    """kv [L, P, n - first, Hkv, D] (scales [L, P, n - first, Hkv] or None) of
    token_ids[first:] -> chunks, each tagged on ``tagger`` while the next is copied (or else
    in the same pass as its copy). ``first``: where the chunks start, a chunk boundary (an
    export of the chunks computed so far, then of the rest); their parent is the hash of
    the block before it, from ``block_hashes``.

    block_hashes: the hashes of token_ids' full blocks under salt that the block manager
    already made (Sequence.block_hashes); a full chunk's hash is its last block's, so it is
    taken from there instead of hashing the tokens (keys and BLAKE2b digests) again."""
    n, ct, bs = len(token_ids), fmt.chunk_tokens, fmt.spec.block_size
    assert first % ct == 0 and first // bs <= len(block_hashes), "first: a known chunk boundary"
    parts, parent = [], block_hashes[first // bs - 1] if first else None
    for start in range(first, n, ct):
        end = min(start + ct, n)
        tokens = tuple(token_ids[start:end])
        full = fmt.is_full(len(tokens))
        if full and end // bs <= len(block_hashes):
            h = block_hashes[end // bs - 1]
        else:
            h = chunk_hash(parent, tokens, salt, bs, full)
        sc = None if scales is None else scales[:, :, start - first : end - first]
        parts.append(
            (fmt.meta(tokens, start, h, parent), kv[:, :, start - first : end - first], sc)
        )
        parent = h
    if tagger is not None:
        return KVChunk.from_tensors_overlapped(parts, tagger)
    return [KVChunk.from_tensors(*part) for part in parts]
