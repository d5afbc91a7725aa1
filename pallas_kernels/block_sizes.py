"""Block sizes for the Pallas paged-attention kernels: a table, kept out of the kernels.

A row is keyed by (head_dim, page_size, dtype, query class). The query class is "decode"
for one query per sequence, "chunk" for prefill chunks of up to 64 queries and "prefill"
above that. `page_size` is part of the key but the kernels accept any page size: `block_k`
counts tokens, not pages, so a key block may start or end inside a page. A missing row
falls back to the row for the same (head_dim, dtype, query class) at any page size, then
to a generic default.

Status: starting points that follow the defaults of JAX's own Triton ops
(jax/experimental/pallas/ops/gpu: decode_attention.py, paged_attention.py) and keep one
pipelined stage of K and V under ~64 KiB of shared memory, so that two or three programs
fit on a Hopper SM (228 KiB); then, for head_dim 128 in bf16, one H200 sweep
(2026-12-04, jax 0.11.2, `benchmarks/h200_attention.py --sweep-only`: one knob at a time
around the row, at decode batch 32 x 8k and a 512-query chunk at 8k): block_k 128 took
decode 312 -> 265 us and the chunk 392 -> 333 us. The other rows are not tuned yet:
put the winners here, with the date and JAX version they were measured on.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    # Query rows per program in the ragged kernel: queries x query heads of one KV head
    # (padded to a power of two). The kernel keeps at least 16 (the smallest Triton dot).
    block_rows: int
    # Keys per inner step, in tokens: a power of two >= 16.
    block_k: int
    # Triton launch parameters (ignored in interpret mode).
    num_warps: int
    num_stages: int
    # Decode: split a sequence's keys across programs only down to this many keys each.
    min_keys_per_split: int = 256


# How many programs the decode kernel aims to launch: a few per SM keeps the memory system
# busy (an H200 has 132 SMs). More splits than that only add combine traffic.
PROGRAMS_TARGET = 4 * 132

_DEFAULT = BlockSizes(block_rows=64, block_k=64, num_warps=4, num_stages=2)

# (head_dim, page_size, dtype name, query class) -> BlockSizes
TABLE: dict[tuple[int, int | None, str, str], BlockSizes] = {
    # bf16, the serving dtype.
    (128, 16, "bfloat16", "decode"): BlockSizes(16, 128, num_warps=4, num_stages=3),
    (128, 16, "bfloat16", "chunk"): BlockSizes(64, 64, num_warps=4, num_stages=2),
    (128, 16, "bfloat16", "prefill"): BlockSizes(128, 128, num_warps=8, num_stages=2),
    (64, 16, "bfloat16", "decode"): BlockSizes(16, 128, num_warps=4, num_stages=3),
    (64, 16, "bfloat16", "chunk"): BlockSizes(64, 64, num_warps=4, num_stages=2),
    (64, 16, "bfloat16", "prefill"): BlockSizes(128, 64, num_warps=4, num_stages=2),
    # Any page size: same rows (block_k is in tokens, not pages).
    (128, None, "bfloat16", "decode"): BlockSizes(16, 128, num_warps=4, num_stages=3),
    (128, None, "bfloat16", "chunk"): BlockSizes(64, 64, num_warps=4, num_stages=2),
    (128, None, "bfloat16", "prefill"): BlockSizes(128, 128, num_warps=8, num_stages=2),
    (64, None, "bfloat16", "decode"): BlockSizes(16, 128, num_warps=4, num_stages=3),
    (64, None, "bfloat16", "chunk"): BlockSizes(64, 64, num_warps=4, num_stages=2),
    (64, None, "bfloat16", "prefill"): BlockSizes(128, 64, num_warps=4, num_stages=2),
    # float32 (tests, CPU parity): twice the bytes per key, so half the key block.
    (128, None, "float32", "decode"): BlockSizes(16, 32, num_warps=4, num_stages=2),
    (128, None, "float32", "chunk"): BlockSizes(32, 32, num_warps=4, num_stages=2),
    (128, None, "float32", "prefill"): BlockSizes(64, 32, num_warps=4, num_stages=2),
    (64, None, "float32", "decode"): BlockSizes(16, 64, num_warps=4, num_stages=2),
    (64, None, "float32", "chunk"): BlockSizes(32, 64, num_warps=4, num_stages=2),
    (64, None, "float32", "prefill"): BlockSizes(64, 64, num_warps=4, num_stages=2),
}


def query_class(queries: int) -> str:
    if queries == 1:
        return "decode"
    return "chunk" if queries <= 64 else "prefill"


def block_sizes(head_dim: int, page_size: int, dtype, queries: int) -> BlockSizes:
    """The table's row for these shapes (see the module docstring for the fallbacks)."""
    name = jnp.dtype(dtype).name
    cls = query_class(queries)
    for key in ((head_dim, page_size, name, cls), (head_dim, None, name, cls)):
        if key in TABLE:
            return TABLE[key]
    return _DEFAULT


def decode_splits(seqs: int, kv_heads: int, max_keys: int, sizes: BlockSizes,
                  programs_target: int = PROGRAMS_TARGET) -> int:
    """How many programs share one (sequence, KV head) in the decode kernel.

    Enough to reach `programs_target` programs in all, but never so many that a split
    would get fewer than `sizes.min_keys_per_split` of the `max_keys` keys a sequence can
    have (the page-table width times the page size). 1 means: no split, no combine.
    """
    want = -(-programs_target // max(1, seqs * kv_heads))
    cap = max(1, max_keys // max(sizes.min_keys_per_split, sizes.block_k))
    return max(1, min(want, cap))
