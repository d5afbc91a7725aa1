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


@functools.partial(jax.jit, static_argnames=("pages_per_block", "scale"))
def paged_attention_reference(
    q,  # [seqs, queries, heads, head_dim]
    k_pages,  # [num_pages, page_size, kv_heads, head_dim]
    v_pages,  # [num_pages, page_size, kv_heads, head_dim]
    page_tables,  # [seqs, pages_per_seq] int32, unused entries 0 (the null page)
    context_lens,  # [seqs] int32: keys in the pool for the sequence, this step's included
    query_lens,  # [seqs] int32: valid queries; query i sits at context_len - query_len + i
    *,
    pages_per_block: int = 8,
    scale: float | None = None,
):
    """Causal attention of each sequence's new queries over its pages. Returns [seqs, queries,
    heads, head_dim]; rows past `query_lens` (padding) are zeros."""
    _check(q, k_pages, v_pages, page_tables, context_lens, query_lens, pages_per_block)
    s, nq, h, d = q.shape
    _, ps, kvh, _ = k_pages.shape
    g = h // kvh
    scale = d ** -0.5 if scale is None else scale
    blk = pages_per_block * ps
    acc_dtype = jnp.float32

    qg = (q.astype(acc_dtype) * scale).reshape(s, nq, kvh, g, d)
    q_pos = context_lens[:, None] - query_lens[:, None] + jnp.arange(nq)[None, :]  # [s, nq]
    q_valid = jnp.arange(nq)[None, :] < query_lens[:, None]  # [s, nq]
    num_blocks = (jnp.max(context_lens) + blk - 1) // blk

    # Gather whole pages as flat rows: on XLA:CPU a gather of [page, page_size, kv_heads,
    # head_dim] slices ran at half the speed of the same bytes gathered as one row per page.
    num_pages = k_pages.shape[0]

    def body(j, carry):
        m, l, acc = carry  # m, l: [s, kvh, g, nq]; acc: [s, kvh, g, nq, d]
        pages = lax.dynamic_slice_in_dim(page_tables, j * pages_per_block, pages_per_block, 1)
        k = k_pages.reshape(num_pages, -1)[pages].reshape(s, blk, kvh, d).astype(acc_dtype)
        v = v_pages.reshape(num_pages, -1)[pages].reshape(s, blk, kvh, d).astype(acc_dtype)
        scores = jnp.einsum("sqkgd,stkd->skgqt", qg, k)  # [s, kvh, g, nq, blk]
        k_pos = j * blk + jnp.arange(blk)
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
        mask = mask[:, None, None]  # [s, 1, 1, nq, blk]
        scores = jnp.where(mask, scores, _NEG)
        m_new = jnp.maximum(m, scores.max(-1))
        p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("skgqt,stkd->skgqd", p, v)
        return m_new, l, acc

    init = (
        jnp.full((s, kvh, g, nq), _NEG, acc_dtype),
        jnp.zeros((s, kvh, g, nq), acc_dtype),
        jnp.zeros((s, kvh, g, nq, d), acc_dtype),
    )
    _, l, acc = lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
    out = out.transpose(0, 3, 1, 2, 4).reshape(s, nq, h, d)
    return out.astype(q.dtype)


def dense_attention_reference(q, k, v, q_positions, k_len):
    """Unpaged causal attention for one sequence (tests): q [nq, h, d], k/v [k_len, kvh, d]."""
    nq, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    k = jnp.repeat(k[:k_len], g, axis=1)
    v = jnp.repeat(v[:k_len], g, axis=1)
    scores = jnp.einsum("qhd,khd->hqk", q, k) * d ** -0.5
    mask = jnp.arange(k_len)[None, :] <= q_positions[:, None]
    scores = jnp.where(mask[None], scores, -jnp.inf)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, -1), v)
