"""Attention behind one interface.

`paged_attention(...)` takes the same arguments as `reference.paged_attention_reference`
(see its shape comments) and picks an implementation by backend: the Pallas GPU kernels
when running on a GPU, the jnp reference elsewhere. `impl` forces one ("reference",
"pallas", "pallas_interpret").
"""

from __future__ import annotations

import jax

from .reference import paged_attention_reference
# Imported here, before `paged_attention` (the function) is defined below: importing the
# submodule of the same name later, e.g. lazily on the first Pallas call, would rebind the
# package attribute `pallas_kernels.paged_attention` to the module. (So the attribute is
# the function; reach the module with `from pallas_kernels.paged_attention import ...`.)
from . import paged_attention as _kernels  # imports jax and jax.experimental.pallas only

__all__ = ["paged_attention", "paged_attention_reference", "default_impl"]


def default_impl() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def paged_attention(q, k_pages, v_pages, page_tables, context_lens, query_lens,
                    shared_pages=None, shared_len=None, shared_kv=None,
                    buffered_len=None, *, impl: str | None = None,
                    pages_per_block: int = 8,
                    rows_per_group: int | tuple[int, ...] | None = None,
                    scale=None):
    """`shared_pages`/`shared_len` name a page-table prefix common to every sequence, and
    `shared_kv` optionally holds the first `buffered_len` tokens of its keys and values
    contiguous (see the reference). They change the cost, never the result, so an
    implementation may ignore them: the page tables still list the shared pages."""
    impl = impl or default_impl()
    if impl == "reference":
        return paged_attention_reference(q, k_pages, v_pages, page_tables, context_lens,
                                         query_lens, shared_pages, shared_len, shared_kv,
                                         buffered_len, pages_per_block=pages_per_block,
                                         rows_per_group=rows_per_group, scale=scale)
    if impl in ("pallas", "pallas_interpret"):
        return _kernels.paged_attention_pallas(q, k_pages, v_pages, page_tables,
                                               context_lens, query_lens, scale=scale,
                                               interpret=impl == "pallas_interpret")
    raise ValueError(f"unknown attention {impl=}; expected reference, pallas or pallas_interpret")
