"""Tensor parallelism inside one replica, with `jax.sharding` (Megatron's split).

A replica on N devices holds every layer split N ways along the mesh axis "tp":
- q/k/v and gate/up by output columns: each device computes its own attention heads and
  its own slice of the MLP's intermediate features;
- o and down by input rows: each device's partial product is summed across the devices
  (one all-reduce after each, the only collectives of a layer);
- the KV pool by KV head: each device reads and writes only its heads' pages, so
  attention needs no communication at all;
- embeddings, norms and the lm_head replicated: every device computes the full-vocab
  logits the sampler reads (the lm_head is 28M of SmolLM2's 135M parameters; split by
  vocab it would need an all-gather of the logits each step).

The step is one SPMD program: `model.llama.forward` runs inside `jax.shard_map` on each
device's shards, with local head counts (`local_config`) and `jax.lax.psum` after o and
down (its `reduce`), so the attention backend (a Pallas kernel on GPU) sees per-device
shapes and needs no change.

Head counts that do not divide by N are padded, not refused: KV heads up to a multiple
of N, and with them the query heads of each group (a padded head's weights are zero, its
o_proj rows too, so it adds exactly 0), and the intermediate size likewise. SmolLM2's
3 KV heads at N = 2 become 4 (12 query heads), so one device does a third more attention
work than it needs; vLLM replicates KV heads instead when N is a multiple of their count.

The CPU's packed weights (model/quant.py: int8, q4_1) are quantized per device, each
shard a valid packed matrix of its local shape (`quantized_placer`): a column shard packs
its own output columns (padded to the format's group inside the shard), a row shard needs
its input rows in whole 32-value blocks, so with `in_multiple` = 32 the intermediate size
is padded to a multiple of 32 N and the KV heads until a device's query features are a
multiple of 32 (zero weights again: they add exactly 0). A block never straddles two
devices, so the quantized values are exactly those one device holds at N = 1. The global
array of a row split is the devices' packed shards side by side: it means nothing
outside `shard_map`, where the native kernels (XLA FFI calls) see one device's shard.
The LoRA slots split the same way (model/adapter_slots.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import ModelConfig
from .quant import QUANTIZED

AXIS = "tp"
# Device-layout leaves split by output features (q/k/v, gate/up) and by input features
# (o, down); every other leaf is replicated.
COLUMN_SPLIT = ("wqkv", "bqkv", "w_gate_up")
ROW_SPLIT = ("wo", "w_down")


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A replica's devices, as a 1-D mesh over the "tp" axis."""

    devices: tuple[Any, ...]
    # Input features of a row-split matrix (o, down) per device are padded to a multiple of
    # this (32 for the native packed weights' blocks; only where N > 1).
    in_multiple: int = 1

    def __post_init__(self) -> None:
        if not self.devices:
            raise ValueError("tensor parallelism needs at least one device")

    @property
    def n(self) -> int:
        return len(self.devices)

    @property
    def mesh(self) -> Mesh:
        return Mesh(np.asarray(self.devices, dtype=object), (AXIS,))

    # -- shapes --------------------------------------------------------------------------
    def padded_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` with KV heads, query heads and the intermediate size padded to
        multiples of N, and (N > 1) each device's query features and intermediate ones
        to multiples of `in_multiple` (unchanged when they divide)."""
        m = self.in_multiple if self.n > 1 else 1
        unit = m // math.gcd(m, cfg.q_per_kv * cfg.head_dim)  # KV heads a device rounds to
        kvh = _round_up(cfg.num_kv_heads, self.n * unit)
        return dataclasses.replace(
            cfg, num_kv_heads=kvh, num_heads=kvh * cfg.q_per_kv,
            intermediate_size=_round_up(cfg.intermediate_size, self.n * m))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """What one device computes: its share of the padded heads and features."""
        p = self.padded_config(cfg)
        return dataclasses.replace(p, num_kv_heads=p.num_kv_heads // self.n,
                                   num_heads=p.num_heads // self.n,
                                   intermediate_size=p.intermediate_size // self.n)

    # -- weights ---------------------------------------------------------------------------
    def pad_params(self, params: dict, cfg: ModelConfig) -> dict:
        """Loader-layout params (model/config.py) with zero heads and features appended
        up to `padded_config`; the same dict when nothing needs padding. One layer at a
        time, so the host never holds two copies of the model."""
        p = self.padded_config(cfg)
        if p == cfg:
            return params
        d = cfg.head_dim
        q_extra = (p.num_heads - cfg.num_heads) * d
        kv_extra = (p.num_kv_heads - cfg.num_kv_heads) * d
        i_extra = p.intermediate_size - cfg.intermediate_size

        def cols(a, extra):  # zero output columns appended (padded heads come last)
            a = np.asarray(a)
            return np.concatenate([a, np.zeros((*a.shape[:-1], extra), a.dtype)], axis=-1)

        def rows(a, extra):  # zero input rows appended
            a = np.asarray(a)
            return np.concatenate([a, np.zeros((extra, *a.shape[1:]), a.dtype)], axis=0)

        layers = []
        for lp in params["layers"]:
            out = dict(lp)
            out["wq"], out["wk"], out["wv"] = (cols(lp["wq"], q_extra), cols(lp["wk"], kv_extra),
                                               cols(lp["wv"], kv_extra))
            if "bq" in lp:
                out["bq"], out["bk"], out["bv"] = (cols(lp["bq"], q_extra),
                                                   cols(lp["bk"], kv_extra),
                                                   cols(lp["bv"], kv_extra))
            out["wo"] = rows(lp["wo"], q_extra)
            out["w_gate"], out["w_up"] = cols(lp["w_gate"], i_extra), cols(lp["w_up"], i_extra)
            out["w_down"] = rows(lp["w_down"], i_extra)
            layers.append(out)
        return {**params, "layers": layers}

    def param_specs(self, params: Any, *, feature_major: bool) -> Any:
        """A PartitionSpec per leaf of `prepare_params`'s device layout."""

        def spec(path, leaf) -> P:
            name = next((k.key for k in reversed(path) if hasattr(k, "key")), "")
            if isinstance(leaf, QUANTIZED):  # a spec per array of the packed matrix
                return jax.tree.map(lambda a: quantized_spec(name, np.ndim(a)), leaf)
            return spec_for(name, len(leaf.shape), feature_major=feature_major)

        return jax.tree_util.tree_map_with_path(
            spec, params, is_leaf=lambda x: isinstance(x, QUANTIZED))

    def placer(self, *, feature_major: bool):
        """`prepare_params(place=...)`: each host tensor goes straight to its shards,
        so no device ever holds the whole model."""

        def place(name: str, host: np.ndarray):
            spec = spec_for(name, host.ndim, feature_major=feature_major)
            # Each device's slice from the host array: a process of a multi-host replica
            # may hold only its own slices (an orbax checkpoint's shards, zero elsewhere).
            host = np.asarray(host)
            return jax.make_array_from_callback(host.shape, self.sharding(spec),
                                                lambda idx: host[idx])

        return place

    def quantized_placer(self):
        """`prepare_params(place_quantized=...)`: `quantize` (model/quant.py) of a
        projection's f32 [layers, out, in] one device's shard at a time (a column split
        by `out`, a row split by `in`), each shard put on its device; the head (and any
        leaf not split) quantized whole and replicated. The matrix's `out` is a shard's."""

        def place(name: str, w: np.ndarray, quantize):
            axis = _QUANT_AXIS.get(name)
            parts = [w] if axis is None or self.n == 1 else np.split(w, self.n, axis=axis)
            mats = [quantize(p) for p in parts]

            def whole(*pieces):
                if np.ndim(pieces[0]) == 0:  # the matrix's `layer`: on the mesh too
                    return jax.device_put(pieces[0], self.replicated)
                host = [np.asarray(p) for p in pieces]
                sharding = self.sharding(quantized_spec(name, host[0].ndim))
                if len(host) == 1:
                    return jax.device_put(host[0], sharding)
                size = host[0].shape[axis]
                shape = list(host[0].shape)
                shape[axis] *= len(host)
                return jax.make_array_from_callback(
                    tuple(shape), sharding, lambda idx: host[(idx[axis].start or 0) // size])

            return jax.tree.map(whole, *mats)

        return place

    kv_spec = P(None, None, AXIS, None)  # [layers * pages, page_size, kv_heads, head_dim]

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())


def spec_for(name: str, ndim: int, *, feature_major: bool) -> P:
    """How the device-layout leaf `name` (stacked [layers, ...] or one layer's; matrices
    (in, out), or (out, in) feature-major) lies on the "tp" axis."""
    if name == "bqkv":  # [..., out]
        return P(*([None] * (ndim - 1)), AXIS)
    out_axis, in_axis = (ndim - 2, ndim - 1) if feature_major else (ndim - 1, ndim - 2)
    if name in COLUMN_SPLIT:
        axis = out_axis
    elif name in ROW_SPLIT:
        axis = in_axis
    else:
        return P()
    parts: list = [None] * ndim
    parts[axis] = AXIS
    return P(*parts)


# The packed matrices' arrays (Int8Matrix q [layers, out, in] and scale [layers, out, in /
# 32], BlockMatrix q [layers, out / 8, in / 32, bytes]): a column split by axis 1, a row
# split by axis 2 (the devices' own packed shards side by side).
_QUANT_AXIS = {**{name: 1 for name in COLUMN_SPLIT}, **{name: 2 for name in ROW_SPLIT}}


def quantized_spec(name: str, ndim: int) -> P:
    axis = _QUANT_AXIS.get(name)
    return split_spec(ndim, axis if axis is not None and axis < ndim else None)


def split_spec(ndim: int, axis: int | None) -> P:
    """The PartitionSpec of an `ndim` array split along `axis` over "tp" (None: replicated)."""
    return P() if axis is None else P(*(AXIS if i == axis else None for i in range(ndim)))


def interleave(parts: Sequence[np.ndarray], shards: int, axis: int = -1) -> np.ndarray:
    """Concatenate `parts` (e.g. q, k, v) along `axis` so that each of `shards` equal
    slices holds its own slice of every part, in order: [q0 k0 v0 | q1 k1 v1 | ...].
    With one shard, a plain concatenation."""
    if shards == 1:
        return np.concatenate(parts, axis=axis)
    split = [np.split(np.asarray(p), shards, axis=axis) for p in parts]
    return np.concatenate([s[i] for i in range(shards) for s in split], axis=axis)
