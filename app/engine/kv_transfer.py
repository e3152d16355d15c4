"""KV import/export between the paged cache and KVChunks (the disaggregation seams; no Ray).

Import: a request's ``kv_import`` chunks are written into fresh blocks that are registered
in the prefix cache and released (ref count 0), so the normal prefix match at admission
pins them and only the uncovered tokens are computed. Every block key is recomputed from
the prompt and the request's salt, so a chunk made for another model, format or tenant
(cache_salt) can never be used. Only whole blocks are imported; a partial block at the end
is recomputed (fewer than block_size tokens).

Export: after a ``prefill_only`` sequence samples its first token, its prompt KV is read
out as chunks of ``chunk_tokens`` (the last may be partial). A full chunk's key is the block
key of its last block; a partial chunk's key is block_key(previous chunk key, its tokens).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from app.engine.block_hash import block_key
from app.kvstore.chunk import ChunkMeta, KVChunk

if TYPE_CHECKING:
    from app.engine.engine import Engine
    from app.engine.request import Request
    from app.engine.sequence import Sequence

log = logging.getLogger(__name__)


def import_chunks(engine: Engine, request: Request, salt: bytes) -> int:
    """Registers the chunks' whole blocks in the prefix cache; returns the tokens covered.

    Stops at the first chunk that does not continue the prompt under this salt.
    """
    blocks, cache, bs = engine.blocks, engine.cache, engine.kv_spec.block_size
    prompt, pos, parent = request.prompt_token_ids, 0, None
    for chunk in request.kv_import or []:
        problem = _mismatch(engine, chunk, prompt, pos, parent, salt)
        if problem:
            log.warning("kv_import of %s stopped at token %d: %s", request.request_id, pos, problem)
            break
        kv, scales = chunk.to_tensors()  # kv: [L, 2, n, Hkv, D]
        n = chunk.meta.num_tokens
        for j in range(n // bs):
            tokens = prompt[pos + j * bs : pos + (j + 1) * bs]
            parent = block_key(parent, tokens, salt)
            if parent in blocks.cached or not blocks.enable_prefix_caching:
                continue
            ids = blocks.allocate_blocks(1)
            if ids is None:  # pool full: the rest is recomputed
                return pos + j * bs
            sl = slice(j * bs, (j + 1) * bs)
            cache.write_tokens(ids, kv[:, :, sl], None if scales is None else scales[:, :, sl])
            block = blocks.blocks[ids[0]]
            block.key, block.token_ids = parent, tuple(tokens)
            blocks.cached[parent] = ids[0]
            blocks.release(ids)
        pos += n
        if n % bs:  # a partial block ends the importable prefix
            return pos - n % bs
        parent = chunk.key
    return pos


def _mismatch(engine: Engine, chunk: KVChunk, prompt, pos: int, parent, salt) -> str:
    m, spec = chunk.meta, engine.kv_spec
    if (m.fingerprint, m.kv_dtype, m.layout) != (engine.fingerprint, spec.dtype_name, spec.layout):
        return f"chunk is for {m.fingerprint}/{m.kv_dtype}/{m.layout}"
    if m.start_pos != pos or tuple(prompt[pos : pos + m.num_tokens]) != m.token_ids:
        return "chunk tokens do not continue the prompt"
    ct = engine.config.cache.chunk_tokens
    if chunk.key != expected_chunk_key(parent, m.token_ids, salt, spec.block_size, ct):
        return "chunk key does not match the prompt under this request's salt"
    return ""


def expected_chunk_key(parent, token_ids, salt: bytes, block_size: int, chunk_tokens: int):
    """A full chunk's key chains its blocks; a partial one hashes its tokens in one go."""
    if len(token_ids) % block_size or len(token_ids) < chunk_tokens:
        return block_key(parent, token_ids, salt)
    key = parent
    for start in range(0, len(token_ids), block_size):
        key = block_key(key, token_ids[start : start + block_size], salt)
    return key


def export_chunks(engine: Engine, seq: Sequence) -> list[KVChunk]:
    """The prompt's KV as chunks of chunk_tokens (full ones, then a partial last one)."""
    spec, ct = engine.kv_spec, engine.config.cache.chunk_tokens
    n = seq.num_prompt_tokens
    kv, scales = engine.cache.read_tokens(seq.block_table, n)  # [L, 2, n, Hkv, D]
    chunks, parent = [], None
    for start in range(0, n, ct):
        end = min(start + ct, n)
        tokens = tuple(seq.token_ids[start:end])
        key = expected_chunk_key(parent, tokens, seq.salt, spec.block_size, ct)
        meta = ChunkMeta(
            engine.fingerprint, spec.dtype_name, spec.layout, tokens, start, key, parent
        )
        sc = None if scales is None else scales[:, :, start:end]
        chunks.append(KVChunk.from_tensors(meta, kv[:, :, start:end], sc))
        parent = key
    return chunks
