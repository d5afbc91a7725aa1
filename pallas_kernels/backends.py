"""Attention backends behind one object.

The model calls attention twice per layer, once per group of the step (decode rows with
one query each; prefill blocks of `block_q` queries), and knows nothing else about it.
A backend owns everything between the plan and that call:

- on the host, before each step, `prepare()` turns the step's generic `GroupLayout`s (page
  tables, context and query lengths, as the runner packed them) into the metadata it
  needs, one opaque pytree per group, and updates any device state it keeps across steps
  (`state`, passed into every step);
- inside the compiled step, `attend()` reads one layer of the KV pool with that metadata.

The KV pool is one array for K and one for V, `[rows, page_size, kv_heads, head_dim]`
(an int8 pool: `head_dim + 4`, `to_pool`): layer l's page p is row `offsets[l] + p`
(`PoolLayout.offsets`: `l * pages` in a uniform pool), so one layer's view is a page
offset, never a copy. Page 0 of each layer is the null page.

Sliding-window layers (Gemma 3, Mistral): where the pool has a `window`, `prepare_step`
adds to each group a second, windowed metadata (`WindowMeta`: each row's page table cut
to the pages its queries' windows reach) and the model calls `attend_layer`, which reads a
sliding layer through `attend_window` instead: pages outside the window are not read. The
base class's `attend_window` is the dense reference over those few pages (a window's
worth of keys per row, whatever the context); a backend may override it with its kernel.
Where the pool gives the sliding layers their own pages (`window_pool`: fewer per layer
than the global layers' `pages`, numbered apart, scheduler/window_pages.py), each group
also carries the rows' sliding page tables (`GroupLayout.window_tables`) and the windowed
metadata is cut from those.

Registry: `pallas_kernels.BACKENDS` maps a name to its class; adding one (a TPU kernel,
say) is a file with a subclass and a line there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


# Bytes an int8 pool's row of one token and KV head keeps after its values: their scale.
INT8_SCALE_BYTES = 4


def row_elements(head_dim: int, dtype) -> int:
    """Elements a token's row of one KV head takes in a pool of `dtype`: head_dim, and an
    int8 pool's scale."""
    return head_dim + (INT8_SCALE_BYTES if np.dtype(dtype) == np.int8 else 0)


def to_pool(x, dtype):
    """Keys or values [..., head_dim] as a pool of `dtype` stores them: cast; for a uint16
    pool, the bit patterns of their bf16 values (the CPU's bf16 pool; the native kernels
    widen them as they read); for an int8 pool, each row (one token, one KV head) rounded
    to int8 over its largest magnitude, the row's f32 scale appended as 4 bytes
    ([..., head_dim + 4]; the native kernels multiply it back as they read)."""
    if np.dtype(dtype) == np.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    if np.dtype(dtype) == np.int8:
        x = x.astype(jnp.float32)
        scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
        scale = jnp.where(scale > 0, scale, 1.0)
        q = jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8)
        return jnp.concatenate([q, jax.lax.bitcast_convert_type(scale, jnp.int8)[..., 0, :]],
                               axis=-1)
    return x.astype(dtype)


def from_pool(rows, head_dim: int):
    """An int8 pool's rows [..., head_dim + 4] back as f32 [..., head_dim] (tests, and any
    reader without the native kernels' own widening); other pools' rows as f32."""
    if rows.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(rows, jnp.bfloat16).astype(jnp.float32)
    if rows.dtype != jnp.int8:
        return rows.astype(jnp.float32)
    scale = jax.lax.bitcast_convert_type(rows[..., head_dim:], jnp.float32)
    return rows[..., :head_dim].astype(jnp.float32) * scale[..., None]


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """The shape of the KV page pool a backend reads (`dtype`: the array's; uint16 holds
    bf16 bit patterns, int8 rows carry their scale, `to_pool`)."""

    layers: int
    pages: int  # pages per layer, the null page 0 included
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: Any
    pages_per_seq: int  # page-table width the runner packs
    window: int = 0  # the sliding layers' window in keys; 0: no sliding layers
    window_queries: int = 1  # the most queries a row of a step has (the prefill block)
    sliding: tuple[bool, ...] = ()  # per layer: does it slide (with `window_pool`)
    # Pages of each sliding layer where they are numbered apart from the global layers'
    # (scheduler/window_pages.py); 0: every layer has `pages`, one numbering.
    window_pool: int = 0

    @property
    def offsets(self) -> tuple[int, ...]:
        """Pool row of each layer's page 0."""
        out, at = [], 0
        for layer in range(self.layers):
            out.append(at)
            at += self.window_pool if self.window_pool and self.sliding[layer] else self.pages
        return tuple(out)

    @property
    def rows(self) -> int:
        """Rows of the pool array: every layer's pages."""
        if not self.window_pool:
            return self.layers * self.pages
        n = sum(self.sliding)
        return (self.layers - n) * self.pages + n * self.window_pool

    @property
    def window_pages(self) -> int:
        """Pages a windowed row's table holds: a window of keys before its first query,
        its queries, and a page boundary on each side."""
        return min(self.pages_per_seq, (self.window + self.window_queries - 2)
                   // self.page_size + 2)

    @property
    def row(self) -> int:
        """Elements a token's row of one KV head takes (`row_elements`)."""
        return row_elements(self.head_dim, self.dtype)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.rows, self.page_size, self.kv_heads, self.row)


@dataclasses.dataclass
class GroupLayout:
    """One attention group of a step, as the runner packed it (numpy, fixed shapes).

    Rows are sequences (decode) or query blocks (prefill; a block acts as a sequence
    whose context ends at its last query). Padding rows have context and query length 0
    and an all-zero table. Rows come sorted by context, longest first."""

    page_tables: np.ndarray  # [rows, pages_per_seq] int32: page ids of one layer
    context_lens: np.ndarray  # [rows] int32: keys in the pool, this step's included
    query_lens: np.ndarray  # [rows] int32: real queries, at the end of the context
    # [rows, pages_per_seq] int32: the sliding layers' page ids where they are numbered
    # apart (`PoolLayout.window_pool`; 0 where released); None: `page_tables` serve all.
    window_tables: np.ndarray | None = None

    @classmethod
    def empty(cls, rows: int, pages_per_seq: int, windowed: bool = False) -> "GroupLayout":
        return cls(np.zeros((rows, pages_per_seq), np.int32), np.zeros(rows, np.int32),
                   np.zeros(rows, np.int32),
                   np.zeros((rows, pages_per_seq), np.int32) if windowed else None)


class WindowMeta(NamedTuple):
    """A group's rows cut to their sliding windows (numpy; shapes fixed by the group's)."""

    page_tables: np.ndarray  # [rows, window_pages] int32: from the first page a query sees
    context_lens: np.ndarray  # [rows] int32: keys from that page's first on
    query_lens: np.ndarray  # [rows] int32

    @classmethod
    def of(cls, group: "GroupLayout", pool: PoolLayout) -> "WindowMeta":
        ps, width = pool.page_size, pool.window_pages
        ctx, ql = group.context_lens, group.query_lens
        lowest = np.maximum(ctx - ql - pool.window + 1, 0)  # the first query's first key
        first = np.where(ql > 0, lowest // ps, 0)
        src = group.page_tables if group.window_tables is None else group.window_tables
        idx = first[:, None] + np.arange(width)[None, :]
        inside = idx < src.shape[1]
        tables = np.where(inside, np.take_along_axis(
            src, np.minimum(idx, src.shape[1] - 1), axis=1), 0)
        return cls(tables.astype(np.int32), (ctx - first * ps).astype(np.int32),
                   ql.astype(np.int32))


class AttentionBackend:
    """One attention implementation. Subclasses set `name` and override `attend`, and
    `prepare`/`metadata` when they need more than the generic layout."""

    name: ClassVar[str]

    def __init__(self, pool: PoolLayout) -> None:
        self.pool = pool

    @property
    def state(self) -> Any:
        """Device arrays the backend keeps across steps, passed into each step (None)."""
        return None

    # -- host side ----------------------------------------------------------------------
    def metadata(self, group: GroupLayout) -> Any:
        """This backend's metadata for a group (numpy pytree; shapes depend only on the
        group's shape). Also used, on a zero layout, for compiling and warming up."""
        return (group.page_tables, group.context_lens, group.query_lens)

    def prepare(self, kv, groups: tuple[GroupLayout, GroupLayout], slots: np.ndarray,
                copies: list[tuple[int, int]]) -> tuple[Any, Any]:
        """Before a step: metadata for (decode, prefill). `slots` are the pool slots the
        step writes (layer 0's numbering) and `copies` the page copies run before it, for
        a backend whose state must never go stale."""
        return self.metadata(groups[0]), self.metadata(groups[1])

    def prepare_step(self, kv, groups: tuple[GroupLayout, GroupLayout], slots: np.ndarray,
                     copies: list[tuple[int, int]]) -> tuple[Any, Any]:
        """`prepare`, and where the pool has sliding layers each group's `WindowMeta`
        beside its metadata: what the runner puts in the step."""
        dec, pf = self.prepare(kv, groups, slots, copies)
        if not self.pool.window:
            return dec, pf
        return (dec, WindowMeta.of(groups[0], self.pool)), (pf, WindowMeta.of(groups[1], self.pool))

    def warmup(self, kv) -> None:
        """Compile and run once whatever the backend runs outside the step."""

    def describe(self) -> dict:
        return {"attention": self.name}

    # -- inside the compiled step ---------------------------------------------------------
    def attend(self, q, k_pool, v_pool, layer, meta, state):
        """q [rows, queries, heads, head_dim] -> the same shape: layer `layer` (a traced
        int) of the pool, with `meta` from `prepare` and the backend's `state`."""
        raise NotImplementedError

    def attend_layer(self, q, k_pool, v_pool, layer, meta, state, windowed=False):
        """`attend` for a global layer, `attend_window` for a sliding one (`windowed`: a
        Python bool in an unrolled layer loop, else traced: both are compiled, one runs)."""
        if not self.pool.window:
            return self.attend(q, k_pool, v_pool, layer, meta, state)
        full, win = meta
        if isinstance(windowed, bool):
            return (self.attend_window(q, k_pool, v_pool, layer, win, state) if windowed
                    else self.attend(q, k_pool, v_pool, layer, full, state))
        return jax.lax.cond(
            windowed, lambda q, k, v: self.attend_window(q, k, v, layer, win, state),
            lambda q, k, v: self.attend(q, k, v, layer, full, state), q, k_pool, v_pool)

    def attend_window(self, q, k_pool, v_pool, layer, meta: WindowMeta, state):
        """A sliding layer: each query over the `window` keys ending at its own, read from
        the row's windowed table only (the dense reference over those pages)."""
        from .reference import paged_attention_dense

        return paged_attention_dense(q, k_pool, v_pool, meta.page_tables + self.page_offset(layer),
                                     meta.context_lens, meta.query_lens, window=self.pool.window)

    def page_offset(self, layer):
        """Pool row of `layer`'s page 0 (`layer`: an int, or traced in a layer scan)."""
        if not self.pool.window_pool:
            return layer * self.pool.pages
        offsets = self.pool.offsets
        if isinstance(layer, int):
            return offsets[layer]
        return jnp.asarray(offsets, jnp.int32)[layer]


class DenseBackend(AttentionBackend):
    """The dense reference (`reference.paged_attention_dense`): tests and tiny models."""

    name = "dense"

    def attend(self, q, k_pool, v_pool, layer, meta, state):
        from .reference import paged_attention_dense

        tables, context_lens, query_lens = meta
        return paged_attention_dense(q, k_pool, v_pool, tables + self.page_offset(layer),
                                     context_lens, query_lens)
