"""The CPU backend: cascade attention in jnp (`cascade.py`) and the host work it needs.

Everything here exists because of how XLA:CPU spends its time, and none of it leaks into
the model or the runner (docs/architecture.md, "Attention backends"):

- cascade metadata: the page-table prefixes rows share (a system prompt; one per adapter
  or customer when several are served at once: up to `max_prefixes` in a decode group),
  found on the host each step, so that each is read once per segment of rows, not once
  per row;
- the prefix copy (`PrefixCopy`): those prefixes' keys and values kept gathered in
  contiguous per-layer arrays, one slot per prefix, refilled only when a prefix changes
  (gathering its pages every step cost as much as the attention matmuls over them);
- row groups: rows sorted by the length of their own walk (after their prefix), decode
  rows in groups of 8 and prefill blocks in halving groups, each group walking its own
  pages only as far as its longest row.

Where the native kernels build (`native`), attention is theirs instead and only the
prefix metadata above is used: each shared prefix read once for its decode rows, then
each row's own pages, and prefill blocks whole (`_attend_native`). (About 425 lines: the
metadata, the copy and both ways of attending share one plan and stay together.)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from .backends import AttentionBackend, GroupLayout, PoolLayout
from .cascade import cascade_attention, gather_prefix


class CascadeMeta(NamedTuple):
    page_tables: np.ndarray  # [rows, width] int32, width a multiple of the block sizes
    context_lens: np.ndarray  # [rows] int32
    query_lens: np.ndarray  # [rows] int32
    shared_pages: np.ndarray  # [prefixes, width] int32: table prefixes rows share
    shared_len: np.ndarray  # [prefixes] int32: their tokens (0: unused)
    buffered_len: np.ndarray  # [prefixes] int32: how much of each the prefix copy holds
    copy_at: np.ndarray  # [prefixes] int32: where in the copy (tokens)
    shared_rows: np.ndarray  # [rows] int32: 1 + the index of the row's prefix, 0: none
    segments: tuple  # ([1, rows], [n, segment_rows]) int32: rows read together against
    #   their prefix (`rows`: none), one wide segment and (decode) narrow ones
    order: np.ndarray  # [rows] int32: row i of the tables above is the group's row order[i]


class CpuBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, pool: PoolLayout, *, pages_per_block: int = 8,
                 shared_pages_per_block: int = 64, decode_rows_per_group: int = 8,
                 group_prefill_blocks: bool = True, prefix_copy_tokens: int = 2048,
                 max_prefixes: int = 4, segment_rows: int = 4,
                 prefix_copies: int = 4, native: bool | None = None,
                 min_prefix_rows: int | None = None,
                 min_prefix_rows_several: int | None = None) -> None:
        super().__init__(pool)
        # The native kernels (cpu_kernels/csrc/decode_attention.cc, lane_attention.cc): None =
        # where they build fast (or the pool is bf16 bits, which only they read) and the
        # pool is f32 or bf16 bits (otherwise the jnp cascade).
        # bf16 bit patterns and int8 rows with their scale: the native kernels only
        native_only = np.dtype(pool.dtype) in (np.uint16, np.int8)
        if native is None:
            from cpu_kernels.native import available, fast

            native = (available() if native_only else fast())[0]
        self.native = bool(native) and np.dtype(pool.dtype) in (np.float32, np.uint16, np.int8) \
            and pool.head_dim % 16 == 0 and pool.head_dim <= 256
        if native_only and not self.native:
            raise ValueError(f"a KV pool of {'int8' if pool.dtype == np.int8 else 'bf16 bit'} "
                             "rows is read by the native kernels only (they are unavailable, "
                             "or the head dimension is not a multiple of 16 up to 256)")
        # A decode group reads a shared prefix once for its rows from this many rows on;
        # fewer walk it themselves. None: from 2 rows, but from 6 where the lane walk has
        # vectors of 8 (AVX2): there the rows' own walks (split in spans over the threads)
        # cost less up to 4 rows, about as much at 5-6, more from 8 (docs/history/benchmarks-log.md,
        # twenty-fifth session). Where two or more prefixes have `min_prefix_rows_several`
        # rows (several adapters' copies of one system prompt; None: 4 there, else
        # `min_prefix_rows`), each is read once from that many: rows walking their
        # prefixes re-read four prefixes' bytes from memory (thirty-first session: 16
        # decodes over four copies, 4 rows each, 77.2 -> 75.0 ms with an int8 pool,
        # 85.5 -> 82.4 with bf16).
        if min_prefix_rows is None:
            from cpu_kernels.native import lane_width

            eight = self.native and lane_width() == 8
            min_prefix_rows = 6 if eight else 2
            if min_prefix_rows_several is None and eight:
                min_prefix_rows_several = 4
        if min_prefix_rows_several is None:
            min_prefix_rows_several = min_prefix_rows
        self.min_prefix_rows = max(2, min_prefix_rows)
        self.min_prefix_rows_several = max(2, min(min_prefix_rows_several, self.min_prefix_rows))
        align = math.lcm(pages_per_block, shared_pages_per_block)
        self.width = -(-pool.pages_per_seq // align) * align
        self.pages_per_block = pages_per_block
        self.shared_pages_per_block = min(shared_pages_per_block, self.width)
        self.decode_rows_per_group = decode_rows_per_group
        self.group_prefill_blocks = group_prefill_blocks
        self.max_prefixes = max(1, max_prefixes)
        self.segment_rows = max(1, segment_rows)
        self.copy = None
        # The jnp cascade reads prefixes from a gathered copy; the native kernels read
        # the pages where they lie.
        if prefix_copy_tokens > 0 and prefix_copies > 0 and not self.native:
            self.copy = PrefixCopy(pool, prefix_copy_tokens, slots=prefix_copies,
                                   block_tokens=self.shared_pages_per_block * pool.page_size)

    @property
    def state(self):
        """The prefix copy's arrays (None without one)."""
        return None if self.copy is None else self.copy.arrays

    def describe(self) -> dict:
        return {"attention": self.name,
                "prefix_copy_tokens": self.copy.tokens if self.copy else 0,
                "prefix_copies": self.copy.slots if self.copy else 0,
                "max_prefixes": self.max_prefixes,
                "min_prefix_rows": [self.min_prefix_rows, self.min_prefix_rows_several],
                "native": self.native}

    # -- host side --------------------------------------------------------------------------
    def metadata(self, group: GroupLayout, decode: bool | None = None) -> CascadeMeta:
        """The cascade's plan for one group (`decode`: rows of one query; None: inferred).
        A decode group shares up to `max_prefixes` prefixes, each read by its rows at
        once, or in segments of `segment_rows` for all but the most shared; a prefill
        group (blocks of a few prompts' chunks) one, read by all its rows at once. Rows come out sorted by their own walk, longest
        first; the prefix copy is not consulted here (`prepare` does)."""
        rows, width = group.page_tables.shape
        ps = self.pool.page_size
        tables = np.zeros((rows, self.width), np.int32)
        tables[:, :width] = group.page_tables
        ctx, ql = group.context_lens, group.query_lens
        if decode is None:
            decode = bool((ql <= 1).all())
        n_prefixes = self.max_prefixes if decode else 1
        # In jnp, a prefill group's rows read their prompt's earlier pages as a prefix
        # even alone: in big blocks, not the own walk's small ones (a 16-token question
        # after a 2,000-token system prompt: 16 loop iterations a layer become 2 and a
        # tail). The native prefill kernel walks each block's pages whole.
        if self.native and not decode:
            found = []
        else:
            found = prefix_groups(tables, ctx, ql, ps, self.width,
                                  min_rows=self.min_prefix_rows if decode else 1,
                                  min_rows_several=self.min_prefix_rows_several
                                  if decode else 1)[:n_prefixes]
        prefix = np.full(rows, -1, np.int32)
        shared = np.zeros((n_prefixes, self.width), np.int32)
        shared_len = np.zeros(n_prefixes, np.int32)
        for i, (members, pages, length) in enumerate(found):
            prefix[members], shared[i], shared_len[i] = i, pages, length
        own = np.where(ql > 0, ctx - np.where(prefix >= 0, shared_len[prefix], 0), -1)
        order = np.argsort(-own, kind="stable").astype(np.int32)  # padding rows last
        prefix = prefix[order]
        # One wide segment (every row) for the prefix most rows share; in a decode group,
        # narrow ones of `segment_rows` for the others (and for it too when it has no
        # more rows than one): reading a prefix in segments of few rows costs more than
        # in one of many (in a step of one prefix, 150 -> 184 ms at segments of 8).
        wide = np.full((1, rows), rows, np.int32)
        narrow_rows = min(self.segment_rows, max(rows, 1))
        narrow = np.full((-(-rows // narrow_rows) + n_prefixes - 1, narrow_rows), rows,
                         np.int32)
        at = 0
        for i in range(len(found)):
            members = np.flatnonzero(prefix == i)
            if i == 0 and (not decode or len(members) > narrow_rows):
                wide[0, :len(members)] = members
                continue
            for j in range(0, len(members), narrow_rows):
                part = members[j:j + narrow_rows]
                narrow[at, :len(part)] = part
                at += 1
        zero = np.zeros(n_prefixes, np.int32)
        return CascadeMeta(tables[order], ctx[order], ql[order], shared, shared_len, zero,
                           zero, (prefix + 1).astype(np.int32),
                           (wide, narrow) if decode else (wide,), order)

    def prepare(self, kv, groups, slots, copies):
        dec, pf = self.metadata(groups[0], decode=True), self.metadata(groups[1], decode=False)
        if self.copy is None:
            return dec, pf
        ps = self.pool.page_size
        written = [slots // ps, np.asarray([dst for _, dst in copies], np.int32)]
        prefixes = [m.shared_pages[i, :int(m.shared_len[i]) // ps]
                    for m in (dec, pf) for i in range(len(m.shared_len))]
        held = self.copy.update(kv, np.concatenate(written), prefixes)
        out = []
        for m in (dec, pf):
            n = len(m.shared_len)
            at, buffered = (np.asarray(x, np.int32) for x in zip(*held[:n]))
            held = held[n:]
            out.append(m._replace(buffered_len=buffered, copy_at=at))
        return tuple(out)

    def warmup(self, kv) -> None:
        if self.copy is not None:
            self.copy.fill(kv, 0, np.zeros(0, np.int32))

    # -- inside the compiled step ----------------------------------------------------------
    def attend(self, q, k_pool, v_pool, layer, meta: CascadeMeta, state):
        rows, queries = q.shape[:2]
        q = q[meta.order]  # the plan's row order, undone at the end
        if self.native:
            out = self._attend_native(q, k_pool, v_pool, layer, meta)
        else:
            if queries == 1:
                groups = (self.decode_rows_per_group,) * -(-rows // self.decode_rows_per_group)
            else:
                groups = halving_groups(rows) if self.group_prefill_blocks else ()
            with_copy = state is not None
            out = cascade_attention(
                q, k_pool, v_pool, self.page_offset(layer), meta.page_tables,
                meta.context_lens, meta.query_lens, meta.shared_pages, meta.shared_len,
                meta.shared_rows, state, layer if with_copy else None,
                meta.buffered_len if with_copy else None,
                meta.copy_at if with_copy else None, meta.segments,
                pages_per_block=self.pages_per_block,
                shared_pages_per_block=self.shared_pages_per_block, row_groups=groups)
        return jnp.zeros_like(out).at[meta.order].set(out)

    def attend_window(self, q, k_pool, v_pool, layer, meta, state):
        """Decode rows of a sliding layer through the native decode kernel, from the first
        key of each row's window (the pages before it are not read); prefill blocks
        through the base class's dense window."""
        rows, queries, heads, d = q.shape
        if not self.native or queries != 1:
            return super().attend_window(q, k_pool, v_pool, layer, meta, state)
        from cpu_kernels.native import decode_attention

        kvh, f32 = self.pool.kv_heads, jnp.float32
        qg = (q.astype(f32) * d ** -0.5).reshape(rows, kvh, heads // kvh, d)
        ctx = jnp.where(meta.query_lens > 0, meta.context_lens, 0)
        start = jnp.maximum(ctx - self.pool.window, 0)
        m = jnp.full(qg.shape[:3], -1e30, f32)  # no prefix: the softmax starts empty
        out = decode_attention(qg, k_pool, v_pool, self.page_offset(layer), meta.page_tables,
                               start, ctx, m, jnp.zeros_like(m), jnp.zeros_like(qg))
        return out.reshape(rows, 1, heads, d).astype(q.dtype)

    def _attend_native(self, q, k_pool, v_pool, layer, meta: CascadeMeta):
        """Decode rows: each shared prefix once for its rows (lanes), then each row's own
        pages (`decode_attention`); prefill blocks: each block's queries in lanes."""
        from cpu_kernels.native import decode_attention, prefill_attention, prefix_attention

        rows, queries, heads, d = q.shape
        kvh = self.pool.kv_heads
        qg = (q.astype(jnp.float32) * d ** -0.5).reshape(rows, queries, kvh, heads // kvh, d)
        offset = self.page_offset(layer)
        if queries == 1:
            m, l, acc = prefix_attention(qg[:, 0], k_pool, v_pool, offset, meta.shared_pages,
                                         meta.shared_len, meta.shared_rows)
            start = jnp.where(meta.shared_rows > 0,
                              jnp.asarray(meta.shared_len)[jnp.maximum(meta.shared_rows - 1, 0)],
                              0)
            ctx = jnp.where(meta.query_lens > 0, meta.context_lens, 0)  # padding: no keys
            out = decode_attention(qg[:, 0], k_pool, v_pool, offset, meta.page_tables, start,
                                   ctx, m, l, acc)
        else:
            out = prefill_attention(qg, k_pool, v_pool, offset, meta.page_tables,
                                    meta.context_lens, meta.query_lens)
        return out.reshape(rows, queries, heads, d).astype(q.dtype)


class PrefixCopy:
    """Shared prefixes' keys and values, gathered contiguous for every layer, one prefix
    per slot (`tokens` each).

    Sound because a page's contents change only by being written: every step's writes
    (its tokens' slots) and page copies are checked first, and a slot is cut back to
    before the first page written. Each of a step's prefixes (most shared first) is
    served by the slot holding most of it; one that no slot holds well enough is
    gathered into a slot no prefix of this step or the last one used (or an empty one),
    so that more prefixes than slots do not take turns refilling them (the others read
    their pages).
    A slot that serves a prefix moves to another only when that one would save
    `MIN_GAIN_PAGES` more pages (two prefixes of similar length do not take turns)."""

    MIN_GAIN_PAGES = 16

    def __init__(self, pool: PoolLayout, tokens: int, *, block_tokens: int,
                 slots: int = 1) -> None:
        self.pool = pool
        # A multiple of the cascade's big block: no slice of the copy is ever clamped.
        self.tokens = max(block_tokens, -(-tokens // block_tokens) * block_tokens)
        self.capacity = self.tokens // pool.page_size  # pages per slot
        self.slots = slots
        total = slots * self.tokens
        shape_k = (pool.layers, pool.kv_heads, pool.head_dim, total)
        shape_v = (pool.layers, pool.kv_heads, total, pool.head_dim)
        self.arrays = (jnp.zeros(shape_k, pool.dtype), jnp.zeros(shape_v, pool.dtype))
        self.held = [np.zeros(0, np.int32) for _ in range(slots)]  # pages each slot holds
        own = pool.window_pool and pool.sliding  # sliding layers with pages of their own
        self._gather_offsets = tuple(None if own and own[i] else o
                                     for i, o in enumerate(pool.offsets))
        self.last_used = [-2] * slots  # the step each slot last served a prefix
        self.steps = 0
        self.fills = 0

    @property
    def pages(self) -> np.ndarray:
        """The pages slot 0 holds."""
        return self.held[0]

    def fill(self, kv, slot: int, pages: np.ndarray) -> None:
        padded = np.zeros(self.capacity, np.int32)
        padded[:len(pages)] = pages
        self.arrays = gather_prefix(kv[0], kv[1], padded, self.arrays,
                                    np.int32(slot * self.tokens),
                                    offsets=self._gather_offsets)
        self.held[slot] = pages.copy()

    def update(self, kv, written: np.ndarray,
               prefixes: list[np.ndarray]) -> list[tuple[int, int]]:
        """Bring the copy up to date for a step whose groups share `prefixes` (page ids,
        most shared first; empty: unused) and which writes pages `written`. Returns, per
        prefix, (the token its slot starts at, tokens of it the slot holds)."""
        self.steps += 1
        for s, pages in enumerate(self.held):
            self.held[s] = pages[:_first(np.isin(pages, written))]
        # A prefix's pages this step writes (a prompt's earlier blocks, shared by its later
        # ones) are read from the pool: a copy made now would miss what the step writes.
        wanted = [p[:min(self.capacity, _first(np.isin(p, written)))] for p in prefixes]
        served: dict[int, int] = {}  # slot -> the index of the first prefix it serves

        def best(pages):
            common = [_common_prefix(h, pages) for h in self.held]
            return int(np.argmax(common)), max(common)

        for i, pages in enumerate(wanted):
            if not len(pages):
                continue
            slot, common = best(pages)
            if len(pages) - common < min(self.MIN_GAIN_PAGES, len(pages)):
                served.setdefault(slot, i)
                continue
            if common and slot not in served:  # extend (or move) the slot it is in
                target = slot
            else:
                idle = [s for s in range(self.slots) if s not in served and (
                    self.last_used[s] < self.steps - 1 or not len(self.held[s]))]
                if not idle:
                    if common:
                        served.setdefault(slot, i)
                    continue
                target = min(idle, key=lambda s: self.last_used[s])
            self.fill(kv, target, pages)
            self.fills += 1
            served[target] = i
        out = []
        for pages in wanted:
            if not len(pages):
                out.append((0, 0))
                continue
            slot, common = best(pages)
            if common:
                self.last_used[slot] = self.steps
            out.append((slot * self.tokens, common * self.pool.page_size))
        return out


def prefix_groups(tables: np.ndarray, context_lens: np.ndarray, query_lens: np.ndarray,
                  page_size: int, width: int, min_rows: int = 2,
                  min_rows_several: int | None = None
                  ) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """The rows that share a table prefix, by their first page (among real rows with a
    whole page before their first query; `min_rows` rows at least, or `min_rows_several`
    where two or more prefixes have that many): (rows, the prefix's pages [width], its
    tokens) per prefix, the one that saves most reading first. A system prompt under
    several adapters is several prefixes (the keys differ); rows of a prefix of their own
    walk it themselves (with `min_rows` 1: read it as a prefix)."""
    real = query_lens > 0
    whole = real & (context_lens - query_lens >= page_size)
    several = min_rows if min_rows_several is None else min(min_rows, min_rows_several)
    if whole.sum() < several:
        return []
    firsts, counts = np.unique(tables[whole, 0], return_counts=True)
    if (counts >= several).sum() >= 2:
        min_rows = several
    found = []
    for first in firsts[counts >= min_rows]:
        members = np.flatnonzero(whole & (tables[:, 0] == first))
        pages, length = shared_prefix(tables[members],
                                      context_lens[members] - query_lens[members],
                                      page_size, width)
        if length:
            found.append((members, pages, length))
    found.sort(key=lambda f: (-(len(f[0]) - 1) * f[2], -f[2]))
    return found


def shared_prefix(tables: np.ndarray, first_pos: np.ndarray, page_size: int, width: int):
    """The page-table prefix every row shares, in whole pages before every row's first
    query: (pages [width], tokens)."""
    shared = np.zeros(width, np.int32)
    if len(tables) == 0:
        return shared, 0
    limit = int(first_pos.min()) // page_size
    if len(tables) > 1 and limit:
        same = (tables[:, :limit] == tables[0, :limit]).all(axis=0)
        limit = limit if same.all() else int(np.argmin(same))
    shared[:limit] = tables[0, :limit]
    return shared, limit * page_size


def halving_groups(n: int) -> tuple[int, ...]:
    """Sizes of groups of `n` rows sorted longest first, each half the rows left: a few
    long rows then leave the rest short walks, at log2(n) loops (n=16: 8, 4, 2, 1, 1)."""
    sizes = []
    while n > 1:
        sizes.append(-(-n // 2))
        n -= sizes[-1]
    return (*sizes, 1) if sizes else ()


def _first(hits: np.ndarray) -> int:
    """Index of the first True (len if none)."""
    return int(np.argmax(hits)) if hits.any() else len(hits)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    same = a[:n] == b[:n]
    return n if same.all() else int(np.argmin(same))
