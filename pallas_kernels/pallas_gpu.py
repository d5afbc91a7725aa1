"""Paged attention as Pallas kernels for NVIDIA GPUs, reading the KV page pool in place.

Semantics are `reference.paged_attention_dense`'s: query i of sequence s sits at
position context_lens[s] - query_lens[s] + i and attends causally to keys [0, position];
rows past query_lens[s] are padding and come out as zeros.

Two kernels share one inner loop (`_attend_key_blocks`, an online softmax over key blocks):

- `_ragged_kernel`, the mixed step: grid (sequence, KV head, query block). One program
  takes a block of a sequence's queries *and all the query heads of one KV head* (GQA),
  so a program reads each key block once for all those heads, whatever the head ratio
  (a sequence's pages are read once per KV head and query block). It walks the key
  blocks up to the causal limit of its last valid query only. A prefill chunk, a chunk that
  starts mid-page, and a lone decode token are the same case.
- `_decode_kernel`, flash decoding: one query per sequence, grid (sequence, KV head,
  split). Each split takes an even share of the key blocks the sequence really has (its
  context length is read at run time, so short sequences in a long bucket cost little) and
  writes an unnormalised partial output with its running max and sum; `_combine_splits`
  merges them in jnp. It pays off when sequences x KV heads alone would leave SMs idle
  (small batches at long context); `block_sizes.decode_splits` decides, and with one split
  the ragged kernel runs instead.

Neither kernel writes anything but its output (the decode partials are outputs of its
pallas_call, merged and dropped in the same jitted function).

Reading pages in place. The pool stays [num_pages, page_size, kv_heads, head_dim], never
reshaped (a reshaped view beside the step's one-token write made XLA copy the whole pool:
docs/architecture.md); a kernel's BlockSpec selects one KV head of it (a strided view:
nothing is copied), and the kernel turns each key block's token positions into (page,
offset) pairs through the page table (page_tables[s, t // page_size], t % page_size) and
gathers them.
So any page size works, a key block may span pages or start inside one, and the page table
is read per key block from memory (the Triton lowering has no scalar prefetch). Page ids
are clamped into the pool, so a bad table reads a wrong page, never outside the buffer.

GPU lowering: Triton (`compiler_params=jax.experimental.pallas.triton.CompilerParams`),
chosen over Mosaic GPU for a gather through a page table on Ampere to Hopper; the reasons,
what runs where, and the way out when JAX drops the Triton lowering are in
docs/attention.md. Tuned block sizes live in `block_sizes.py`.
(About 470 lines: two kernels that share one inner loop, their host-side plan and their
split merge stay beside each other.)

`PallasBackend` (end of file) is how the runner uses these kernels: the pool's layers are
one array, so a layer is a page offset added to the tables.

The file reads top to bottom as JAX's own Pallas ops do (kernels, `pallas_call` wrappers,
the validated public entry, the backend) and runs past 350 lines on purpose: a kernel and
the launch that tiles it are read together.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import block_sizes as bs
from .backends import AttentionBackend

__all__ = ["paged_attention_pallas", "PallasBackend", "PallasInterpretBackend"]

_NEG = -1e30  # masked score (finite: -inf - -inf would be NaN)
_LOG2E = math.log2(math.e)
_MIN_DOT = 16  # the smallest M, N and K a Triton dot takes


# ---------------------------------------------------------------------------------------
# Kernels


def _attend_key_blocks(
    q,  # [rows, head_dim] value: the program's query rows
    q_pos,  # [rows] int32: position of each row's query
    row_ok,  # [rows] bool: row is a real query (not padding)
    k_ref,  # [num_pages, page_size, head_dim] ref: one KV head of the pool
    v_ref,  # [num_pages, page_size, head_dim] ref
    pt_ref,  # [padded_pages_per_seq] int32 ref: this sequence's page table
    kb_start,  # int32 scalar: first key block
    kb_end,  # int32 scalar: one past the last key block
    *,
    page_size: int,
    block_k: int,
    scale_log2: float,
    precision,
    window: int = 0,
):
    """Online softmax over key blocks [kb_start, kb_end). Returns (m, l, acc): the running
    max (log2 units), the running sum and the unnormalised output, all float32. `window`
    > 0: a query sees only the `window` keys ending at its own."""
    rows, head_dim = q.shape
    last_page = k_ref.shape[0] - 1
    # Never past the (padded) page table, even if a context length overstates it.
    kb_end = jnp.minimum(kb_end, pt_ref.shape[0] * page_size // block_k)

    def body(kb, carry):
        m, l, acc = carry
        k_pos = kb * block_k + lax.iota(jnp.int32, block_k)  # [block_k]
        pages = pt_ref[lax.div(k_pos, page_size)]  # [block_k]: a page id per key
        pages = jnp.clip(pages, 0, last_page)
        offsets = lax.rem(k_pos, page_size)
        k = k_ref[pages, offsets]  # [block_k, head_dim]
        v = v_ref[pages, offsets]  # [block_k, head_dim]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)  # [rows, block_k]
        s = s * scale_log2
        mask = (k_pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
        if window:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)
        corr = jnp.exp2(m - m_new)
        l = l * corr + p.sum(axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
        return m_new, l, acc * corr[:, None] + pv

    init = (
        jnp.full((rows,), _NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    return lax.fori_loop(kb_start, kb_end, body, init)


def _ragged_kernel(
    # inputs
    context_lens_ref,  # [seqs] int32
    query_lens_ref,  # [seqs] int32
    pt_ref,  # [padded_pages_per_seq] int32: this sequence's page table
    q_ref,  # [block_q, group, head_dim]: a block of queries x the query heads of one KV
    #         head (group: heads per KV head, zero-padded to a power of two)
    k_ref,  # [num_pages * page_size, head_dim]: this KV head of the pool
    v_ref,  # [num_pages * page_size, head_dim]
    # outputs
    o_ref,  # [block_q, group, head_dim]
    *,
    page_size: int,
    block_k: int,
    scale_log2: float,
    precision,
    window: int = 0,
):
    seq, q_block = pl.program_id(0), pl.program_id(2)
    block_q, group, head_dim = q_ref.shape
    rows = block_q * group
    context_len = context_lens_ref[seq]
    query_len = query_lens_ref[seq]
    first_q = q_block * block_q

    # Row r holds query first_q + r // group, query head r % group of this KV head.
    q_idx = first_q + lax.div(lax.iota(jnp.int32, rows), group)
    q_pos = context_len - query_len + q_idx
    row_ok = q_idx < query_len
    # Keys needed: up to the last valid query of this block (none if the block is padding).
    valid = jnp.clip(query_len - first_q, 0, block_q)
    kv_end = jnp.where(valid > 0, context_len - query_len + first_q + valid, 0)

    # A sliding window: key blocks before the block's first query's window are skipped.
    kb_start = 0
    if window:
        first_pos = context_len - query_len + first_q
        kb_start = jnp.maximum(first_pos - window + 1, 0) // block_k

    q = q_ref[...].reshape(rows, head_dim)
    _, l, acc = _attend_key_blocks(
        q, q_pos, row_ok, k_ref, v_ref, pt_ref, kb_start, pl.cdiv(kv_end, block_k),
        page_size=page_size, block_k=block_k, scale_log2=scale_log2, precision=precision,
        window=window)
    out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]  # padding rows: 0 / 1
    o_ref[...] = out.reshape(block_q, group, head_dim).astype(o_ref.dtype)


def _decode_kernel(
    # inputs
    context_lens_ref,  # [seqs] int32
    query_lens_ref,  # [seqs] int32: 0 (padding sequence) or 1
    pt_ref,  # [padded_pages_per_seq] int32: this sequence's page table
    q_ref,  # [group, head_dim]: the query heads of one KV head, zero-padded to >= 16
    k_ref,  # [num_pages * page_size, head_dim]: this KV head of the pool
    v_ref,  # [num_pages * page_size, head_dim]
    # outputs
    o_ref,  # [group, head_dim] float32: unnormalised partial output of this split
    m_ref,  # [group] float32: running max (log2 units)
    l_ref,  # [group] float32: running sum
    *,
    page_size: int,
    block_k: int,
    scale_log2: float,
    precision,
    window: int = 0,
):
    seq, split = pl.program_id(0), pl.program_id(2)
    splits = pl.num_programs(2)
    group, _ = q_ref.shape
    query_len = query_lens_ref[seq]
    # The one query sits at context_len - 1 and sees every key before it (with a sliding
    # window, the last `window`: the splits share the blocks from the window's first).
    kv_len = jnp.where(query_len > 0, context_lens_ref[seq] - query_len + 1, 0)
    blocks = pl.cdiv(kv_len, block_k)
    lo = jnp.maximum(kv_len - window, 0) // block_k if window else 0
    per_split = pl.cdiv(blocks - lo, splits)
    kb_start = jnp.minimum(lo + split * per_split, blocks)
    kb_end = jnp.minimum(kb_start + per_split, blocks)

    q_pos = jnp.full((group,), kv_len - 1, jnp.int32)
    row_ok = jnp.full((group,), True)
    m, l, acc = _attend_key_blocks(
        q_ref[...], q_pos, row_ok, k_ref, v_ref, pt_ref, kb_start, kb_end,
        page_size=page_size, block_k=block_k, scale_log2=scale_log2, precision=precision,
        window=window)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


# ---------------------------------------------------------------------------------------
# pallas_call wrappers


def _compiler_params(num_warps: int, num_stages: int, interpret: bool):
    if interpret:
        return None  # the interpreter ignores them; keep Triton out of the CPU path
    try:
        from jax.experimental.pallas import triton as pltriton
    except ImportError as e:  # a JAX without the Triton lowering
        raise RuntimeError(
            f"this JAX ({jax.__version__}) has no Pallas Triton lowering, which these "
            "kernels are written for; use the \"cpu\" attention backend (docs/attention.md)"
        ) from e
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


class _Paged(NamedTuple):
    """What both kernels read besides the queries, and how they are compiled."""

    k_pages: jax.Array  # [num_pages, page_size, kv_heads, head_dim]
    v_pages: jax.Array  # [num_pages, page_size, kv_heads, head_dim]
    page_tables: jax.Array  # [seqs, padded_pages_per_seq] int32
    context_lens: jax.Array  # [seqs] int32
    query_lens: jax.Array  # [seqs] int32
    sizes: bs.BlockSizes  # block_k and the Triton launch parameters
    scale: float
    precision: Any
    interpret: bool
    window: int = 0  # > 0: a sliding window of that many keys


def _paged_call(kernel, p: _Paged, q, q_spec, *, grid, out_specs, out_shape, name: str):
    """`kernel` over `grid` (sequence, KV head, query block or split): each program gets
    the lengths whole, its sequence's page-table row, its queries (`q_spec`) and one KV
    head of the pool."""
    seqs = q.shape[0]
    num_pages, page_size, _, d = p.k_pages.shape
    pps = p.page_tables.shape[1]
    kernel = functools.partial(kernel, page_size=page_size, block_k=p.sizes.block_k,
                               scale_log2=p.scale * _LOG2E, precision=p.precision,
                               window=p.window)
    kv_spec = pl.BlockSpec((num_pages, page_size, None, d), lambda s, h, j: (0, 0, h, 0))
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((seqs,), lambda s, h, j: (0,)),  # context_lens
            pl.BlockSpec((seqs,), lambda s, h, j: (0,)),  # query_lens
            pl.BlockSpec((None, pps), lambda s, h, j: (s, 0)),  # page_tables
            q_spec,
            kv_spec,  # k
            kv_spec,  # v
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(p.sizes.num_warps, p.sizes.num_stages, p.interpret),
        interpret=p.interpret,
        name=name,
    )(p.context_lens, p.query_lens, p.page_tables, q, p.k_pages, p.v_pages)


def _ragged_call(q5, p: _Paged, *, block_q: int):
    """q5 [seqs, padded_queries, kv_heads, group, head_dim] -> the output, same shape."""
    seqs, nq, kvh, group, d = q5.shape
    q_spec = pl.BlockSpec((None, block_q, None, group, d), lambda s, h, b: (s, b, h, 0, 0))
    return _paged_call(_ragged_kernel, p, q5, q_spec, grid=(seqs, kvh, nq // block_q),
                       out_specs=q_spec, out_shape=jax.ShapeDtypeStruct(q5.shape, q5.dtype),
                       name="paged_attention_ragged")


def _decode_call(q4, p: _Paged, *, splits: int):
    """q4 [seqs, kv_heads, group, head_dim] -> each split's (o, m, l), as `_combine_splits`
    takes them."""
    seqs, kvh, group, d = q4.shape
    f32 = jnp.float32
    return _paged_call(
        _decode_kernel, p, q4,
        q_spec=pl.BlockSpec((None, None, group, d), lambda s, h, j: (s, h, 0, 0)),
        grid=(seqs, kvh, splits),
        out_specs=[
            pl.BlockSpec((None, None, None, group, d), lambda s, h, j: (j, s, h, 0, 0)),
            pl.BlockSpec((None, None, None, group), lambda s, h, j: (j, s, h, 0)),
            pl.BlockSpec((None, None, None, group), lambda s, h, j: (j, s, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, seqs, kvh, group, d), f32),  # partial outputs
            jax.ShapeDtypeStruct((splits, seqs, kvh, group), f32),  # running max
            jax.ShapeDtypeStruct((splits, seqs, kvh, group), f32),  # running sum
        ],
        name="paged_attention_decode",
    )


def _combine_splits(
    o,  # [splits, seqs, kv_heads, group, head_dim] float32, unnormalised
    m,  # [splits, seqs, kv_heads, group] float32, log2 units
    l,  # [splits, seqs, kv_heads, group] float32
):
    """Merge the decode splits: [seqs, kv_heads, group, head_dim] float32."""
    m_all = m.max(axis=0)
    w = jnp.exp2(m - m_all)  # empty splits (m = _NEG) weigh 0
    l_all = (l * w).sum(axis=0)
    o_all = (o * w[..., None]).sum(axis=0)
    return o_all / jnp.where(l_all == 0.0, 1.0, l_all)[..., None]


# ---------------------------------------------------------------------------------------
# Public entry


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _validate(q, k_pages, v_pages, page_tables, context_lens, query_lens, scale):
    """Shapes and dtypes as in `paged_attention_pallas` below, or a ValueError saying why."""
    if q.ndim != 4:
        raise ValueError(f"q must be [seqs, queries, heads, head_dim], got {q.shape=}")
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [num_pages, page_size, kv_heads, head_dim], got {k_pages.shape=}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"{v_pages.shape=} must equal {k_pages.shape=}")
    seqs, queries, heads, head_dim = q.shape
    num_pages, page_size, kv_heads, kv_head_dim = k_pages.shape
    floats = (jnp.float32, jnp.bfloat16, jnp.float16)
    if q.dtype not in floats:
        raise ValueError(f"{q.dtype=} must be one of float32, bfloat16, float16")
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(
            f"q, k_pages and v_pages must share a dtype, got {q.dtype=} {k_pages.dtype=} "
            f"{v_pages.dtype=}")
    if seqs < 1 or queries < 1:
        raise ValueError(f"q needs at least one sequence and one query, got {q.shape=}")
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim mismatch: {q.shape[3]=} but {k_pages.shape[3]=}")
    if head_dim < _MIN_DOT or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"{head_dim=} must be a power of two in [16, 256]")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads ({heads=}) must be a multiple of {kv_heads=}")
    if page_size < 1 or num_pages < 1:
        raise ValueError(f"the pool needs pages of at least one token, got {k_pages.shape=}")
    if num_pages * page_size >= 2**31:
        raise ValueError(f"{num_pages=} x {page_size=} tokens overflow int32 row indices")
    if page_tables.ndim != 2 or page_tables.shape[0] != seqs or page_tables.shape[1] < 1:
        raise ValueError(f"page_tables must be [{seqs}, pages_per_seq], got {page_tables.shape=}")
    if context_lens.shape != (seqs,) or query_lens.shape != (seqs,):
        raise ValueError(f"context_lens and query_lens must be [{seqs}], got "
                         f"{context_lens.shape=} {query_lens.shape=}")
    for name, a in (("page_tables", page_tables), ("context_lens", context_lens),
                    ("query_lens", query_lens)):
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"{scale=} must be a Python number or None")


@functools.partial(
    jax.jit,
    static_argnames=("scale", "interpret", "sizes", "splits", "window"),
)
def paged_attention_pallas(
    q,  # [seqs, queries, heads, head_dim]
    k_pages,  # [num_pages, page_size, kv_heads, head_dim]
    v_pages,  # [num_pages, page_size, kv_heads, head_dim]
    page_tables,  # [seqs, pages_per_seq] int32, unused entries 0 (the null page)
    context_lens,  # [seqs] int32: keys in the pool for the sequence, this step's included
    query_lens,  # [seqs] int32: valid queries; query i sits at context_len - query_len + i
    scale: float | None = None,
    interpret: bool = False,
    *,
    sizes: bs.BlockSizes | None = None,
    splits: int | None = None,
    window: int = 0,
):
    """Causal paged attention; same arguments and result as `reference.paged_attention_dense`:
    [seqs, queries, heads, head_dim] in q's dtype, zeros on padding rows. `window` > 0: a
    sliding window, each query over the `window` keys ending at its own (key blocks
    before it are not read).

    `sizes` overrides the block-size table (`block_sizes.block_sizes`); `splits` forces the
    decode path's number of splits (only with one query per sequence; 1 runs the ragged
    kernel). Both exist for tests and tuning; leave them None.
    """
    _validate(q, k_pages, v_pages, page_tables, context_lens, query_lens, scale)
    seqs, queries, heads, d = q.shape
    num_pages, page_size, kvh, _ = k_pages.shape
    group = heads // kvh
    scale = d ** -0.5 if scale is None else float(scale)
    sizes = sizes or bs.block_sizes(d, page_size, q.dtype, queries)
    block_k = sizes.block_k
    if block_k < _MIN_DOT or block_k & (block_k - 1):
        raise ValueError(f"{block_k=} must be a power of two >= {_MIN_DOT}")
    # float32 dots in IEEE precision (the Triton lowering's default would be TF32).
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    # Page table padded with the null page so every key block's page ids are in range.
    pps = page_tables.shape[1]
    key_blocks = -(-pps * page_size // block_k)
    pps_pad = -(-key_blocks * block_k // page_size)
    page_tables = jnp.pad(page_tables, ((0, 0), (0, pps_pad - pps)))
    paged = _Paged(k_pages, v_pages, page_tables, context_lens, query_lens, sizes, scale,
                   precision, interpret, int(window))

    if splits is None and queries == 1:
        splits = bs.decode_splits(seqs, kvh, pps * page_size, sizes)
    if queries == 1 and splits is not None and splits > 1:
        # Flash decoding. Query heads of a KV head padded to >= 16 rows (Triton dot).
        g_pad = max(_next_pow2(group), _MIN_DOT)
        q4 = q.reshape(seqs, kvh, group, d)
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, g_pad - group), (0, 0)))
        o, m, l = _decode_call(q4, paged, splits=splits)
        out = _combine_splits(o, m, l)[:, :, :group]
        return out.reshape(seqs, 1, heads, d).astype(q.dtype)

    # Ragged kernel: rows = block_q queries x g_pad heads, a power of two >= 16.
    g_pad = _next_pow2(group)
    block_q = max(1, min(sizes.block_rows // g_pad, _next_pow2(queries)))
    block_q = _next_pow2(block_q)
    g_pad = max(g_pad, _MIN_DOT // block_q)
    nq_pad = -(-queries // block_q) * block_q
    q5 = q.reshape(seqs, queries, kvh, group, d)
    q5 = jnp.pad(q5, ((0, 0), (0, nq_pad - queries), (0, 0), (0, g_pad - group), (0, 0)))
    out = _ragged_call(q5, paged, block_q=block_q)
    return out[:, :queries, :, :group].reshape(seqs, queries, heads, d)


class PallasBackend(AttentionBackend):
    """The kernels above, compiled for the GPU (Triton lowering)."""

    name = "pallas"
    interpret = False

    def attend(self, q, k_pool, v_pool, layer, meta, state):
        tables, context_lens, query_lens = meta
        return paged_attention_pallas(q, k_pool, v_pool, tables + self.page_offset(layer),
                                      context_lens, query_lens, interpret=self.interpret)

    def attend_window(self, q, k_pool, v_pool, layer, meta, state):
        """A sliding layer through the same kernels over the row's windowed table
        (`WindowMeta`), the keys before each query's window masked."""
        tables = meta.page_tables + self.page_offset(layer)
        return paged_attention_pallas(q, k_pool, v_pool, tables, meta.context_lens,
                                      meta.query_lens, interpret=self.interpret,
                                      window=self.pool.window)


class PallasInterpretBackend(PallasBackend):
    """The same kernels in Pallas interpret mode: any backend, slowly (tests)."""

    name = "pallas_interpret"
    interpret = True
