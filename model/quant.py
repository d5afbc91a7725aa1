"""W8A8: int8 weights per output channel, int8 activations per token, int32 accumulation.

What it is for. On XLA:CPU a matmul of a few token rows is bound by reading the weights:
int8 weights are a quarter of the f32 bytes, and `lax.dot` of two int8 operands with an
int32 result runs as an integer kernel. Measured on this 2-core machine (issue 20), the
30 layers of a 576x3072 matrix: f32 7.7 / 16.9 / 43.3 ms at 1 / 16 / 64 rows, int8 x int8
69.9 / 9.8 / 25.9 ms. So it pays from about 16 rows and loses badly at one: the runner
uses it per compiled shape (`ModelRunner(quantization="w8a8", w8a8_min_rows=...)`),
f32 below the threshold. Weight-only int8 (dequantized inside the step) and bf16 were
measured slower than f32 on this backend: XLA:CPU materialises the conversion.

How. A weight matrix becomes a `QuantizedMatrix`: int8 values and one f32 scale per output
channel (absmax / 127, symmetric). Each matmul quantizes its input per token, the same way
(absmax of the token's features / 127), multiplies in integers and rescales:

    y[t, o] = (sum_i xq[t, i] * wq[i, o]) * sx[t] * sw[o]

Per-token scales make a token's result independent of the rest of the batch, as the f32
path is. Only the four fused projections of each layer (q/k/v, attention output,
gate/up, down) are quantized; embeddings, norms, the lm_head and LoRA deltas stay f32.
Accuracy against the f32 path: `benchmarks/w8a8_accuracy.py` (docs/benchmarks.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")


@struct.dataclass
class QuantizedMatrix:
    """int8 weights `q` (the float matrix's layout, a leading layer axis allowed) and the
    f32 scale of each output channel."""

    q: jax.Array
    scale: jax.Array
    feature_major: bool = struct.field(pytree_node=False, default=False)


def quantize_matrix(w: np.ndarray, *, feature_major: bool) -> QuantizedMatrix:
    """Symmetric per-output-channel int8 of a weight matrix ((out, in) if
    `feature_major`, else (in, out); a leading layer axis is kept)."""
    w = np.asarray(w, np.float32)
    axis = -1 if feature_major else -2  # the input axis, reduced over
    amax = np.max(np.abs(w), axis=axis, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return QuantizedMatrix(jnp.asarray(q), jnp.asarray(np.squeeze(scale, axis)),
                           feature_major)


def linear(x, w, *, feature_major: bool):
    """x times w: `w @ x` feature-major ([in, T] -> [out, T]), else `x @ w`; a
    `QuantizedMatrix` runs W8A8, a float array as it is."""
    if not isinstance(w, QuantizedMatrix):
        return w @ x if feature_major else x @ w
    axis = 0 if feature_major else -1  # x's feature axis: one scale per token
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    sx = jnp.where(amax > 0, amax / 127.0, 1.0)
    xq = jnp.clip(jnp.round(x / sx), -127, 127).astype(jnp.int8)
    if feature_major:
        acc = jax.lax.dot(w.q, xq, preferred_element_type=jnp.int32)  # [out, T]
        return acc.astype(x.dtype) * w.scale[:, None] * sx
    acc = jax.lax.dot(xq, w.q, preferred_element_type=jnp.int32)  # [T, out]
    return acc.astype(x.dtype) * w.scale[None, :] * sx


def quantize_params(params: dict, *, feature_major: bool) -> dict:
    """The runner's device params (`llama.prepare_params`, laid out `feature_major` or
    not) with the four projections of every layer as `QuantizedMatrix`; every other array
    is the same object (shared)."""
    layers = params["layers"]
    fm = feature_major

    def group(g):
        if isinstance(g, tuple):  # per-layer dicts (the CPU's switched MLP)
            return tuple(group(d) for d in g)
        return {k: (quantize_matrix(np.asarray(v), feature_major=fm) if k in PROJECTIONS
                    else v) for k, v in g.items()}

    return {**params, "layers": {name: group(g) for name, g in layers.items()}}


def quantized_bytes(params: dict | None) -> int:
    """Bytes of the int8 weights and their scales (0: none)."""
    if params is None:
        return 0
    nodes = jax.tree.leaves(params["layers"],
                            is_leaf=lambda x: isinstance(x, QuantizedMatrix))
    return sum(m.q.nbytes + m.scale.nbytes for m in nodes if isinstance(m, QuantizedMatrix))
