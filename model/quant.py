"""int8 weights for the CPU backend: the layers' projections and the lm_head in 32-value
blocks, multiplied by the native kernel (`cpu_kernels/native.py`, csrc/q8_linear.cc).

What it is for. On the CPU a step of a few token rows is bound by reading the weights,
and int8 weights are a quarter of f32's bytes; XLA:CPU cannot use them itself (its int8
dot is slow at few rows, and a dequantization inside the jit is materialised: slower than
f32, docs/history/benchmarks-log.md). The kernel dequantizes each block in registers and multiplies
in bf16 dot products, so a decode step reads 134 MB of weights instead of 538 MB.

How. A weight matrix (out, in) is cut into blocks of 32 input values; each block keeps
one f32 scale (absmax / 127) and 32 int8 values, as llama.cpp's Q8_0 does. Stored as
`Int8Matrix`: uint8 values (q + 128) [layers, out, in] and scales [layers, out, in / 32],
both "packed" (columns in groups of 16, block by block; `out` rounded up to 16 with zero
columns) so the kernel streams them in order and a group's block is one AMX tile
(layout 0, [16 columns][32 values]). Where the kernel's AVX2 path runs, a block is stored
[32 values][16 columns] instead (layout 1: 16 columns of one input value in one load, which
its many-row and few-row forms both read in order; `native_layout`). The activations are
not quantized (rounded to bf16 in the AMX and AVX-512 paths, f32 in AVX2's). Accuracy
against the f32 path: `benchmarks/int8_accuracy.py` (docs/benchmarks.md). Embeddings
(the token lookup), norms and LoRA deltas stay f32.

`quantization = "q4_1"` holds `BlockMatrix`es instead: llama.cpp's Q4_1 (projections) and
Q8_0 (lm_head) blocks, multiplied by integer dot products after the kernel rounds the
activations to int8 (csrc/q4_linear.cc; opt-in, its accuracy in docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")
NATIVE_WEIGHTS = ("int8", "q4_1")  # `quantization` settings served by the native kernels
BLOCK = 32  # input values per scale
GROUP = 16  # output columns packed together


@struct.dataclass
class Int8Matrix:
    """Packed int8 weights of `layers` matrices (out, in) and their block scales; `layer`
    is the one a use multiplies by (set per layer inside the model's scan, so the stacked
    arrays are passed whole and never sliced)."""

    q: jax.Array  # uint8 [layers, out rounded up to GROUP, in]
    scale: jax.Array  # f32 [layers, out rounded up to GROUP, in / BLOCK]
    layer: jax.Array = struct.field(default_factory=lambda: np.zeros((), np.int32))
    out: int = struct.field(pytree_node=False, default=0)  # columns (0: q's)
    layout: int = struct.field(pytree_node=False, default=0)  # a block's order (below)

    @property
    def n(self) -> int:
        return self.out or self.q.shape[1]

    def at_layer(self, i) -> "Int8Matrix":
        return self.replace(layer=i)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


def native_layout() -> int:
    """The block order the native kernel built here packs and reads (the build says so,
    csrc/q8_linear.cc `sluice_q8_layout`): 1 ([32 k][16 columns]) for its AVX2 path, else
    0 ([16 columns][32 k]); 0 where no native build loads."""
    from cpu_kernels import native

    return native.load().sluice_q8_layout() if native.available()[0] else 0


def quantize_int8(w: np.ndarray, layout: int | None = None) -> Int8Matrix:
    """Int8Matrix of f32 matrices `w` [layers, out, in] (in a multiple of 32), its blocks
    in `layout` (None: `native_layout()`). Computed by XLA in one fused pass (numpy's six
    passes over the model took ~3 s of every start-up, and their temporaries 0.3 GB of
    peak memory)."""
    n_l, n, k = np.shape(w)
    if k % BLOCK:
        raise ValueError(f"int8 weights need in % {BLOCK} == 0, not {(n, k)}")
    layout = native_layout() if layout is None else layout
    return Int8Matrix(*_quantize(jnp.asarray(w, jnp.float32), layout), out=n, layout=layout)


def _pad_columns(w, multiple: int):
    """w [layers, out, in] with zero columns (out) up to a multiple of `multiple`."""
    pad = -w.shape[1] % multiple
    return jnp.pad(w, ((0, 0), (0, pad), (0, 0))) if pad else w


@functools.partial(jax.jit, static_argnums=1)
def _quantize(w, layout):
    w = _pad_columns(w, GROUP)
    n_l, n, k = w.shape
    blocks = w.reshape(n_l, n, k // BLOCK, BLOCK)
    scale = jnp.max(jnp.abs(blocks), axis=-1) / 127.0
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    u = (jnp.clip(jnp.round(blocks * inv[..., None]), -127, 127) + 128).astype(jnp.uint8)
    # Packed: [layers, out / 16, in / 32, 16, 32] (layout 1: [..., 32, 16]) and
    # [layers, out / 16, in / 32, 16].
    u = u.reshape(n_l, n // GROUP, GROUP, k // BLOCK, BLOCK).swapaxes(2, 3)
    if layout == 1:
        u = u.swapaxes(3, 4)
    s = scale.reshape(n_l, n // GROUP, GROUP, k // BLOCK).swapaxes(2, 3)
    return u.reshape(n_l, n, k), s.reshape(n_l, n, k // BLOCK)


def dequantize_int8(m: Int8Matrix) -> np.ndarray:
    """The f32 matrices [layers, out, in] an Int8Matrix stands for (tests, accuracy)."""
    q, s = np.asarray(m.q), np.asarray(m.scale)
    n_l, n, k = q.shape
    if m.layout == 1:
        q = q.reshape(n_l, n // GROUP, k // BLOCK, BLOCK, GROUP).swapaxes(3, 4)
    u = q.reshape(n_l, n // GROUP, k // BLOCK, GROUP, BLOCK).swapaxes(2, 3)
    s = s.reshape(n_l, n // GROUP, k // BLOCK, GROUP).swapaxes(2, 3)
    w = (u.astype(np.float32) - 128.0) * s[..., None]
    return w.reshape(n_l, n, k)[:, :m.n]


COLS = 8  # output columns of a BlockMatrix group
Q4_1, Q8_0 = 0, 1  # BlockMatrix formats (the kernel's `format`)
FORMAT_BYTES = {Q4_1: 160, Q8_0: 272}  # a group's block (csrc/q4_linear.cc)


@struct.dataclass
class BlockMatrix:
    """`layers` matrices (out, in) in one of llama.cpp's block formats, per 32 input values
    of an output row: Q4_1 (q in 0..15, an f16 scale d and minimum m; weight = d q + m)
    or Q8_0 (q in -127..127, an f16 scale d; weight = d q), packed for the native kernel
    (csrc/q4_linear.cc has the layout), which multiplies them by the activations
    quantized to int8 as llama.cpp does (Q4_1 x Q8_1, Q8_0 x Q8_0). `layer`: as
    Int8Matrix's; `out`: the columns (the packed ones are rounded up to 8)."""

    q: jax.Array  # uint8 [layers, out / 8, in / 32, FORMAT_BYTES[format]]
    layer: jax.Array = struct.field(default_factory=lambda: np.zeros((), np.int32))
    out: int = struct.field(pytree_node=False, default=0)
    format: int = struct.field(pytree_node=False, default=Q4_1)

    @property
    def n(self) -> int:
        return self.out or self.q.shape[1] * COLS

    def at_layer(self, i) -> "BlockMatrix":
        return self.replace(layer=i)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes


QUANTIZED = (Int8Matrix, BlockMatrix)


def quantize_q4(w: np.ndarray) -> BlockMatrix:
    """Q4_1 BlockMatrix of f32 matrices `w` [layers, out, in] (in a multiple of 32): per
    block, m = its minimum and d = (max - m) / 15, both rounded to f16 as the file format
    stores them, and q = round((w - m) / d) with those rounded values. Weights that were
    read from Q4_1 blocks (the embedded GGUF's projections) come back to exactly their
    blocks: this is how a GGUF's Q4_1 tensors reach the kernel unchanged (the loader hands
    over f32; `tests/model/test_q4.py` checks the round trip)."""
    return _block_matrix(w, Q4_1)


def quantize_q8_0(w: np.ndarray) -> BlockMatrix:
    """Q8_0 BlockMatrix of f32 matrices `w` [layers, out, in]: per block d = max |w| / 127
    rounded to f16, q = round(w / d) (a Q8_0 GGUF tensor's own blocks come back, as
    `quantize_q4`'s do)."""
    return _block_matrix(w, Q8_0)


def _block_matrix(w, fmt: int) -> BlockMatrix:
    n_l, n, k = np.shape(w)
    if k % BLOCK:
        raise ValueError(f"block weights need in % {BLOCK} == 0, not {(n, k)}")
    return BlockMatrix(_quantize_blocks(jnp.asarray(w, jnp.float32), fmt), out=n, format=fmt)


@functools.partial(jax.jit, static_argnums=1)
def _quantize_blocks(w, fmt):
    w = _pad_columns(w, COLS)
    n_l, n, k = w.shape
    kb, ng = k // BLOCK, n // COLS
    blocks = w.reshape(n_l, n, kb, BLOCK)

    def f16_bytes(a):  # [l, n, kb] f16 -> [l, n/8, kb, 16] bytes
        a = a.reshape(n_l, ng, COLS, kb).transpose(0, 1, 3, 2)
        return jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(n_l, ng, kb, 16)

    def inverse(d):
        return jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)

    if fmt == Q8_0:
        d16 = (jnp.abs(blocks).max(-1) / 127.0).astype(jnp.float16)
        q = jnp.clip(jnp.round(blocks * inverse(d16.astype(jnp.float32))[..., None]),
                     -127, 127).astype(jnp.int8)
        # q [l, n, kb, 32] -> [l, n/8, kb, v, c, j]: value 4 v + j of column c at byte
        # 32 v + 4 c + j.
        q = q.reshape(n_l, ng, COLS, kb, 8, 4).transpose(0, 1, 3, 4, 2, 5)
        q = jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(n_l, ng, kb, 256)
        return jnp.concatenate([q, f16_bytes(d16)], axis=-1)
    lo, hi = blocks.min(-1), blocks.max(-1)
    m16 = lo.astype(jnp.float16)
    d16 = ((hi - lo) / 15.0).astype(jnp.float16)
    d, m = d16.astype(jnp.float32), m16.astype(jnp.float32)
    q = jnp.clip(jnp.round((blocks - m[..., None]) * inverse(d)[..., None]), 0, 15)
    # q [l, n, kb, 32] -> [l, n/8, kb, half, v, c, j]: value 16 half + 4 v + j of column c
    # goes to byte 32 v + 4 c + j, low nibble for half 0, high for half 1.
    q = q.astype(jnp.uint8).reshape(n_l, ng, COLS, kb, 2, 4, 4).transpose(0, 1, 3, 4, 5, 2, 6)
    nib = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(n_l, ng, kb, 128)
    return jnp.concatenate([nib, f16_bytes(d16), f16_bytes(m16)], axis=-1)


def blocks(m: BlockMatrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int [layers, out, in], d and m f32 [layers, out, in / 32]) of a BlockMatrix
    (Q8_0: m is zero), the packing's padding columns dropped."""
    p = np.asarray(m.q)
    n_l, ng, kb, _ = p.shape

    def f32(a):  # [l, ng, kb, 16] bytes -> [l, n, kb]
        a = np.ascontiguousarray(a).view(np.float16).astype(np.float32)  # [l, ng, kb, 8]
        return a.transpose(0, 1, 3, 2).reshape(n_l, ng * COLS, kb)[:, :m.n]

    if m.format == Q8_0:
        q = np.ascontiguousarray(p[..., :256]).view(np.int8).reshape(n_l, ng, kb, 8, COLS, 4)
        q = q.transpose(0, 1, 4, 2, 3, 5).reshape(n_l, ng * COLS, kb * BLOCK)
        d = f32(p[..., 256:272])
        return q[:, :m.n], d, np.zeros_like(d)
    nib = p[..., :128].reshape(n_l, ng, kb, 4, COLS, 4)  # [.., v, c, j]
    q = np.stack([nib & 15, nib >> 4], axis=3)  # [.., half, v, c, j]
    q = q.transpose(0, 1, 5, 2, 3, 4, 6).reshape(n_l, ng * COLS, kb * BLOCK)
    return q[:, :m.n], f32(p[..., 128:144]), f32(p[..., 144:160])


def dequantize_blocks(m: BlockMatrix) -> np.ndarray:
    """The f32 matrices [layers, out, in] a BlockMatrix stands for (tests, accuracy)."""
    q, d, mn = blocks(m)
    n_l, n, k = q.shape
    w = q.reshape(n_l, n, k // BLOCK, BLOCK) * d[..., None] + mn[..., None]
    return w.reshape(n_l, n, k).astype(np.float32)


def linear(x, w, *, feature_major: bool):
    """x times w: `w @ x` feature-major ([in, T] -> [out, T]), else `x @ w`. An
    `Int8Matrix` or `BlockMatrix` runs its native kernel (its `layer`), a float array as it
    is."""
    if isinstance(w, BlockMatrix):
        from cpu_kernels.native import q4_linear

        return q4_linear(x, w.q, w.layer, feature_major=feature_major, n=w.n,
                         format=w.format).astype(x.dtype)
    if not isinstance(w, Int8Matrix):
        return w @ x if feature_major else x @ w
    from cpu_kernels.native import q8_linear

    return q8_linear(x, w.q, w.scale, w.layer, feature_major=feature_major,
                     n=w.n, layout=w.layout).astype(x.dtype)


def quantized_bytes(params: dict) -> int:
    """Bytes of the quantized weights (and their scales) in `params` (0: none)."""
    nodes = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QUANTIZED))
    return sum(m.nbytes for m in nodes if isinstance(m, QUANTIZED))
