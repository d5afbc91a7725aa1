"""The formats a runner's device state is kept in: the weights' (f32/bf16, or the CPU's
native int8 / Q4_1 blocks) and the KV pool's (the model's dtype, bf16 stored as uint16 bit
patterns, or int8 rows with an f32 scale). Pure choices from the settings and what the
machine can run; `ModelRunner` calls them once, at construction."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from .quant import NATIVE_WEIGHTS

log = logging.getLogger("sluice.runner")


def weight_format(quantization: str, dtype) -> str:
    """The weights' format a runner of `dtype` serves for `quantization`. int8 weights (model/quant.py): the projections and the lm_head multiplied by the
    CPU backend's native kernel in every shape; their f32 copies are not kept.
    "auto": int8 on the CPU where the kernel builds with a fast path (AMX, AVX-512,
    AVX2), else the weights' dtype. "q4_1": the projections in Q4_1 blocks times int8
    activations (opt-in: the activations' rounding, docs/benchmarks.md). With tensor
    parallelism too: each device multiplies its own packed shards (model/tp.py)."""
    if quantization not in ("auto", "none", *NATIVE_WEIGHTS):
        raise ValueError(f"quantization must be 'auto', 'none', 'int8' or 'q4_1', not "
                         f"{quantization!r}")
    if quantization == "auto":
        quantization = "none"
        if jax.default_backend() == "cpu" and dtype == jnp.float32:
            from cpu_kernels.native import fast

            ok, why = fast()
            if ok:
                quantization = "int8"
            else:
                log.warning("int8 weights unavailable, serving f32: %s", why)
    if quantization in NATIVE_WEIGHTS:
        from cpu_kernels.native import NativeUnavailable, available

        ok, why = available()
        if not ok:
            raise NativeUnavailable(f"quantization {quantization!r} needs the CPU's "
                                    f"native kernels: {why}")
    return quantization


def kv_format(kv_cache_dtype: str, dtype, quantization: str, attention: str | None,
              attention_options: dict) -> tuple:
    """(what the KV pool holds, the array dtype it is stored as). "auto": the model's
    dtype, except beside the native weight formats on the CPU (the native kernels'
    path), where it is int8: each token's row of a KV head rounded over its largest
    magnitude, its f32 scale beside it (`backends.to_pool`), a quarter of f32's bytes
    and a bit more, read by the native kernels only: 1.9x bf16's tokens in the same
    bytes and faster steps, at 0.8 points of top-1 agreement (docs/benchmarks.md, "The
    defaults"). "bfloat16" on the CPU is stored as its bit patterns in uint16: XLA:CPU
    has no native bf16 scatter or gather (a bf16 pool's step ran for minutes), and
    only the native attention kernels read it, widening as they go (its prompt
    attention on the AMX tile unit where the CPU has one)."""
    if kv_cache_dtype not in ("auto", "float32", "bfloat16", "int8"):
        raise ValueError(f"kv_cache_dtype must be 'auto', 'float32', 'bfloat16' or "
                         f"'int8', not {kv_cache_dtype!r}")
    dtype = dtype if kv_cache_dtype == "auto" else jnp.dtype(kv_cache_dtype)
    if (kv_cache_dtype == "auto" and quantization in NATIVE_WEIGHTS
            and attention in (None, "cpu") and attention_options.get("native") is not False):
        dtype = jnp.dtype(jnp.int8)  # native weights mean the native kernels are here
    if dtype == jnp.int8 and jax.default_backend() != "cpu":
        raise ValueError("an int8 KV pool is read by the CPU backend's native kernels "
                         "only; on an accelerator use 'auto' or 'bfloat16'")
    if dtype not in (jnp.bfloat16, jnp.int8) or jax.default_backend() != "cpu":
        return dtype, dtype
    from cpu_kernels.native import available

    ok, why = available()
    # With tensor parallelism too: inside `shard_map` the native kernels read each
    # device's KV-head shard of the pool (a bf16 row, or an int8 row and its scale, is
    # one head's), and their state-free plan is host metadata every device shares.
    if (attention not in (None, "cpu") or not ok
            or attention_options.get("native") is False):
        if kv_cache_dtype == "auto":  # a bf16 model's own pool, read by jnp (slow)
            return dtype, dtype
        raise ValueError(f"a {dtype.name} KV pool on the CPU needs the CPU attention "
                         "backend's native kernels" +
                         ("" if ok else f" (native kernels unavailable: {why})"))
    return dtype, jnp.dtype(jnp.int8 if dtype == jnp.int8 else jnp.uint16)


def weight_layout(feature_major: bool | None, switched_mlp: bool | None,
                  unrolled_layers: bool | None, quantization: str) -> tuple[bool, bool, bool]:
    """How the weights are laid out for this backend (None: the backend's default):
    (feature-major, switched MLP, unrolled layers)."""
    # Feature-major residual stream (weights (out, in), multiplied from the left): faster
    # on XLA:CPU at few rows (model/llama.py, forward); not measured on a GPU yet.
    feature_major = (jax.default_backend() == "cpu" if feature_major is None
                     else feature_major)
    # On the CPU the MLP weights stay per layer, behind a switch: XLA:CPU copies a slice
    # of a stacked weight before its matmul (model/llama.py, _per_layer).
    switched_mlp = (jax.default_backend() == "cpu" if switched_mlp is None
                    else switched_mlp)
    # The layer loop unrolled over per-layer weights: XLA:GPU (jax 0.11.2, H200) copied
    # each layer's slice of a stacked weight before its matmul, half of an 8B decode
    # step (docs/benchmarks.md, "Accelerator (H200)"); it costs compile time.
    unrolled_layers = ((jax.default_backend() == "gpu" if unrolled_layers is None
                        else unrolled_layers) and quantization not in NATIVE_WEIGHTS)
    return feature_major, switched_mlp, unrolled_layers
