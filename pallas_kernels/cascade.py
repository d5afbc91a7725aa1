"""Cascade paged attention in plain jnp: the CPU backend's kernel (`cpu.py` drives it).

It attends only over the pages a sequence has: `fori_loop`s walk the page table in blocks
up to the longest context of a group of rows (traced bounds, so one compiled step serves
every context length), with an online softmax across blocks. The cost follows the real
context, not the model's maximum.

Cascade ("shared prefix"): when rows' tables start with the same pages (the system
prompt every request carries; a long prompt's earlier chunks for its blocks) and their
queries sit after them, that prefix is read once for those rows, one dense matmul per
block, and the partial softmaxes are merged with each row's walk over its own pages. The
result is the same attention; the keys are read once instead of once per row. Rows that
do not share it (`shared_rows` 0: a batch job's or an adapter's request beside the
interactive ones) walk their whole table themselves, and the others keep the cascade.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_NEG = -1e30  # masked score (finite: -inf - -inf would be NaN)


@functools.partial(jax.jit, static_argnames=("pages_per_block", "shared_pages_per_block",
                                             "row_groups"))
def cascade_attention(
    q,  # [rows, queries, heads, head_dim]
    k_pool,  # [layers * pages, page_size, kv_heads, head_dim]
    v_pool,  # [layers * pages, page_size, kv_heads, head_dim]
    page_offset,  # [] int32: pool row of this layer's page 0, added to every page id
    page_tables,  # [rows, pages_per_seq] int32: one layer's page ids, unused entries 0
    context_lens,  # [rows] int32: keys in the pool, this step's included
    query_lens,  # [rows] int32: real queries; query i sits at context_len - query_len + i
    shared_pages,  # [prefixes, pages_per_seq] int32: table prefixes rows share (cascade),
    #   or [pages_per_seq]: one
    shared_len,  # [prefixes] int32 (or []): their lengths in tokens (page multiples)
    shared_rows=None,  # [rows] int32: 1 + the index of the row's prefix, 0: none (None:
    #   every row has prefix 0)
    copy=None,  # optional (kt [L, kv_heads, head_dim, n], v [L, kv_heads, n, head_dim]):
    #   keys (transposed) and values of shared prefixes, contiguous, per layer
    layer=None,  # [] int32: which layer of `copy` this is
    buffered_len=None,  # [prefixes] int32 (or []): tokens of each prefix `copy` holds...
    copy_at=None,  # [prefixes] int32: ...from this token of `copy` on (None: 0)
    segments=None,  # [n, width] int32, or a tuple of such of several widths: the rows
    #   each segment reads its prefix for, all of one prefix, `rows` (none) after the
    #   last; segments of no row at the end. None: one segment of every row
    *,
    pages_per_block: int = 8,
    shared_pages_per_block: int = 64,
    row_groups: tuple[int, ...] = (),
):
    """Causal attention; [rows, queries, heads, head_dim], zeros on padding rows.

    A shared prefix is read once per *segment*: a few rows of that prefix, whose queries
    meet its keys in one dense matmul per block (several prefixes in one step, each in
    its segments: the system prompts of several adapters or customers). A segment reads
    its prefix from `copy` first (its first `buffered_len` tokens: on XLA:CPU gathering
    pages cost as much as the matmul over them), the rest of it gathered from the pages.
    Each part is walked in big blocks of `shared_pages_per_block` pages (one matmul each:
    every loop iteration costs fixed overhead on XLA:CPU) and its tail in blocks of
    `pages_per_block`; rounding a part down to whole big blocks would leave its tail to
    every row (a 2,000-token system prompt's 976-token tail cost a decode step of 16 a
    quarter of its time). Only the segments that hold rows run (a loop with a traced
    bound), so unused ones cost nothing.

    Each row's own pages, after its shared prefix, are walked in groups of rows
    (`row_groups`: sizes of consecutive groups; the rows left over form one more), each
    group only as far as its longest row: a caller that sorts rows by the length of that
    walk (the CPU backend does) saves the blocks short rows would spend masked, waiting
    for the longest. (Where the native kernels build, the CPU backend uses them instead
    of this function: `cpu.CpuBackend._attend_native`.)
    """
    s, nq, h, d = q.shape
    _, ps, kvh, _ = k_pool.shape
    g = h // kvh
    blk = pages_per_block * ps
    f32 = jnp.float32

    shared_pages = jnp.atleast_2d(shared_pages)  # [P, width]
    shared_len = jnp.reshape(shared_len, (-1,))  # [P]
    n_prefixes = shared_pages.shape[0]
    prefix = jnp.zeros(s, jnp.int32) if shared_rows is None else shared_rows - 1  # -1: none
    if segments is None:
        segments = (jnp.arange(s, dtype=jnp.int32)[None],)
    elif not isinstance(segments, (tuple, list)):
        segments = (segments,)

    qg = (q.astype(f32) * d ** -0.5).reshape(s, nq, kvh, g, d)
    q_pos = context_lens[:, None] - query_lens[:, None] + jnp.arange(nq)[None, :]  # [s, nq]
    q_valid = jnp.arange(nq)[None, :] < query_lens[:, None]  # [s, nq]
    # Where each row's own walk begins: after its prefix.
    start_tok = jnp.where(prefix >= 0, shared_len[jnp.maximum(prefix, 0)], 0)  # [s]

    spb = min(shared_pages_per_block, page_tables.shape[1])
    sblk = spb * ps
    if copy is None:
        buffered = jnp.zeros(n_prefixes, jnp.int32)
    else:
        buffered = jnp.minimum(jnp.reshape(buffered_len, (-1,)), shared_len)
    copy_at = (jnp.zeros(n_prefixes, jnp.int32) if copy_at is None
               else jnp.reshape(copy_at, (-1,)))
    # Padding so that no block's slice is ever clamped back onto real pages.
    shared_tables = jnp.pad(shared_pages, ((0, 0), (0, spb)))
    tables = jnp.pad(page_tables, ((0, 0), (0, pages_per_block)))

    # -- the shared prefixes: a segment's queries against its prefix's keys ----------------
    q_rows = jnp.concatenate([qg, jnp.zeros((1, *qg.shape[1:]), f32)])  # row `s`: none
    valid_rows = jnp.concatenate([q_valid & (prefix >= 0)[:, None],
                                  jnp.zeros((1, nq), bool)])

    def segment(table_of_rows, i, carry):
        rows = table_of_rows[i]  # [width]
        width = rows.shape[0]
        p = jnp.maximum(prefix[jnp.minimum(rows[0], s - 1)], 0)
        shared_table, limit = shared_tables[p], shared_len[p]
        q_all = q_rows[rows].transpose(2, 3, 0, 1, 4).reshape(kvh, g * width * nq, d)
        all_valid = jnp.broadcast_to(valid_rows[rows][None], (g, width, nq)).reshape(-1)

        def copy_keys(at, size):
            at = at + copy_at[p]
            kt = lax.dynamic_slice(copy[0], (layer, 0, 0, at), (1, kvh, d, size))[0]
            v = lax.dynamic_slice(copy[1], (layer, 0, at, 0), (1, kvh, size, d))[0]
            return jnp.einsum("kqd,kdt->kqt", q_all, kt.astype(f32)), v.astype(f32), \
                "kqt,ktd->kqd"

        def page_keys(at, size):
            pages = lax.dynamic_slice_in_dim(shared_table, at // ps, size // ps) + page_offset
            k = k_pool[pages].reshape(size, kvh, d).astype(f32)
            v = v_pool[pages].reshape(size, kvh, d).astype(f32)
            return jnp.einsum("kqd,tkd->kqt", q_all, k), v, "kqt,tkd->kqd"

        def walk(keys, end, start, size, count, carry):
            """`count` blocks of `size` keys from `start`, read by `keys`; keys at or past
            `end` masked."""
            def body(j, carry):
                at = start + j * size
                scores, v, pv_spec = keys(at, size)  # scores [kvh, g*width*nq, size]
                mask = ((at + jnp.arange(size)) < end)[None, None, :] & all_valid[None, :,
                                                                                  None]
                return _online_update(*carry, scores, mask, v, pv_spec)
            return lax.fori_loop(0, count, body, carry)

        def blocks_of(keys, start, end, carry):
            """Keys `start` to `end`: whole big blocks, then the tail in small ones."""
            big = (end - start) // sblk
            carry = walk(keys, end, start, sblk, big, carry)
            return walk(keys, end, start + big * sblk, blk,
                        (end - start - big * sblk + blk - 1) // blk, carry)

        n = g * width * nq
        part = (jnp.full((kvh, n), _NEG, f32), jnp.zeros((kvh, n), f32),
                jnp.zeros((kvh, n, d), f32))
        if copy is not None:
            # The copy is read in big blocks only, the last one masked past its end: each
            # slot is whole big blocks long, and every block costs a loop iteration.
            part = walk(copy_keys, buffered[p], jnp.int32(0), sblk,
                        (buffered[p] + sblk - 1) // sblk, part)
        part = blocks_of(page_keys, buffered[p], limit, part)
        m, l, acc = part
        m = m.reshape(kvh, g, width, nq).transpose(2, 0, 1, 3)
        l = l.reshape(kvh, g, width, nq).transpose(2, 0, 1, 3)
        acc = acc.reshape(kvh, g, width, nq, d).transpose(2, 0, 1, 3, 4)
        # Each row is in one segment; the rows past a segment's last all land on row `s`.
        return tuple(c.at[rows].set(x) for c, x in zip(carry, (m, l, acc)))

    carry = (jnp.full((s + 1, kvh, g, nq), _NEG, f32), jnp.zeros((s + 1, kvh, g, nq), f32),
             jnp.zeros((s + 1, kvh, g, nq, d), f32))
    for part in segments:  # the segments of each width, as many as hold rows
        part = jnp.asarray(part, jnp.int32)
        carry = lax.fori_loop(0, jnp.sum(part[:, 0] < s), functools.partial(segment, part),
                              carry)
    m1, l1, acc1 = (c[:s] for c in carry)

    # -- each row's own pages, from the end of its shared prefix, in groups of rows --------
    def own_rows(a, b, carry):
        n = b - a
        tab, qg_r, pos_r, valid_r = tables[a:b], qg[a:b], q_pos[a:b], q_valid[a:b]
        start_r = start_tok[a:b]
        uniform = shared_rows is None  # every row starts at the same page: one slice

        def own_block(j, carry):  # m, l: [n, kvh, g, nq]; acc: [n, kvh, g, nq, d]
            if uniform:
                pages = lax.dynamic_slice_in_dim(tab, shared_len[0] // ps + j * pages_per_block,
                                                 pages_per_block, 1)
            else:  # rows past the end of their table read its last entry, masked
                idx = (start_r[:, None] // ps + j * pages_per_block
                       + jnp.arange(pages_per_block)[None, :])
                pages = jnp.take_along_axis(tab, jnp.minimum(idx, tab.shape[1] - 1), axis=1)
            pages = pages + page_offset
            k = k_pool[pages].reshape(n, blk, kvh, d).astype(f32)
            v = v_pool[pages].reshape(n, blk, kvh, d).astype(f32)
            scores = jnp.einsum("sqkgd,stkd->skgqt", qg_r, k)  # [n, kvh, g, nq, blk]
            k_pos = start_r[:, None] + j * blk + jnp.arange(blk)[None, :]  # [n, blk]
            mask = (k_pos[:, None, :] <= pos_r[:, :, None]) & valid_r[:, :, None]
            return _online_update(*carry, scores, mask[:, None, None], v, "skgqt,stkd->skgqd")

        blocks = (jnp.max(context_lens[a:b] - start_r) + blk - 1) // blk
        return lax.fori_loop(0, blocks, own_block, carry)

    bounds = [0]
    for n in row_groups:
        if bounds[-1] < s:
            bounds.append(min(s, bounds[-1] + n))
    if bounds[-1] < s:
        bounds.append(s)
    parts = [own_rows(a, b, (m1[a:b], l1[a:b], acc1[a:b])) for a, b in zip(bounds, bounds[1:])]
    _, l, acc = (jnp.concatenate([p[i] for p in parts]) for i in range(3))
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(s, nq, h, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("offsets",), donate_argnums=(3,))
def gather_prefix(k_pool, v_pool, pages, old, at, *, offsets: tuple[int | None, ...]):
    """Write the keys and values of `pages` ([n / page_size] int32, one layer's ids) into
    the copy `cascade_attention` reads, from its token `at` on, in every layer whose pool
    row of page 0 `offsets` gives (None: a sliding layer with pages of its own, which
    reads no shared prefix): `old` (kt [L, kv_heads, head_dim, tokens], v [L, kv_heads,
    tokens, head_dim]) is donated and overwritten in place. One gather and transpose per
    layer: a single gather over all layers, then one big transpose, ran 3-10x slower on
    XLA:CPU."""
    rows, ps, kvh, d = k_pool.shape
    n = pages.shape[0] * ps
    kt, vt = old
    for layer, offset in enumerate(offsets):
        if offset is None:
            continue
        rows_at = pages + offset
        kt = lax.dynamic_update_slice(
            kt, k_pool[rows_at].reshape(n, kvh, d).transpose(1, 2, 0)[None].astype(kt.dtype),
            (layer, 0, 0, at))
        vt = lax.dynamic_update_slice(
            vt, v_pool[rows_at].reshape(n, kvh, d).transpose(1, 0, 2)[None].astype(vt.dtype),
            (layer, 0, at, 0))
    return kt, vt


def _online_update(m, l, acc, scores, mask, v, pv_spec):
    """One block of the online softmax: fold `scores` (masked) and values into (m, l, acc)."""
    scores = jnp.where(mask, scores, _NEG)
    m_new = jnp.maximum(m, scores.max(-1))
    p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    return m_new, l * corr + p.sum(-1), acc * corr[..., None] + jnp.einsum(pv_spec, p, v)
