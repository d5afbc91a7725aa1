"""The runner's LoRA adapter slots: preallocated device arrays, and the adapters' host copies.

Per fused projection group (`lora.GROUPS`), one stacked array for A and one per target for
B, allocated once at start like the KV pool, layer first so that a layer's slice is
contiguous, and laid out so that `llama._lora_delta` multiplies every slot at once with
two plain matmuls (no transposes in the step):

    A, feature-major  [layers, targets, slots, R, in]   row-major [layers, in, targets, slots, R]
    B (per target)    [layers, out, slots, R]                     [layers, slots, R, out]

On the CPU, where the native kernels build, a group is a `NativeLora` instead: A as
feature-major above, one B for all its targets in blocks of 16 output columns [layers,
slots, blocks, R, 16] (`cpu_kernels.native.pack_lora_b`), multiplied by the CPU
backend's kernel (csrc/lora_delta.cc), which reads each token's own slot only and adds
the delta in place; stored in bf16 when the runner's base weights are int8 (their kernel
rounds activations to bf16 too), else in the runner's dtype.

Loading an adapter into a slot writes its arrays there with a program compiled at
warm-up (the slot is a traced index and the arrays are donated, so a load is a copy in
place, never a compile).
Which adapter goes in which slot is the scheduler's decision (`scheduler/adapters.py`);
the plan says, and `load` does it before the step.

Tensor parallelism (`tp`, model/tp.py): the arrays are shaped for the padded model (an
adapter's padded heads and features are zero rows of A and columns of B) and split as
the weights are. q/k/v and gate/up (split by output columns): A replicated, B by output
columns, each device's share of every target (the native B packed per device, `bounds`
a device's targets); o and down (split by input rows): A by its input features, B
replicated, so each device adds its partial delta x_i A_i B to its partial output before
the psum that follows (linear: no collective of its own). A slot's write is one program
over the mesh, the host arrays laid out as the device arrays are, the slot axis left out.

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
from jax.sharding import PartitionSpec as P

from cpu_kernels.native import LORA_BLOCK, fast, lora_delta, pack_lora_b

from .config import ModelConfig
from .lora import GROUPS, LoraAdapter, group_shapes, load_peft_adapter
from .tp import split_spec as _split

COLUMN_GROUPS = ("qkv", "gate_up")  # split by output columns under TP; "o", "down" by input

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
                 native: bool = False, tp=None) -> None:
        """`config`: the model's own (adapters are read against it); `native`: the CPU
        kernel's layout (`NativeLora`), else the stacked one; `tp`: the runner's
        `TensorParallel` (None: one device)."""
        self.config, self.slots, self.max_rank = config, slots, max_rank
        self.dtype, self.feature_major, self.native = dtype, feature_major, native
        self.tp, self.shards = tp, (tp.n if tp is not None else 1)
        self.max_host = slots + (max_cpu if max_cpu is not None else slots)
        self.shapes = group_shapes(tp.padded_config(config) if tp is not None else config)
        L, R, n = config.num_layers, max_rank, self.shards
        shapes, specs = {}, {}
        for group, mods in GROUPS.items():
            n_in, outs = self.shapes[group]
            t, fm, col = len(mods), feature_major, group in COLUMN_GROUPS
            if native:
                local = [o // n for o in outs] if col else list(outs)
                blocks = sum(-(-o // LORA_BLOCK) for o in local) * (n if col else 1)
                shapes[group] = NativeLora((L, t, slots, R, n_in),
                                           (L, slots, blocks, R, LORA_BLOCK),
                                           tuple(int(v) for v in np.cumsum([0, *local])))
                specs[group] = NativeLora(_split(5, None if col else 4),
                                          _split(5, 2 if col else None), shapes[group].bounds)
                continue
            shapes[group] = ((L, t, slots, R, n_in) if fm else (L, n_in, t, slots, R),
                             tuple((L, o, slots, R) if fm else (L, slots, R, o) for o in outs))
            specs[group] = (_split(5, None if col else (4 if fm else 1)),
                            tuple(_split(4, (1 if fm else 3) if col else None) for _ in outs))
        self.specs = specs if tp is not None else None  # shard_map's in_specs for `arrays`

        def zeros(shape, spec):
            return jnp.zeros(shape, dtype, device=None if tp is None else tp.sharding(spec))

        self.arrays = jax.tree.map(zeros, shapes, specs, is_leaf=_is_shape)
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
        R, out]); native: A as feature-major, B [layers, blocks, R, 16] (with TP, a
        column-split group's B packed per device, the devices' blocks one after another).
        Padded heads and features (TP) get zero rows of A and columns of B."""
        out, fm, dt, n = {}, self.feature_major, self.dtype, self.shards
        for g, mods in GROUPS.items():
            n_in, outs = self.shapes[g]
            a = _pad(adapter.a[g], 1, n_in)  # [layers, in, targets * R]
            a = a.reshape(a.shape[0], a.shape[1], len(mods), -1)
            bs = [np.asarray(_pad(b, 2, o), dt) for b, o in zip(adapter.b[g], outs)]
            if self.native:
                if g in COLUMN_GROUPS and n > 1:  # device i: columns i of every target
                    parts = [np.split(b, n, axis=-1) for b in bs]
                    b = np.concatenate([pack_lora_b([p[i] for p in parts]) for i in range(n)],
                                       axis=-3)
                else:
                    b = pack_lora_b(bs)
                out[g] = self.arrays[g].replace(
                    a=np.ascontiguousarray(a.transpose(0, 2, 3, 1), dt), b=b)
                continue
            a = np.ascontiguousarray(a.transpose(0, 2, 3, 1) if fm else a, dt)
            out[g] = (a, tuple(np.ascontiguousarray(np.swapaxes(b, 1, 2) if fm else b)
                               for b in bs))
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

        tp, shardings = self.tp, {}

        def one(x, ax):  # a slot's array: the slot axis left out, split as the slots are
            sharding = None
            if tp is not None:
                parts = (*x.sharding.spec, *(None,) * (x.ndim - len(x.sharding.spec)))
                sharding = tp.sharding(P(*parts[:ax], *parts[ax + 1:]))
            return jax.ShapeDtypeStruct(x.shape[:ax] + x.shape[ax + 1:], x.dtype,
                                        sharding=sharding)

        spec = jax.tree.map(one, self.arrays, axes)
        slot = jax.ShapeDtypeStruct((), jnp.int32)
        if tp is not None:
            slot = jax.ShapeDtypeStruct((), jnp.int32, sharding=tp.replicated)
            shardings = {"out_shardings": jax.tree.map(lambda x: x.sharding, self.arrays)}
        self._write = jax.jit(write, donate_argnums=(0,), **shardings).lower(
            self.arrays, slot, spec).compile()
        zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), spec)
        self.arrays = self._write(self.arrays, np.int32(0), zeros)

    def load(self, slot: int, name: str) -> None:
        """Copy adapter `name` into device slot `slot`."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"adapter slot {slot} out of range [0, {self.slots})")
        self.compile()
        self.arrays = self._write(self.arrays, np.int32(slot), self._host_arrays(name))


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(v, int) for v in x)


def _pad(x: np.ndarray, axis: int, size: int) -> np.ndarray:
    """x with zeros appended along `axis` up to `size` (padded heads and features)."""
    extra = size - x.shape[axis]
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return np.pad(x, pad)
