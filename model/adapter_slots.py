"""The runner's LoRA adapter slots: preallocated device arrays, and the adapters' host copies.

Per fused projection group (`lora.GROUPS`), one stacked array for A and one per target for
B, allocated once at start like the KV pool, layer first so that a layer's slice is
contiguous, and laid out so that `llama._lora_delta` multiplies every slot at once with
two plain matmuls (no transposes in the step):

    A, feature-major  [layers, targets, slots, R, in]   row-major [layers, in, targets, slots, R]
    B (per target)    [layers, out, slots, R]                     [layers, slots, R, out]

On the CPU, where the native kernels build, a group is a `NativeLora` instead: A as
feature-major above, one B for all its targets in blocks of 16 output columns [layers,
slots, blocks, R, 16] (`pallas_kernels.native.pack_lora_b`), multiplied by the CPU
backend's kernel (csrc/lora_delta.cc), which reads each token's own slot only and adds
the delta in place; stored in bf16 when the runner's base weights are int8 (their kernel
rounds activations to bf16 too), else in the runner's dtype.

Loading an adapter into a slot writes its arrays there with a program compiled at
warm-up (the slot is a traced index and the arrays are donated, so a load is a copy in
place, never a compile).
Which adapter goes in which slot is the scheduler's decision (`scheduler/adapters.py`);
the plan says, and `load` does it before the step.

Host copies: every registered adapter's path is kept; the arrays of at most `slots +
max_cpu` of them stay in memory (least recently used go), the others are read from disk
again when a slot needs them.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels.native import LORA_BLOCK, fast, lora_delta, pack_lora_b

from .config import ModelConfig
from .lora import GROUPS, LoraAdapter, group_shapes, load_peft_adapter

log = logging.getLogger("sluice.adapters")


@struct.dataclass
class NativeLora:
    """One fused group's slots in the CPU kernel's layout; `apply` adds each token's
    delta (model/llama.py calls it in place of the stacked-mask matmuls)."""

    a: jax.Array  # [layers, targets, slots, R, in]
    b: jax.Array  # [layers, slots, blocks, R, 16]: every target's B (`pack_lora_b`)
    bounds: tuple = struct.field(pytree_node=False, default=())

    def apply(self, y, x, slots, layer, *, feature_major: bool):
        return lora_delta(y, x, self.a, self.b, slots, layer, np.asarray(self.bounds),
                          feature_major=feature_major).astype(y.dtype)


def native_available() -> bool:
    """Whether this process runs the native LoRA kernel (the CPU backend, kernels built)."""
    return jax.default_backend() == "cpu" and fast()[0]


class LoraSlots:
    def __init__(self, config: ModelConfig, slots: int, *, max_rank: int, dtype,
                 feature_major: bool, max_cpu: int | None = None,
                 native: bool = False) -> None:
        """`native`: the CPU kernel's layout (`NativeLora`), else the stacked one."""
        self.config, self.slots, self.max_rank = config, slots, max_rank
        self.dtype, self.feature_major, self.native = dtype, feature_major, native
        self.max_host = slots + (max_cpu if max_cpu is not None else slots)
        shapes = group_shapes(config)
        L, R = config.num_layers, max_rank
        self.arrays = {}
        for group, mods in GROUPS.items():
            n_in, outs = shapes[group]
            t, fm = len(mods), feature_major
            if native:
                blocks = sum(-(-o // LORA_BLOCK) for o in outs)
                self.arrays[group] = NativeLora(
                    jnp.zeros((L, t, slots, R, n_in), dtype),
                    jnp.zeros((L, slots, blocks, R, LORA_BLOCK), dtype),
                    tuple(int(v) for v in np.concatenate([[0], np.cumsum(outs)])))
                continue
            a = (L, t, slots, R, n_in) if fm else (L, n_in, t, slots, R)
            bs = tuple((L, o, slots, R) if fm else (L, slots, R, o) for o in outs)
            self.arrays[group] = (jnp.zeros(a, dtype), tuple(jnp.zeros(b, dtype) for b in bs))
        self.paths: dict[str, str] = {}  # every registered adapter
        self._host: OrderedDict[str, dict] = OrderedDict()  # name -> arrays, device layout
        self._write: Callable | None = None
        self._lock = threading.Lock()  # registry changes come from the app's threads
        self.disk_reads = 0

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.arrays))

    # -- the registry (any thread) -----------------------------------------------------------
    def add(self, adapter: LoraAdapter) -> None:
        with self._lock:
            self.paths[adapter.name] = adapter.path
            self._keep(adapter.name, self._layout(adapter))

    def drop(self, name: str) -> None:
        with self._lock:
            self.paths.pop(name, None)
            self._host.pop(name, None)

    def _layout(self, adapter: LoraAdapter) -> dict:
        """One slot's host arrays in the device layout (the slot axis left out): A
        [layers, targets, R, in] ([layers, in, targets, R]), B [layers, out, R] ([layers,
        R, out]); native: A as feature-major, B [layers, blocks, R, 16]."""
        out, fm, dt = {}, self.feature_major, self.dtype
        for g, mods in GROUPS.items():
            a = adapter.a[g]  # [layers, in, targets * R]
            a = a.reshape(a.shape[0], a.shape[1], len(mods), -1)
            if self.native:
                out[g] = self.arrays[g].replace(
                    a=np.ascontiguousarray(a.transpose(0, 2, 3, 1), dt),
                    b=pack_lora_b([np.asarray(b, dt) for b in adapter.b[g]]))
                continue
            a = np.ascontiguousarray(a.transpose(0, 2, 3, 1) if fm else a, dt)
            bs = tuple(np.ascontiguousarray(np.swapaxes(b, 1, 2) if fm else b, dt)
                       for b in adapter.b[g])
            out[g] = (a, bs)
        return out

    def _keep(self, name: str, arrays: dict) -> None:
        self._host[name] = arrays
        self._host.move_to_end(name)
        while len(self._host) > self.max_host:
            self._host.popitem(last=False)

    def _host_arrays(self, name: str) -> dict:
        with self._lock:
            if name in self._host:
                self._host.move_to_end(name)
                return self._host[name]
            path = self.paths.get(name)
        if path is None:
            raise KeyError(f"adapter {name!r} is not loaded")
        log.info("adapter %s: reading %s again (host cache holds %d)", name, path,
                 self.max_host)
        arrays = self._layout(load_peft_adapter(path, name, self.config,
                                                max_rank=self.max_rank))
        self.disk_reads += 1
        with self._lock:
            self._keep(name, arrays)
        return arrays

    # -- the device slots (the runner's lock held) ------------------------------------------
    def compile(self) -> None:
        """Compile the slot write and run it once (zeros into slot 0)."""
        if self._write is not None:
            return

        fm = self.feature_major
        # the slot's axis in each array: A (2, 3 row-major), B (2, 1 row-major); native:
        # A 2, B 1
        axes = {g: (grp.replace(a=2, b=1) if isinstance(grp, NativeLora) else
                    (2 if fm else 3, tuple(2 if fm else 1 for _ in grp[1])))
                for g, grp in self.arrays.items()}

        def put(dst, src, axis, slot):
            idx = (slice(None),) * axis + (slot,)
            return dst.at[idx].set(src)

        def write(arrays, slot, new):
            return jax.tree.map(lambda d, s, ax: put(d, s, ax, slot), arrays, new, axes)

        spec = jax.tree.map(lambda x, ax: jax.ShapeDtypeStruct(
            x.shape[:ax] + x.shape[ax + 1:], x.dtype), self.arrays, axes)
        self._write = jax.jit(write, donate_argnums=(0,)).lower(
            self.arrays, jax.ShapeDtypeStruct((), jnp.int32), spec).compile()
        zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), spec)
        self.arrays = self._write(self.arrays, np.int32(0), zeros)

    def load(self, slot: int, name: str) -> None:
        """Copy adapter `name` into device slot `slot`."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"adapter slot {slot} out of range [0, {self.slots})")
        self.compile()
        self.arrays = self._write(self.arrays, np.int32(slot), self._host_arrays(name))
