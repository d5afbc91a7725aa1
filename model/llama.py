"""The Llama-family transformer as pure functions over a parameter pytree.

One forward pass serves a whole mixed step: the flat new tokens of every sequence go
through the matmuls together (one weight read serves decode and prefill alike), and only
attention is grouped. Two groups, each a call of the paged attention interface:

- decode group: `dec_seqs` sequences with one query each;
- prefill group: `pf_blocks` query blocks of `block_q` tokens. Each block belongs to one
  sequence and behaves like a sequence of its own whose context ends at the block's last
  token, so any mix of prefill chunks packs into the group (a chunk takes
  ceil(len / block_q) blocks) and one compiled shape serves them all.

Layers are an unrolled Python loop over per-layer arrays, not a `lax.scan` over stacked
weights: on XLA:CPU the scan copied every layer's weights each step (NOTES.md).
The KV pool is a tuple of per-layer (k, v) page arrays that the step writes with a scatter
before attention reads it, so a chunk attends to itself; the caller donates the pool.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels import paged_attention

from .config import ModelConfig


@struct.dataclass
class StepBatch:
    """Device-side inputs of one step (shapes fixed by the bucket)."""

    tokens: jax.Array  # [T] int32, T = dec_seqs + pf_blocks * block_q
    positions: jax.Array  # [T] int32
    slots: jax.Array  # [T] int32: page * page_size + offset to write K/V; padding -> 0
    dec_page_tables: jax.Array  # [dec_seqs, pages_per_seq] int32
    dec_context_lens: jax.Array  # [dec_seqs] int32 (0 for padding)
    dec_shared_pages: jax.Array  # [pages_per_seq] int32: page prefix all decode rows share
    dec_shared_len: jax.Array  # [] int32: its length in tokens (0: none)
    dec_buffered_len: jax.Array  # [] int32: how much of it the prefix copy holds (CPU)
    pf_page_tables: jax.Array  # [pf_blocks, pages_per_seq] int32
    pf_context_lens: jax.Array  # [pf_blocks] int32: position of the block's last token + 1
    pf_query_lens: jax.Array  # [pf_blocks] int32: valid tokens in the block
    pf_shared_pages: jax.Array  # [pages_per_seq] int32: page prefix all prefill blocks share
    pf_shared_len: jax.Array  # [] int32
    pf_buffered_len: jax.Array  # [] int32
    sample_idx: jax.Array  # [sample_rows] int32: which flat tokens' logits to compute


def prepare_params(params: dict, cfg: ModelConfig, dtype, *, feature_major: bool = False
                   ) -> dict:
    """Loader layout -> device layout: fused qkv and gate/up matrices, cast to `dtype`.

    The loader's matrices are (in, out). `feature_major` stores them (out, in), the layout
    `forward(..., feature_major=True)` multiplies from the left (see there)."""
    import numpy as np

    def cast(a, matrix=False):
        a = np.asarray(a)
        return jnp.asarray(np.ascontiguousarray(a.T) if matrix and feature_major else a,
                           dtype=dtype)

    layers = []
    for lp in params["layers"]:
        d = {
            "attn_norm": cast(lp["attn_norm"]),
            "wqkv": cast(np.concatenate([lp["wq"], lp["wk"], lp["wv"]], axis=1), True),
            "wo": cast(lp["wo"], True),
            "mlp_norm": cast(lp["mlp_norm"]),
            "w_gate_up": cast(np.concatenate([lp["w_gate"], lp["w_up"]], axis=1), True),
            "w_down": cast(lp["w_down"], True),
        }
        if cfg.qkv_bias:
            d["bqkv"] = cast(np.concatenate([lp["bq"], lp["bk"], lp["bv"]]))
        layers.append(d)
    out = {
        "embed": cast(params["embed"]),
        "final_norm": cast(params["final_norm"]),
        "layers": layers,
    }
    if not cfg.tie_embeddings:
        out["lm_head"] = cast(params["lm_head"], True)
    return out


def rope_inv_freq(cfg: ModelConfig):
    """Rotary inverse frequencies, with Llama 3 long-context scaling when configured."""
    import numpy as np

    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor = rs["factor"]
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        mid = (wavelen <= old / low) & (wavelen >= old / high)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif rs and rs.get("rope_type", rs.get("type")) == "linear":
        inv = inv / rs["factor"]
    return np.asarray(inv, np.float32)


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


def forward(params, kv, b: StepBatch, prefix=None, *, cfg: ModelConfig, inv_freq,
            dec_seqs: int, pf_blocks: int, block_q: int, page_size: int,
            attention_impl: str, pages_per_block: int,
            dec_rows_per_group: int | None = None,
            pf_rows_per_group: tuple[int, ...] | None = None, feature_major: bool = False):
    """Run one step. Returns (new kv pool, logits [sample_rows, vocab] float32).

    `prefix`: optional per-layer contiguous copies of a shared prefix's keys and values
    (the runner's prefix buffer, `pallas_kernels.reference.gather_prefix`); the step's
    `*_buffered_len` then say how much of it each attention group reads from there.

    `feature_major` (params from `prepare_params(..., feature_major=True)`): the residual
    stream is kept as [hidden, T] and every weight multiplies from the left, (out, in) @
    (in, T). On XLA:CPU that puts the step's few token rows on the matmul kernel's narrow
    side, so a decode step's weight matmuls at 16 rows ran ~18% faster than x @ W (the
    kernel's wide row panel is then filled with weight rows, not 16 tokens). Only the
    small per-layer q/k/v and attention-output tiles are transposed."""
    h_, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    t = b.tokens.shape[0]
    fm = feature_major
    # Feature-major helpers: `lin` multiplies, `rows` takes feature rows [a, b) as [T, n].
    lin = (lambda x, w: w @ x) if fm else (lambda x, w: x @ w)
    rows = (lambda a, lo, hi: a[lo:hi].T) if fm else (lambda a, lo, hi: a[:, lo:hi])
    ax = 0 if fm else -1
    x = params["embed"][b.tokens]  # [T, hidden]
    if fm:
        x = x.T
    ang = b.positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    n_dec = dec_seqs
    page_idx, page_off = b.slots // page_size, b.slots % page_size
    new_kv = []
    for i, (lp, (kc, vc)) in enumerate(zip(params["layers"], kv)):
        shared_kv = None if prefix is None else prefix[i]
        hn = _rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, ax)
        qkv = lin(hn, lp["wqkv"])
        if "bqkv" in lp:
            qkv = qkv + (lp["bqkv"][:, None] if fm else lp["bqkv"])
        q = rows(qkv, 0, h_ * d).reshape(t, h_, d)
        k = rows(qkv, h_ * d, (h_ + kvh) * d).reshape(t, kvh, d)
        v = rows(qkv, (h_ + kvh) * d, (h_ + 2 * kvh) * d).reshape(t, kvh, d)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        # Index the 4-D pool directly: scattering through a flattening reshape made
        # XLA:CPU copy the whole pool per layer at one-token steps (tests/model check it).
        kc = kc.at[page_idx, page_off].set(k.astype(kc.dtype))
        vc = vc.at[page_idx, page_off].set(v.astype(vc.dtype))
        new_kv.append((kc, vc))
        outs = []
        if n_dec:
            qd = q[:n_dec].reshape(n_dec, 1, h_, d)
            od = paged_attention(qd, kc, vc, b.dec_page_tables, b.dec_context_lens,
                                 (b.dec_context_lens > 0).astype(jnp.int32),
                                 b.dec_shared_pages, b.dec_shared_len, shared_kv,
                                 b.dec_buffered_len, impl=attention_impl,
                                 pages_per_block=pages_per_block,
                                 rows_per_group=dec_rows_per_group)
            outs.append(od.reshape(n_dec, h_ * d))
        if pf_blocks:
            qp = q[n_dec:].reshape(pf_blocks, block_q, h_, d)
            op = paged_attention(qp, kc, vc, b.pf_page_tables, b.pf_context_lens,
                                 b.pf_query_lens, b.pf_shared_pages, b.pf_shared_len,
                                 shared_kv, b.pf_buffered_len, impl=attention_impl,
                                 pages_per_block=pages_per_block,
                                 rows_per_group=pf_rows_per_group)
            outs.append(op.reshape(pf_blocks * block_q, h_ * d))
        attn = outs[0] if len(outs) == 1 else jnp.concatenate(outs, 0)
        x = x + lin(attn.T if fm else attn, lp["wo"])
        hn = _rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps, ax)
        gu = lin(hn, lp["w_gate_up"])
        inter = cfg.intermediate_size
        gate, up = (gu[:inter], gu[inter:]) if fm else (gu[:, :inter], gu[:, inter:])
        x = x + lin(jax.nn.silu(gate) * up, lp["w_down"])
    if fm:  # [hidden, S] -> logits [S, vocab]
        hs = _rms_norm(x[:, b.sample_idx], params["final_norm"], cfg.rms_norm_eps, 0)
        logits = (params.get("lm_head", params["embed"]) @ hs).T
    else:
        hs = _rms_norm(x[b.sample_idx], params["final_norm"], cfg.rms_norm_eps)
        if "lm_head" in params:
            logits = hs @ params["lm_head"]
        else:
            logits = jnp.einsum("sh,vh->sv", hs, params["embed"])
    return tuple(new_kv), logits.astype(jnp.float32)
