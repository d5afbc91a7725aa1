"""Attention for the model: backends behind one object (`backends.py`), and the registry.

    cpu               cascade attention in jnp, with a prefix copy and row groups (cpu.py)
    pallas            Pallas GPU kernels, Triton lowering (pallas_gpu.py)
    pallas_interpret  the same kernels in interpret mode (tests, any machine)
    dense             the dense reference every backend is tested against (reference.py)

Adding a backend: a module with an `AttentionBackend` subclass, and a line below.
"""

from __future__ import annotations

import jax

from .backends import AttentionBackend, DenseBackend, GroupLayout, PoolLayout
from .cpu import CpuBackend
from .pallas_gpu import PallasBackend, PallasInterpretBackend
from .reference import paged_attention_dense

BACKENDS: dict[str, type[AttentionBackend]] = {
    b.name: b for b in (CpuBackend, PallasBackend, PallasInterpretBackend, DenseBackend)}

__all__ = ["AttentionBackend", "BACKENDS", "GroupLayout", "PoolLayout", "default_backend",
           "make_backend", "paged_attention_dense"]


def default_backend() -> str:
    """The Pallas kernels on a GPU, the jnp CPU backend elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "cpu"


def make_backend(name: str | None, pool: PoolLayout, **options) -> AttentionBackend:
    """The backend called `name` (None: `default_backend()`) for `pool`; `options` go to
    its constructor (the CPU backend's block sizes, row groups, prefix copy)."""
    name = name or default_backend()
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of "
                         f"{', '.join(sorted(BACKENDS))}")
    return BACKENDS[name](pool, **options)
