"""The CPU backend: cascade attention in jnp (`cascade.py`) and the host work it needs.

Everything here exists because of how XLA:CPU spends its time, and none of it leaks into
the model or the runner (docs/architecture.md, "Attention backends"):

- cascade metadata: the page-table prefix every row of a group shares, found on the host
  each step, so that the system prompt is read once per step, not once per row;
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
    shared_pages: np.ndarray  # [width] int32: the table prefix every real row has
    shared_len: np.ndarray  # [] int32: its tokens (0: none)
    buffered_len: np.ndarray  # [] int32: how much of it the prefix copy holds


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
        rows, width = group.page_tables.shape
        tables = np.zeros((rows, self.width), np.int32)
        tables[:, :width] = group.page_tables
        real = group.query_lens > 0
        first_pos = group.context_lens[real] - group.query_lens[real]
        shared, shared_len = shared_prefix(tables[real], first_pos, self.pool.page_size,
                                           self.width)
        return CascadeMeta(tables, group.context_lens, group.query_lens, shared,
                           np.int32(shared_len), np.int32(min(buffered, shared_len)))

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
        if queries == 1:
            groups = (self.decode_rows_per_group,) * -(-rows // self.decode_rows_per_group)
        else:
            groups = halving_groups(rows) if self.group_prefill_blocks else ()
        return cascade_attention(
            q, k_pool, v_pool, self.page_offset(layer), meta.page_tables, meta.context_lens,
            meta.query_lens, meta.shared_pages, meta.shared_len, state,
            None if state is None else layer, None if state is None else meta.buffered_len,
            pages_per_block=self.pages_per_block,
            shared_pages_per_block=self.shared_pages_per_block, row_groups=groups)


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
