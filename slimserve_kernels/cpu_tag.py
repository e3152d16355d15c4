"""A KV chunk's xxh3_64 tag computed while its bytes are copied (`csrc/kv_tag_cpu.cpp`), built
just in time (`cpu_build.py`: once per source and torch version, AVX-512 / AVX2 / baseline
copies picked at run time).

`CopyingTag` is a streaming xxh3_64 (seed 0; the `xxhash` package's digest, bit for bit)
fed by `update(piece)`, `copy(dst, src)`, and the chunk copies `copy_planes` (an export's
encode: a chunk's planes into its payload) and `copy_blocks` (an import: a chunk into a
paged cache's blocks): each copies and, given a tag, folds the bytes into it in the same
pass, so an export or import reads each byte once instead of copying then hashing it
(docs/kv_transfer.md, "Integrity in the same pass"). Without a tag they are the same copies,
one call per chunk instead of a torch op per layer.

`available()` is False (callers keep a copy then `xxhash` over the copied bytes) when the
kernels are off (`SLIMSERVE_CPU_KERNELS=0`, read on every call) or the build failed.
"""

from __future__ import annotations

import logging
import warnings

import torch
import xxhash

from slimserve_kernels import cpu_build

log = logging.getLogger(__name__)

FALLBACK = "a copy, then xxhash over the copied bytes"
WHAT = "CPU KV tag in the copy"
# available(): on (SLIMSERVE_CPU_KERNELS) and built; load(): the extension (built at the
# first call), or None where it does not build (logged once)
available, load = cpu_build.loader("kv_tag_cpu", WHAT, FALLBACK, log)
SHORT_MAX = 240  # xxh3 hashes inputs up to this many bytes by other formulas: the package does


def _bytes(t: torch.Tensor | memoryview | bytes | bytearray) -> torch.Tensor:
    """A contiguous CPU tensor over the same memory (buffers wrapped without a copy)."""
    if isinstance(t, torch.Tensor):
        return t
    view = memoryview(t).cast("B")
    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only buffer (a received chunk): only read
        return torch.frombuffer(view, dtype=torch.uint8)


class CopyingTag:
    """xxh3_64 of everything fed, in order: `update` hashes a piece; `copy` and the
    module's `copy_planes` / `copy_blocks` copy bytes and hash them in one pass. Quacks
    like `xxhash.xxh3_64` (`update`, `intdigest`), so the code that feeds a tag takes
    either."""

    def __init__(self, prefix: bytes = b""):
        self._ext = load()
        assert self._ext is not None, "cpu_tag.available() first"
        self._state = self._ext.state_new()
        if prefix:
            self.update(prefix)

    def update(self, piece) -> None:
        self._ext.update(self._state, _bytes(piece))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst[:] = src (bytes; both contiguous CPU tensors of one byte size), src hashed."""
        self._ext.copy(self._state, dst, src)

    def intdigest(self) -> int:
        if self._ext.total(self._state) <= SHORT_MAX:  # a short input: its own formulas,
            # over the bytes the state kept
            return xxhash.xxh3_64_intdigest(self._ext.head(self._state).numpy().tobytes())
        return self._ext.digest(self._state) & 0xFFFF_FFFF_FFFF_FFFF


def copy_planes(dst: torch.Tensor, src: torch.Tensor, tag: CopyingTag | None = None) -> None:
    """dst[:] = src's planes src[a, b] (each contiguous; any strides over a and b) back to
    back, in order, fed to tag (if any) in the same pass: one call for a chunk's kv or
    scales (dst: contiguous, their byte size)."""
    load().copy_planes(None if tag is None else tag._state, dst, src)


def copy_blocks(
    src: torch.Tensor,
    cache: torch.Tensor,
    runs: list[tuple[int, int, int]],
    tag: CopyingTag | None = None,
) -> None:
    """A chunk's src [L, P, n, ...] (contiguous) into cache [L, P, num_blocks, block_size,
    ...] (contiguous): each run (j, block, k) puts the chunk's blocks j..j+k-1 in cache
    blocks block..block+k-1 (runs ascending in j). tag (if any) is fed every byte of src in
    order, the blocks not written too, in the same pass."""
    table = torch.tensor(runs, dtype=torch.int64).view(-1, 3)
    load().copy_blocks(None if tag is None else tag._state, src, cache, table)
