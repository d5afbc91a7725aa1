"""Dense paged attention: the oracle every attention backend is tested against.

Obviously correct rather than fast: gather every page of every sequence's table, score
every query against every key, mask what is not causal or not real, softmax, weight the
values. Its cost follows the table width, not the real context, so no backend serves
with it except on tiny models ("dense" in the registry, for tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames="window")
def paged_attention_dense(
    q,  # [seqs, queries, heads, head_dim]
    k_pages,  # [num_pages, page_size, kv_heads, head_dim]
    v_pages,  # [num_pages, page_size, kv_heads, head_dim]
    page_tables,  # [seqs, pages_per_seq] int32: the pages holding tokens 0, page_size, ...
    context_lens,  # [seqs] int32: tokens in the pool for the sequence, this step's included
    query_lens,  # [seqs] int32: real queries; query i sits at context_len - query_len + i
    window: int = 0,  # > 0: each query sees only the `window` keys ending at its own
):
    """Causal attention of each sequence's queries over its pages. Returns [seqs, queries,
    heads, head_dim] in q's dtype; rows past `query_lens` (padding) are zeros. Query heads
    are grouped over the KV heads (GQA): head h reads KV head h // (heads / kv_heads).
    Pools of bf16 bit patterns or int8 rows are read as `from_pool` widens them."""
    from .backends import from_pool

    seqs, nq, heads, d = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    keys = page_tables.shape[1] * page_size
    k = from_pool(k_pages[page_tables], d).reshape(seqs, keys, kv_heads, d)
    v = from_pool(v_pages[page_tables], d).reshape(seqs, keys, kv_heads, d)
    qf = q.astype(jnp.float32).reshape(seqs, nq, kv_heads, group, d)
    scores = jnp.einsum("sqkgd,snkd->sqkgn", qf, k) * d ** -0.5

    q_pos = context_lens[:, None] - query_lens[:, None] + jnp.arange(nq)[None, :]
    real = jnp.arange(nq)[None, :] < query_lens[:, None]  # [seqs, queries]
    sees = jnp.arange(keys)[None, None, :] <= q_pos[:, :, None]  # [seqs, queries, keys]
    if window:
        sees &= jnp.arange(keys)[None, None, :] > q_pos[:, :, None] - window
    mask = (sees & real[:, :, None])[:, :, None, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    weights = jnp.exp(scores - scores.max(-1, keepdims=True))
    weights = jnp.where(mask, weights, 0.0)
    weights = weights / jnp.maximum(weights.sum(-1, keepdims=True), 1e-30)
    out = jnp.einsum("sqkgn,snkd->sqkgd", weights, v).reshape(seqs, nq, heads, d)
    return jnp.where(real[:, :, None, None], out, 0.0).astype(q.dtype)
