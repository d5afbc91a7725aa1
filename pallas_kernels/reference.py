"""Paged attention in plain jnp: the reference every kernel is checked against, and the
implementation the runner uses on the CPU.

It attends only over the pages a sequence has: a `fori_loop` walks the page table in blocks
of `pages_per_block` pages up to the longest context in the step (a traced bound, so one
compiled step serves every context length), with an online softmax across blocks. The cost
therefore follows the real context, not the model's maximum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_NEG = -1e30


def _check(q, k_pages, v_pages, page_tables, context_lens, query_lens, pages_per_block):
    if q.ndim != 4:
        raise ValueError(f"q must be [seqs, queries, heads, head_dim], got {q.shape=}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages and v_pages must both be [pages, page_size, kv_heads, head_dim], "
            f"got {k_pages.shape=} {v_pages.shape=}"
        )
    s, _, h, d = q.shape
    kvh = k_pages.shape[2]
    if k_pages.shape[3] != d:
        raise ValueError(f"head_dim mismatch: {q.shape[3]=} but {k_pages.shape[3]=}")
    if h % kvh:
        raise ValueError(f"query heads {h} must be a multiple of kv heads {kvh}")
    if page_tables.ndim != 2 or page_tables.shape[0] != s:
        raise ValueError(f"page_tables must be [{s}, pages_per_seq], got {page_tables.shape=}")
    if context_lens.shape != (s,) or query_lens.shape != (s,):
        raise ValueError(f"context_lens and query_lens must be [{s}], got "
                         f"{context_lens.shape=} {query_lens.shape=}")
    if page_tables.shape[1] % pages_per_block:
        raise ValueError(
            f"{pages_per_block=} must divide pages per sequence {page_tables.shape[1]}"
        )


@functools.partial(jax.jit, static_argnames=("pages_per_block", "shared_pages_per_block",
                                             "rows_per_group", "scale"))
def paged_attention_reference(
    q,  # [seqs, queries, heads, head_dim]
    k_pages,  # [num_pages, page_size, kv_heads, head_dim]
    v_pages,  # [num_pages, page_size, kv_heads, head_dim]
    page_tables,  # [seqs, pages_per_seq] int32, unused entries 0 (the null page)
    context_lens,  # [seqs] int32: keys in the pool for the sequence, this step's included
    query_lens,  # [seqs] int32: valid queries; query i sits at context_len - query_len + i
    shared_pages=None,  # [pages_per_seq] int32: a page-table prefix every sequence has
    shared_len=None,  # [] int32: tokens of that prefix (a multiple of page_size), or 0
    shared_kv=None,  # optional (kt [kv_heads, head_dim, n], v [kv_heads, n, head_dim]):
    #   the shared prefix's keys (transposed) and values, contiguous; then read from here
    buffered_len=None,  # [] int32: how many tokens of the shared prefix `shared_kv` holds
    #   (a multiple of page_size; None: all of it); the rest is gathered from the pages
    *,
    pages_per_block: int = 8,
    shared_pages_per_block: int = 64,
    rows_per_group: int | tuple[int, ...] | None = None,
    scale: float | None = None,
):
    """Causal attention of each sequence's new queries over its pages. Returns [seqs, queries,
    heads, head_dim]; rows past `query_lens` (padding) are zeros.

    Cascade ("shared prefix") attention: when every sequence's table starts with the same
    `shared_len / page_size` pages (a system prompt every request carries) and all queries
    sit after them, pass that prefix. Its keys are then read once for all queries, in one
    dense matmul, instead of once per sequence; each sequence reads only its own suffix and
    the two partial softmaxes are merged. The result is the same attention. The shared
    prefix is walked in big blocks (`shared_pages_per_block`): each is one dense matmul,
    and every loop iteration costs fixed overhead on XLA:CPU; its tail in blocks of
    `pages_per_block`.

    `shared_kv` holds the first `buffered_len` tokens of the same prefix already gathered
    into contiguous arrays (the runner keeps one, filled once per system prompt:
    `gather_prefix`), so the step reads them in place instead of gathering their pages: on
    XLA:CPU the gather, with the transpose the matmul wants, cost about as much as the
    matmul itself. Its length must be a multiple of the shared block
    (`shared_pages_per_block * page_size`). Whatever the copy does not hold (a prefix
    longer than it, or a different prefix: the decode rows' system prompt buffered while a
    long prompt's earlier chunks are the prefill group's prefix) is gathered from the pages,
    once for all queries too.
    """
    _check(q, k_pages, v_pages, page_tables, context_lens, query_lens, pages_per_block)
    if shared_pages_per_block % pages_per_block:
        raise ValueError(f"{pages_per_block=} must divide {shared_pages_per_block=}")
    s, nq, h, d = q.shape
    num_pages, ps, kvh, _ = k_pages.shape
    g = h // kvh
    scale = d ** -0.5 if scale is None else scale
    blk = pages_per_block * ps
    f32 = jnp.float32
    if shared_len is None:
        shared_len = jnp.int32(0)
        shared_pages = jnp.zeros(page_tables.shape[1], jnp.int32)

    qg = (q.astype(f32) * scale).reshape(s, nq, kvh, g, d)
    q_pos = context_lens[:, None] - query_lens[:, None] + jnp.arange(nq)[None, :]  # [s, nq]
    q_valid = jnp.arange(nq)[None, :] < query_lens[:, None]  # [s, nq]
    # Whole pages are gathered as flat rows: on XLA:CPU a gather of [page, page_size,
    # kv_heads, head_dim] slices ran at half the speed of the same bytes as one row a page.
    # (The reshape stays inside the loop bodies: outside, XLA copied the donated pool.)

    # The shared prefix is read once for all queries: from the contiguous copy first
    # (`buffered` tokens), then gathered from the pages (the rest of it). Each part is
    # walked in big blocks of `sblk` tokens (one matmul each: every loop iteration costs
    # fixed overhead on XLA:CPU), then its tail in small blocks of `blk` tokens, the last
    # one masked. Rounding a part down to whole big blocks instead would leave its tail to
    # every row's own walk: a 2,000-token system prompt, one block of 1,024 buffered and
    # 976 tokens read again by each of 16 rows, made the decode step 30% slower.
    spb = min(shared_pages_per_block, page_tables.shape[1])
    sblk = spb * ps
    if shared_kv is None:
        buffered = jnp.int32(0)
    else:
        buffered = shared_len if buffered_len is None else jnp.minimum(buffered_len,
                                                                       shared_len)
    # The copy's length is a multiple of `sblk` (and so of `blk`): no slice of it is
    # clamped. The table gets a big block of padding for the same reason.
    shared_table = jnp.pad(shared_pages, (0, spb))

    # Each sequence's own pages start right after the shared prefix (a whole number of
    # pages), so the blocks of this loop start there too, not at a multiple of the block:
    # no block re-reads shared keys only to mask them. The table gets a block of padding
    # columns so that the last block's slice is never clamped back onto real pages.
    first_page = shared_len // ps
    tables = jnp.pad(page_tables, ((0, 0), (0, pages_per_block)))

    def own_rows(a, b, carry):
        """The own-page loop for rows [a, b): as many blocks as their longest needs."""
        n = b - a
        tab, qg_r, pos_r, valid_r = tables[a:b], qg[a:b], q_pos[a:b], q_valid[a:b]

        def own_block(j, carry):
            m, l, acc = carry  # m, l: [n, kvh, g, nq]; acc: [n, kvh, g, nq, d]
            pages = lax.dynamic_slice_in_dim(tab, first_page + j * pages_per_block,
                                             pages_per_block, 1)
            k = k_pages.reshape(num_pages, -1)[pages].reshape(n, blk, kvh, d).astype(f32)
            v = v_pages.reshape(num_pages, -1)[pages].reshape(n, blk, kvh, d).astype(f32)
            scores = jnp.einsum("sqkgd,stkd->skgqt", qg_r, k)  # [n, kvh, g, nq, blk]
            k_pos = shared_len + j * blk + jnp.arange(blk)
            mask = (k_pos[None, None, :] <= pos_r[:, :, None]) & valid_r[:, :, None]
            return _online_update(m, l, acc, scores, mask[:, None, None], v,
                                  "skgqt,stkd->skgqd")

        blocks = (jnp.max(context_lens[a:b]) - shared_len + blk - 1) // blk
        return lax.fori_loop(0, blocks, own_block, carry)


    def copy_keys(at, size):
        """Scores and values of `size` tokens of the contiguous copy from token `at`."""
        kt = lax.dynamic_slice_in_dim(shared_kv[0], at, size, 2).astype(f32)
        v = lax.dynamic_slice_in_dim(shared_kv[1], at, size, 1).astype(f32)
        return jnp.einsum("kqd,kdt->kqt", q_all, kt), v, "kqt,ktd->kqd"

    def page_keys(at, size):
        """The same, gathered from the shared pages from token `at` (a page multiple)."""
        pages = lax.dynamic_slice_in_dim(shared_table, at // ps, size // ps)
        k = k_pages.reshape(num_pages, -1)[pages].reshape(size, kvh, d).astype(f32)
        v = v_pages.reshape(num_pages, -1)[pages].reshape(size, kvh, d).astype(f32)
        return jnp.einsum("kqd,tkd->kqt", q_all, k), v, "kqt,tkd->kqd"

    def shared_walk(keys, limit):
        """A walk over blocks read by `keys`, keys at or past token `limit` masked."""
        def walk(start, size, count, carry):
            def body(j, carry):
                at = start + j * size
                scores, v, pv_spec = keys(at, size)  # scores: [kvh, g*s*nq, size]
                k_pos = at + jnp.arange(size)
                mask = (k_pos < limit)[None, None, :] & all_valid[None, :, None]
                return _online_update(*carry, scores, mask, v, pv_spec)
            return lax.fori_loop(0, count, body, carry)
        return walk

    def blocks_of(start, length, carry, walk):
        """`length` tokens from `start`: whole big blocks, then the tail in small ones."""
        big = length // sblk
        carry = walk(start, sblk, big, carry)
        return walk(start + big * sblk, blk, (length - big * sblk + blk - 1) // blk, carry)

    # Shared prefix: every query of every sequence against the same keys.
    q_all = qg.transpose(2, 3, 0, 1, 4).reshape(kvh, g * s * nq, d)
    all_valid = jnp.broadcast_to(q_valid[None], (g, s, nq)).reshape(g * s * nq)
    rows = g * s * nq
    carry = (jnp.full((kvh, rows), _NEG, f32), jnp.zeros((kvh, rows), f32),
             jnp.zeros((kvh, rows, d), f32))  # m, l: [kvh, g*s*nq]; acc: [.., d]
    if shared_kv is not None:
        carry = blocks_of(jnp.int32(0), buffered, carry, shared_walk(copy_keys, buffered))
    m1, l1, acc1 = blocks_of(buffered, shared_len - buffered, carry,
                             shared_walk(page_keys, shared_len))
    m1 = m1.reshape(kvh, g, s, nq).transpose(2, 0, 1, 3)
    l1 = l1.reshape(kvh, g, s, nq).transpose(2, 0, 1, 3)
    acc1 = acc1.reshape(kvh, g, s, nq, d).transpose(2, 0, 1, 3, 4)

    # Each sequence's own pages, from the end of the shared prefix.
    # In groups of rows, each walking only as far as its own longest row: a caller that
    # orders rows by length (the runner does) saves most of the blocks that short rows
    # would otherwise spend masked, waiting for the longest sequence of the step.
    # `rows_per_group` is a group size, or the sizes of consecutive groups (the rows
    # left over form one more group).
    if not rows_per_group:
        sizes = ()
    elif isinstance(rows_per_group, int):
        sizes = (rows_per_group,) * -(-s // rows_per_group)
    else:
        sizes = tuple(rows_per_group)
    bounds = [0]
    for n in sizes:
        if bounds[-1] < s:
            bounds.append(min(s, bounds[-1] + n))
    if bounds[-1] < s:
        bounds.append(s)
    parts = [own_rows(a, b, (m1[a:b], l1[a:b], acc1[a:b]))
             for a, b in zip(bounds, bounds[1:])]
    m, l, acc = (jnp.concatenate([p[i] for p in parts]) if len(parts) > 1 else parts[0][i]
                 for i in range(3))
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
    out = out.transpose(0, 3, 1, 2, 4).reshape(s, nq, h, d)
    return out.astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("tokens",))
def gather_prefix(k_pages, v_pages, pages, *, tokens: int):
    """`shared_kv` for `paged_attention_reference`: the keys (transposed) and values of
    `pages` ([tokens / page_size] int32), contiguous: ([kvh, d, tokens], [kvh, tokens, d])."""
    num_pages, ps, kvh, d = k_pages.shape
    k = k_pages.reshape(num_pages, -1)[pages].reshape(tokens, kvh, d)
    v = v_pages.reshape(num_pages, -1)[pages].reshape(tokens, kvh, d)
    return k.transpose(1, 2, 0), v.transpose(1, 0, 2)


def _online_update(m, l, acc, scores, mask, v, pv_spec):
    """One block of the online softmax: fold `scores` (masked) and values into (m, l, acc)."""
    scores = jnp.where(mask, scores, _NEG)
    m_new = jnp.maximum(m, scores.max(-1))
    p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    return m_new, l * corr + p.sum(-1), acc * corr[..., None] + jnp.einsum(pv_spec, p, v)
