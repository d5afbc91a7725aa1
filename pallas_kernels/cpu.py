"""The CPU backend: cascade attention in jnp (`cascade.py`) and the host work it needs.

Everything here exists because of how XLA:CPU spends its time, and none of it leaks into
the model or the runner (docs/architecture.md, "Attention backends"):

- cascade metadata: the page-table prefix most rows of a group share (the rows whose
  tables start like most do; the others walk their own tables), found on the host each
  step, so that the system prompt is read once per step, not once per row;
- the prefix copy (`PrefixCopy`): that prefix's keys and values kept gathered in a
  contiguous per-layer array, refilled only when the shared prefix changes (gathering its
  pages every step cost as much as the attention matmuls over them);
- row groups: decode rows in groups of 8, prefill blocks in halving groups, each group
  walking its own pages only as far as its longest row (the runner sorts rows longest
  first).
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
    shared_pages: np.ndarray  # [width] int32: the table prefix the sharing rows have
    shared_len: np.ndarray  # [] int32: its tokens (0: none)
    buffered_len: np.ndarray  # [] int32: how much of it the prefix copy holds
    shared_rows: np.ndarray  # [rows] int32: 1 for the rows that share it
    order: np.ndarray  # [rows] int32: row i of the tables above is the group's row order[i]


class CpuBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, pool: PoolLayout, *, pages_per_block: int = 8,
                 shared_pages_per_block: int = 64, decode_rows_per_group: int = 8,
                 group_prefill_blocks: bool = True, prefix_copy_tokens: int = 2048) -> None:
        super().__init__(pool)
        align = math.lcm(pages_per_block, shared_pages_per_block)
        self.width = -(-pool.pages_per_seq // align) * align
        self.pages_per_block = pages_per_block
        self.shared_pages_per_block = min(shared_pages_per_block, self.width)
        self.decode_rows_per_group = decode_rows_per_group
        self.group_prefill_blocks = group_prefill_blocks
        self.copy = None
        if prefix_copy_tokens > 0:
            self.copy = PrefixCopy(pool, prefix_copy_tokens,
                                   block_tokens=self.shared_pages_per_block * pool.page_size)

    @property
    def state(self):
        """The prefix copy's arrays (None without one)."""
        return None if self.copy is None else self.copy.arrays

    def describe(self) -> dict:
        return {"attention": self.name,
                "prefix_copy_tokens": self.copy.tokens if self.copy else 0}

    # -- host side --------------------------------------------------------------------------
    def metadata(self, group: GroupLayout, buffered: int = 0) -> CascadeMeta:
        """The cascade's plan for one group. In a decode group, the rows that share the
        prefix most tables start with go first and take the cascade; the others (another
        prefix: a batch job's, another adapter's) walk their own tables after them, when
        that walks fewer keys than no cascade would (row groups walk as far as their
        longest row). Otherwise only a prefix every row has is shared."""
        rows, width = group.page_tables.shape
        tables = np.zeros((rows, self.width), np.int32)
        tables[:, :width] = group.page_tables
        ctx, ql = group.context_lens, group.query_lens
        real = ql > 0
        order = np.arange(rows, dtype=np.int32)
        members = real
        if real.any() and (ql[real] == 1).all():
            some = sharing_rows(tables, ctx, ql, self.pool.page_size)
            if some.sum() < real.sum():
                first = np.argsort(~some, kind="stable").astype(np.int32)
                _, shared_len = shared_prefix(tables[some], ctx[some] - 1,
                                              self.pool.page_size, self.width)
                start = np.where(some, shared_len, 0)[first]
                if self._walk(ctx[first] - start) < self._walk(ctx):
                    order, members = first, some
        tables, ctx, ql, members = tables[order], ctx[order], ql[order], members[order]
        first_pos = ctx[members] - ql[members]
        shared, shared_len = shared_prefix(tables[members], first_pos, self.pool.page_size,
                                           self.width)
        return CascadeMeta(tables, ctx, ql, shared, np.int32(shared_len),
                           np.int32(min(buffered, shared_len)), members.astype(np.int32),
                           order)

    def _walk(self, lengths: np.ndarray) -> int:
        """Keys the decode row groups walk for rows of these own lengths, in order."""
        n = self.decode_rows_per_group
        return sum(int(lengths[i:i + n].max()) * len(lengths[i:i + n])
                   for i in range(0, len(lengths), n))

    def prepare(self, kv, groups, slots, copies):
        dec, pf = self.metadata(groups[0]), self.metadata(groups[1])
        if self.copy is None:
            return dec, pf
        ps = self.pool.page_size
        written = [slots // ps, np.asarray([dst for _, dst in copies], np.int32)]
        held = self.copy.update(kv, np.concatenate(written), *(
            m.shared_pages[:int(m.shared_len) // ps] for m in (dec, pf)))
        return tuple(m._replace(buffered_len=np.int32(_common_prefix(
            held, m.shared_pages[:int(m.shared_len) // ps]) * ps)) for m in (dec, pf))

    def warmup(self, kv) -> None:
        if self.copy is not None:
            self.copy.fill(kv, np.zeros(0, np.int32))

    # -- inside the compiled step ----------------------------------------------------------
    def attend(self, q, k_pool, v_pool, layer, meta: CascadeMeta, state):
        rows, queries = q.shape[:2]
        q = q[meta.order]  # the plan's row order (sharing rows first), undone at the end
        if queries == 1:
            groups = (self.decode_rows_per_group,) * -(-rows // self.decode_rows_per_group)
        else:
            groups = halving_groups(rows) if self.group_prefill_blocks else ()
        out = cascade_attention(
            q, k_pool, v_pool, self.page_offset(layer), meta.page_tables, meta.context_lens,
            meta.query_lens, meta.shared_pages, meta.shared_len, meta.shared_rows, state,
            None if state is None else layer, None if state is None else meta.buffered_len,
            pages_per_block=self.pages_per_block,
            shared_pages_per_block=self.shared_pages_per_block, row_groups=groups)
        return jnp.zeros_like(out).at[meta.order].set(out)


class PrefixCopy:
    """One shared prefix's keys and values, gathered contiguous for every layer.

    Sound because a page's contents change only by being written: every step's writes
    (its tokens' slots) and page copies are checked first, and the copy is cut back to
    before the first page written. It holds whichever group's prefix saves the step the
    most pages of gathering (both groups counted: a long prompt's earlier chunks often
    extend the decode rows' system prompt), and moves only when another would save
    `MIN_GAIN_PAGES` more, so two prefixes of similar length do not take turns."""

    MIN_GAIN_PAGES = 16

    def __init__(self, pool: PoolLayout, tokens: int, *, block_tokens: int) -> None:
        self.pool = pool
        # A multiple of the cascade's big block: no slice of the copy is ever clamped.
        self.tokens = max(block_tokens, -(-tokens // block_tokens) * block_tokens)
        self.capacity = self.tokens // pool.page_size  # pages
        shape_k = (pool.layers, pool.kv_heads, pool.head_dim, self.tokens)
        shape_v = (pool.layers, pool.kv_heads, self.tokens, pool.head_dim)
        self.arrays = (jnp.zeros(shape_k, pool.dtype), jnp.zeros(shape_v, pool.dtype))
        self.pages = np.zeros(0, np.int32)  # the pages whose contents the copy holds
        self.fills = 0

    def fill(self, kv, pages: np.ndarray) -> None:
        padded = np.zeros(self.capacity, np.int32)
        padded[:len(pages)] = pages
        self.arrays = gather_prefix(kv[0], kv[1], padded, self.arrays,
                                    pages_per_layer=self.pool.pages)
        self.pages = pages.copy()

    def update(self, kv, written: np.ndarray, dec: np.ndarray, pf: np.ndarray) -> np.ndarray:
        """Bring the copy up to date for a step whose groups share `dec` and `pf` and which
        writes pages `written`; returns the pages it holds."""
        if len(self.pages):
            hit = np.isin(self.pages, written)
            if hit.any():
                self.pages = self.pages[:int(np.argmax(hit))]

        def saved(pages: np.ndarray) -> int:
            return _common_prefix(pages, dec) + _common_prefix(pages, pf)

        best = max((w[:self.capacity] for w in (dec, pf) if len(w)), key=saved, default=None)
        if best is not None and (saved(best) - saved(self.pages)
                                 >= min(self.MIN_GAIN_PAGES, len(best))):
            self.fill(kv, best)
            self.fills += 1
        return self.pages


def sharing_rows(tables: np.ndarray, context_lens: np.ndarray, query_lens: np.ndarray,
                 page_size: int) -> np.ndarray:
    """[rows] bool: the real rows whose tables start with the page most of them start
    with (among those with a whole page before their first query): the rows a cascade
    serves. Rows of other prefixes (another adapter's, a batch job's) walk their own."""
    real = query_lens > 0
    whole = real & (context_lens - query_lens >= page_size)
    if whole.sum() < 2:
        return real
    first, counts = np.unique(tables[whole, 0], return_counts=True)
    if counts.max() < 2:
        return real
    return real & (tables[:, 0] == first[np.argmax(counts)])


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


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    same = a[:n] == b[:n]
    return n if same.all() else int(np.argmin(same))
