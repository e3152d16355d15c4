"""The KV vocabulary every layer shares (no Ray, no model code).

- `dtypes`: the table of KV cache dtypes (storage dtype, scales, bytes per token-head);
- `layout`: `KVCacheSpec` (what one cache holds) and `KVLayout` (the layout string and parser);
- `keys`: chained block keys (xxh3, the fast lookup) and prefix digests (BLAKE2b, the proof);
- `chunk`: the wire codec of KV that crosses a process boundary;
- `chunk_format`: what an engine stamps on its chunks and what its readers require.
"""
