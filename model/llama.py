"""The Llama-family transformer as pure functions over a parameter pytree.

One forward pass serves a whole mixed step: the flat new tokens of every sequence go
through the matmuls together (one weight read serves decode and prefill alike), and only
attention is grouped, into two calls of the attention backend per layer:

- decode group: `dec_rows` sequences with one query each;
- prefill group: `pf_blocks` query blocks of `block_q` tokens. Each block belongs to one
  sequence and behaves like a sequence of its own whose context ends at the block's last
  token, so any mix of prefill chunks packs into the group (a chunk takes
  ceil(len / block_q) blocks) and one compiled shape serves them all.

Layers are a `lax.scan`: the compiled step holds one layer's code, attention included,
whatever the depth, so a shape compiles in a second or two and its executable stays small
(unrolled, each of SmolLM2's 30 layers cost ~0.2-0.5 s of compile and ~6 MB of host
memory per shape; docs/history/benchmarks-log.md). Weights are stacked per layer, except on the CPU
the MLP's, kept per layer behind a switch (`_per_layer`). On a GPU every layer's weights
stay per layer and the loop is unrolled: XLA:GPU copied each layer's slice of a stacked
weight before its matmul (an H200 8B decode step: 17.3 ms scanned, 10.3 ms unrolled).
The KV pool is one array for K and one for V, `[layers * pages, page_size, kv_heads,
head_dim]`, carried through the layers and written in place (the caller donates it);
layer l's pages start at row `l * pages`, so attention reads a layer through a page
offset, never a copy.

(About 410 lines: the forward pass, every family's options in it, and `prepare_params`,
which lays out the weights it reads, change together.)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels.backends import to_pool

from .config import ModelConfig
from .quant import PROJECTIONS, QUANTIZED, linear, quantize_int8, quantize_q4, quantize_q8_0
from .tp import interleave


@struct.dataclass
class StepBatch:
    """Device-side inputs of one step (shapes fixed by the bucket)."""

    tokens: jax.Array  # [T] int32, T = dec_rows + pf_blocks * block_q
    positions: jax.Array  # [T] int32
    slots: jax.Array  # [T] int32: page * page_size + offset to write K/V (layer 0's ids)
    sample_idx: jax.Array  # [sample_rows] int32: which flat tokens' logits to compute
    decode: Any  # the attention backend's metadata for the decode group (opaque)
    prefill: Any  # ... and for the prefill group
    lora_slots: jax.Array | None = None  # [T] int32: each token's adapter slot, -1: none
    # [T] int32: the row of the step before's sampled tokens a pending token is (-1: the
    # token is in `tokens`); the runner's compiled step resolves it before `forward`.
    prev_src: jax.Array | None = None
    # [T] int32: the sliding layers' slots where their pages are numbered apart
    # (pallas_kernels/backends.py, `PoolLayout.window_pool`); None: `slots` serve all.
    window_slots: jax.Array | None = None


def prepare_params(params: dict, cfg: ModelConfig, dtype, *, feature_major: bool = False,
                   switched_mlp: bool = False, unrolled: bool = False,
                   quantization: str = "none", shards: int = 1, place=None,
                   place_quantized=None) -> dict:
    """Loader layout -> device layout: q/k/v and gate/up fused, cast to `dtype`, the
    layers' weights in two groups, "attn" and "mlp", each stacked on a leading layer axis
    or (the MLP's, with `switched_mlp`; both groups', with `unrolled`) kept one dict per
    layer (see `_per_layer`; `forward` unrolls its layer loop over per-layer attention
    weights).
    `quantization` "int8": the four projections of every layer and the lm_head become
    `Int8Matrix` (model/quant.py, the CPU's native kernel), stacked, quantized from the
    loader's f32 one tensor at a time: their f32 copies are never made on the device.
    "q4_1": the projections Q4_1 `BlockMatrix`es, the lm_head Q8_0 (x int8 activations).

    The loader's matrices are (in, out). `feature_major` stores them (out, in), the layout
    `forward(..., feature_major=True)` multiplies from the left (see there). Host copies
    are made one tensor at a time, so loading never holds two copies of the model.

    `shards` (tensor parallelism, model/tp.py): the fused q/k/v and gate/up interleave
    their parts so that each of `shards` equal column slices holds its devices' own q, k
    and v heads (gate and up features), as `forward` on that device expects; `place(name,
    host array)` puts each tensor on the device(s) (default: `jnp.asarray`), and
    `place_quantized(name, f32 [layers, out, in], quantize)` each quantized one (default:
    `quantize` it where JAX puts it; tensor parallelism quantizes each device's shard)."""
    put = place or (lambda name, a: jnp.asarray(a))
    put_q = place_quantized or (lambda name, w, quantize: quantize(w))
    quantize, quantize_head = {"int8": (quantize_int8, quantize_int8),
                               "q4_1": (quantize_q4, quantize_q8_0)}.get(quantization, (None,) * 2)

    def matrix(a):
        return np.ascontiguousarray(a.T) if feature_major else a

    groups = {
        "attn": {
            "attn_norm": lambda lp: lp["attn_norm"],
            "wqkv": lambda lp: matrix(interleave([lp["wq"], lp["wk"], lp["wv"]], shards, 1)),
            "wo": lambda lp: matrix(lp["wo"]),
        },
        "mlp": {
            "mlp_norm": lambda lp: lp["mlp_norm"],
            "w_gate_up": lambda lp: matrix(interleave([lp["w_gate"], lp["w_up"]], shards, 1)),
            "w_down": lambda lp: matrix(lp["w_down"]),
        },
    }
    if cfg.qkv_bias:
        groups["attn"]["bqkv"] = lambda lp: interleave([lp["bq"], lp["bk"], lp["bv"]], shards, 0)
    if cfg.qk_norm:  # one weight for every head: the same on each device
        groups["attn"] |= {"q_norm": lambda lp: lp["q_norm"], "k_norm": lambda lp: lp["k_norm"]}
    if cfg.sandwich_norms:
        groups["attn"]["post_attn_norm"] = lambda lp: lp["post_attn_norm"]
        groups["mlp"]["post_mlp_norm"] = lambda lp: lp["post_mlp_norm"]
    layers: dict = {}
    for group, tensors in groups.items():
        if (unrolled or (group == "mlp" and switched_mlp)) and not quantize:
            layers[group] = tuple({name: put(name, np.asarray(get(lp), dtype))
                                   for name, get in tensors.items()} for lp in params["layers"])
            continue
        layers[group] = {}
        for name, get in tensors.items():
            first = np.asarray(get(params["layers"][0]))
            host = np.empty((cfg.num_layers, *first.shape), np.dtype(dtype))
            for i, lp in enumerate(params["layers"]):
                host[i] = get(lp)
            if quantize and name in PROJECTIONS:  # the kernel's (out, in), whatever the layout
                layers[group][name] = put_q(name, host if feature_major
                                            else host.swapaxes(1, 2), quantize)
            else:
                layers[group][name] = put(name, host)
            del host
    # With quantized weights the lm_head is its own int8 matrix and the embedding table
    # serves the lookup only: bf16 there (half of f32's bytes: Gemma 3's 262,144 x 640
    # table is 671 MB in f32; a row's rounding, 2^-9 of each value, is below int8's).
    embed_dtype = jnp.bfloat16 if quantize and np.dtype(dtype) == np.float32 else dtype
    out = {"embed": put("embed", np.asarray(params["embed"], embed_dtype)),
           "final_norm": put("final_norm", np.asarray(params["final_norm"], dtype)),
           "layers": layers}
    if quantize:  # the lm_head (out = vocab, in = hidden); `embed` serves the lookup only
        head = params["embed"] if cfg.tie_embeddings else np.asarray(params["lm_head"]).T
        out["head_int8"] = put_q("head_int8", np.asarray(head, np.float32)[None],
                                 quantize_head)
    elif not cfg.tie_embeddings:
        out["lm_head"] = put("lm_head", np.asarray(matrix(np.asarray(params["lm_head"])), dtype))
    return out


def rope_inv_freq(cfg: ModelConfig, *, local: bool = False):
    """Rotary inverse frequencies, with Llama 3 long-context scaling when configured.
    `local`: the sliding layers' (their own base where `rope_local_theta` is set, and no
    scaling, as Gemma 3 runs them)."""
    d = cfg.head_dim
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta else cfg.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = None if local and cfg.rope_local_theta else cfg.rope_scaling
    # (Scaling dicts without a type are Llama 3's, as checkpoints before its name wrote it.)
    kind = rs and rs.get("rope_type",
                         rs.get("type", "llama3" if "low_freq_factor" in rs else None))
    if kind == "llama3":
        factor = rs["factor"]
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        mid = (wavelen <= old / low) & (wavelen >= old / high)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "linear":
        inv = inv / rs["factor"]
    return np.asarray(inv, np.float32)


def _per_layer(weights, i, fn, *args):
    """`fn(layer i's weights, *args)`. Stacked weights (a dict of [layers, ...] arrays)
    are sliced: one body for every layer, though XLA (CPU and GPU) copies the slice before
    a matmul. Per-layer weights (a tuple of dicts) are indexed by a Python `i` when the
    loop is unrolled (the GPU layout, `prepare_params(unrolled=True)`), else go through a
    switch whose branches multiply by one layer's arrays directly (the CPU's MLP, 75% of
    a layer's bytes, `prepare_params(switched_mlp=True)`: docs/history/benchmarks-log.md
    has the step times and memory of each)."""
    if isinstance(weights, dict):  # quantized weights are told their layer, not sliced
        return fn(jax.tree.map(lambda w: w.at_layer(i) if isinstance(w, QUANTIZED) else w[i],
                               weights, is_leaf=lambda w: isinstance(w, QUANTIZED)), *args)
    if isinstance(i, int):  # an unrolled layer loop: the layer's own arrays
        return fn(weights[i], *args)
    return jax.lax.switch(i, [functools.partial(fn, lp) for lp in weights], *args)


def _lora_delta(x, a, bs, mask, fm: bool):
    """The LoRA delta of one fused projection for every token, under its own slot's
    adapter, as two plain matmuls over every slot at once ("stacked mask").

    Layer slices of `model/adapter_slots.py`'s arrays: a is [targets * S * R, in] (row
    j * S * R + s * R + r: target j, slot s; [in, targets * S * R] row-major); bs holds
    one [out, S * R] per target ([S * R, out]); mask is [S, T] ([T, S]): 1 where token t
    runs under slot s. Returns [sum(out), T] ([T, sum(out)])."""
    n = len(bs)
    if fm:
        s_, t = mask.shape
        h = a @ x  # [targets * S * R, T]
        r = h.shape[0] // (n * s_)
        h = (h.reshape(n, s_, r, t) * mask[None, :, None, :]).reshape(n, s_ * r, t)
        return jnp.concatenate([bj @ h[j] for j, bj in enumerate(bs)], axis=0)
    t, s_ = mask.shape
    h = x @ a  # [T, targets * S * R]
    r = h.shape[1] // (n * s_)
    h = (h.reshape(t, n, s_, r) * mask[:, None, :, None]).reshape(t, n, s_ * r)
    return jnp.concatenate([h[:, j] @ bj for j, bj in enumerate(bs)], axis=-1)


def _rms_norm(x, w, eps, axis=-1):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=axis, keepdims=True) + eps)
    w = w.astype(jnp.float32)
    return (xf * (w if axis == -1 else w[:, None])).astype(x.dtype)


def _rope(x, cos, sin):
    """Half-split ("NeoX") rotary embedding. x [T, heads, D]; cos/sin [T, 1, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    xf1, xf2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    return jnp.concatenate([xf1 * cos - xf2 * sin, xf2 * cos + xf1 * sin], -1).astype(x.dtype)


def forward(params, kv, b: StepBatch, attn_state=None, lora=None, *, cfg: ModelConfig,
            inv_freq, attention, dec_rows: int, pf_blocks: int, block_q: int,
            feature_major: bool = False, reduce=None):
    """Run one step. Returns (new kv pool, logits [sample_rows, vocab] float32, the last
    layer's residual stream for every token: `head_logits` scores prompt tokens from it).

    `attention` is an `AttentionBackend` (pallas_kernels); `b.decode`/`b.prefill` carry
    its metadata and `attn_state` whatever device state it keeps across steps.

    `lora`: the runner's LoRA adapter slots (`lora_slots` below), or None. Each token adds
    the delta of the adapter in its slot (`b.lora_slots`) to the four fused projections:
    every slot's A and B are applied to every token and masked by the token's slot (the
    "stacked mask" form: one compiled shape for any mix of adapters, at S x the LoRA
    FLOPs, small beside the base matmuls for a few slots of rank 16), and a step with no
    adapter token skips it all (a `cond`). On the CPU the slots may come in a native
    kernel's form instead, which applies each token's own slot only (`NativeLora`).

    `feature_major` (params from `prepare_params(..., feature_major=True)`): the residual
    stream is kept as [hidden, T] and every weight multiplies from the left, (out, in) @
    (in, T). On XLA:CPU that puts the step's few token rows on the matmul kernel's narrow
    side (a decode step's weight matmuls at 16 rows ran ~18% faster than x @ W). Only the
    small per-layer q/k/v and attention-output tiles are transposed.

    `reduce` (tensor parallelism, model/tp.py): run on one device's shards (`cfg` with
    its local head counts), the o and down projections' partial products go through
    `reduce` (a psum across the devices) before joining the residual stream."""
    h_, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    total = reduce or (lambda y: y)
    t = b.tokens.shape[0]
    fm = feature_major
    # Feature-major helpers: `lin` multiplies, `rows` takes feature rows [a, b) as [T, n].
    lin = functools.partial(linear, feature_major=fm)  # quantized: the native kernels
    rows = (lambda a, lo, hi: a[lo:hi].T) if fm else (lambda a, lo, hi: a[:, lo:hi])
    ax = 0 if fm else -1
    # A bucket's padding rows (slot 0: the null page) stay exactly zero through every
    # layer (their embedding and their attention output are zeroed; the norms, the
    # projections without bias and the MLP keep a zero row at zero), so a kernel may skip
    # them: the CPU's native int8 kernel multiplies only rows that are not all zero.
    real = (b.slots != 0)[:, None]
    dtype = params["final_norm"].dtype  # the model's (the table may be narrower)
    x = jnp.where(real, params["embed"][b.tokens].astype(dtype), 0)  # [T, hidden]
    if cfg.embed_scale != 1.0:
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    if fm:
        x = x.T

    def rotations(inv):  # cos, sin [T, 1, D/2] of each token's position
        ang = b.positions.astype(jnp.float32)[:, None] * jnp.asarray(inv)[None, :]
        return jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]

    # Sliding-window layers (model/config.py): which layers, and their own rope base.
    windowed = cfg.windowed
    win_flags = jnp.asarray(windowed)
    rot = rotations(inv_freq)
    local_rot = (rotations(rope_inv_freq(cfg, local=True))
                 if cfg.rope_local_theta and any(windowed) else rot)
    page_size = kv[0].shape[1]
    page_idx, page_off = b.slots // page_size, b.slots % page_size
    # (a sliding layer's page where its pages are its own; offsets within a page agree)
    win_idx = None if b.window_slots is None else b.window_slots // page_size

    native_lora = lora is not None and not isinstance(lora["o"], tuple)
    if lora is not None and not native_lora:  # which slot's delta each token takes
        n_slots = lora["o"][1][0].shape[2 if fm else 1]
        mask = (b.lora_slots[:, None] == jnp.arange(n_slots)[None, :]).astype(x.dtype)
        mask = mask.T if fm else mask
        any_adapter = (b.lora_slots >= 0).any()

    def adapted(y, x, group, i):  # y + the LoRA delta of x for one fused projection
        if lora is None:
            return y
        if native_lora:  # a kernel's own form (model/adapter_slots.py, NativeLora)
            return lora[group].apply(y, x, b.lora_slots, i, feature_major=fm)

        def delta(y, x):  # layer i's slices, taken only when some token needs them
            a, bs = lora[group]
            a = a[i].reshape(-1, a.shape[-1]) if fm else a[i].reshape(a.shape[1], -1)
            bs = [(bj[i].reshape(bj.shape[1], -1) if fm else bj[i].reshape(-1, bj.shape[-1]))
                  for bj in bs]
            return y + _lora_delta(x, a, bs, mask, fm)

        return jax.lax.cond(any_adapter, delta, lambda y, x: y, y, x)

    def attn_in(lp, x, i):  # the layer's input norm and fused q/k/v projection
        hn = _rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, ax)
        qkv = lin(hn, lp["wqkv"])
        if "bqkv" in lp:
            qkv = qkv + (lp["bqkv"][:, None] if fm else lp["bqkv"])
        return adapted(qkv, hn, "qkv", i)

    def attn_out(lp, x, attn, i):  # attention's output projection, added to the residual
        y = total(adapted(lin(attn, lp["wo"]), attn, "o", i))
        if "post_attn_norm" in lp:  # Gemma's sandwich: the output normed before the add
            y = _rms_norm(y, lp["post_attn_norm"], cfg.rms_norm_eps, ax)
        return x + y

    def qk_norms(lp):
        return lp["q_norm"], lp["k_norm"]

    gelu = cfg.activation == "gelu_tanh"

    def mlp(lp, x, i):  # norm, gate/up, SiLU (GELU), down, added to the residual
        hn = _rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps, ax)
        gu = adapted(lin(hn, lp["w_gate_up"]), hn, "gate_up", i)
        inter = cfg.intermediate_size
        gate, up = (gu[:inter], gu[inter:]) if fm else (gu[:, :inter], gu[:, inter:])
        act = (jax.nn.gelu(gate, approximate=True) if gelu else jax.nn.silu(gate)) * up
        y = total(adapted(lin(act, lp["w_down"]), act, "down", i))
        if "post_mlp_norm" in lp:
            y = _rms_norm(y, lp["post_mlp_norm"], cfg.rms_norm_eps, ax)
        return x + y

    weights = params["layers"]

    def layer(carry, i):
        x, k_pool, v_pool = carry
        qkv = _per_layer(weights["attn"], i, attn_in, x, i)
        q = rows(qkv, 0, h_ * d).reshape(t, h_, d)
        k = rows(qkv, h_ * d, (h_ + kvh) * d).reshape(t, kvh, d)
        v = rows(qkv, (h_ + kvh) * d, (h_ + 2 * kvh) * d).reshape(t, kvh, d)
        if cfg.qk_norm:  # each head's q and k normed over head_dim (Qwen3, Gemma 3)
            qn, kn = _per_layer(weights["attn"], i, qk_norms)
            q, k = _rms_norm(q, qn, cfg.rms_norm_eps), _rms_norm(k, kn, cfg.rms_norm_eps)
        # A Python bool in an unrolled loop, else traced: the layer's window and rope.
        win = windowed[i] if isinstance(i, int) else win_flags[i]
        if local_rot is rot:
            cos, sin = rot
        elif isinstance(win, bool):
            cos, sin = local_rot if win else rot
        else:
            cos, sin = (jnp.where(win, loc, glob) for loc, glob in zip(local_rot, rot))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if cfg.query_scale:  # the backends scale scores by head_dim ** -0.5
            q = q * jnp.asarray(cfg.query_scale * d ** 0.5, q.dtype)
        # Index the 4-D pool directly (page row, offset), and read it 4-D too: a one-token
        # write is a dynamic-update-slice, and beside a reshaped view of the pool XLA:CPU
        # copied the whole pool per layer to serve both (tests/model check the HLO).
        if win_idx is None:
            at = page_idx
        elif isinstance(win, bool):
            at = win_idx if win else page_idx
        else:
            at = jnp.where(win, win_idx, page_idx)
        at = at + attention.page_offset(i)
        k_pool = k_pool.at[at, page_off].set(to_pool(k, k_pool.dtype), mode="promise_in_bounds")
        v_pool = v_pool.at[at, page_off].set(to_pool(v, v_pool.dtype), mode="promise_in_bounds")
        outs = []
        if dec_rows:
            qd = q[:dec_rows].reshape(dec_rows, 1, h_, d)
            od = attention.attend_layer(qd, k_pool, v_pool, i, b.decode, attn_state, win)
            outs.append(od.reshape(dec_rows, h_ * d))
        if pf_blocks:
            qp = q[dec_rows:].reshape(pf_blocks, block_q, h_, d)
            op = attention.attend_layer(qp, k_pool, v_pool, i, b.prefill, attn_state, win)
            outs.append(op.reshape(pf_blocks * block_q, h_ * d))
        attn = outs[0] if len(outs) == 1 else jnp.concatenate(outs, 0)
        attn = jnp.where(real, attn, 0)  # (whatever a backend gives a padding row)
        x = _per_layer(weights["attn"], i, attn_out, x, attn.T if fm else attn, i)
        x = _per_layer(weights["mlp"], i, mlp, x, i)
        return (x, k_pool, v_pool), None

    if isinstance(weights["attn"], tuple):  # per-layer weights: the loop unrolled
        carry = (x, *kv)
        for i in range(cfg.num_layers):
            carry, _ = layer(carry, i)
        x, k_pool, v_pool = carry
    else:
        (x, k_pool, v_pool), _ = jax.lax.scan(
            layer, (x, *kv), jnp.arange(cfg.num_layers, dtype=jnp.int32))
    return (k_pool, v_pool), head_logits(params, x, b.sample_idx, cfg=cfg, feature_major=fm), x


def head_logits(params, x, rows=None, *, cfg: ModelConfig, feature_major: bool = False):
    """Final norm and lm_head: logits [S, vocab] float32 of the tokens `rows` of the last
    layer's residual stream `x` ([T, hidden], or [hidden, T] feature-major; None: all;
    a row -1 takes a zero row, which the native kernel skips, and its logits are junk)."""
    if rows is not None:
        x = (jnp.where((rows >= 0)[None, :], x[:, rows], 0) if feature_major
             else jnp.where((rows >= 0)[:, None], x[rows], 0))
    if "head_int8" in params:  # the native kernel (model/quant.py)
        hs = _rms_norm(x, params["final_norm"], cfg.rms_norm_eps, 0 if feature_major else -1)
        logits = linear(hs, params["head_int8"], feature_major=feature_major)
        logits = logits.T if feature_major else logits
    elif feature_major:  # [hidden, S] -> logits [S, vocab]
        hs = _rms_norm(x, params["final_norm"], cfg.rms_norm_eps, 0)
        logits = (params.get("lm_head", params["embed"]) @ hs).T
    else:
        hs = _rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
        if "lm_head" in params:
            logits = hs @ params["lm_head"]
        else:
            logits = jnp.einsum("sh,vh->sv", hs, params["embed"])
    return logits.astype(jnp.float32)
