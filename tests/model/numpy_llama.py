"""An independent Llama-family forward pass in plain numpy: the yardstick for the engine.

Unpaged, unbatched, no KV cache, no JAX, and no code shared with `model/` beyond reading
the parameter tree described in model/config.py (matrices (in, out); q/k in the Hugging
Face half-split rope layout). It is deliberately the textbook computation so that a bug
in the engine's paging, chunking or batching shows up as a logit difference:

    logits = forward(params, config, token_ids)          # [len(token_ids), vocab]
    np.testing.assert_allclose(engine_logits, logits, atol=1e-3)

`rope="interleaved"` rotates consecutive pairs (2i, 2i+1) instead, the llama.cpp
convention for q/k rows as stored in a GGUF file; the loader tests use it to show that
undoing the GGUF permutation and using half-split rope is the same model.
"""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def inv_frequencies(config, local: bool = False) -> np.ndarray:
    """Rotary frequencies, with Llama 3 long-context scaling when the config asks for it
    (`local`: a sliding layer's, Gemma 3's own base and no scaling)."""
    d = config.head_dim
    own = local and config.rope_local_theta
    theta = config.rope_local_theta if own else config.rope_theta
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    rs = None if own else config.rope_scaling
    if rs and rs.get("rope_type") == "linear":  # positions / factor
        inv = inv / rs["factor"]
    elif rs:  # transformers' _compute_llama3_parameters
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * np.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv


def rope(x: np.ndarray, positions: np.ndarray, inv: np.ndarray, style: str) -> np.ndarray:
    """x: [T, heads, head_dim]."""
    ang = positions[:, None].astype(np.float64) * inv[None, :]  # [T, D/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if style == "half":
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = b * cos + a * sin
    return out


def forward(params: dict, config, token_ids, *, rope_style: str = "half",
            dtype=np.float32, last_only: bool = False) -> np.ndarray:  # fmt: skip
    """Logits for every position of one sequence starting at position 0."""
    ids = np.asarray(token_ids)
    t, hd = len(ids), config.head_dim
    nh, nkv = config.num_heads, config.num_kv_heads
    cast = lambda a: np.asarray(a, dtype)  # noqa: E731
    pos = np.arange(t)
    eps = config.rms_norm_eps
    causal = np.triu(np.full((t, t), -np.inf, dtype), k=1)
    # A sliding layer's query i sees keys (i - window, i] (Gemma 3, Mistral).
    window = config.sliding_window
    banded = causal + np.tril(np.full((t, t), -np.inf, dtype), k=-window) if window else causal
    sliding = config.windowed
    scale = config.query_scale or hd ** -0.5
    x = cast(params["embed"])[ids] * dtype(config.embed_scale)
    for n, lp in enumerate(params["layers"]):
        inv = inv_frequencies(config, local=sliding[n])
        mask = banded if sliding[n] else causal
        h = rms_norm(x, cast(lp["attn_norm"]), eps)
        q, k, v = h @ cast(lp["wq"]), h @ cast(lp["wk"]), h @ cast(lp["wv"])
        if config.qkv_bias:
            q, k, v = q + cast(lp["bq"]), k + cast(lp["bk"]), v + cast(lp["bv"])
        q, k, v = q.reshape(t, nh, hd), k.reshape(t, nkv, hd), v.reshape(t, nkv, hd)
        if "q_norm" in lp:  # per-head norms before rope (Qwen3, Gemma 3)
            q, k = rms_norm(q, cast(lp["q_norm"]), eps), rms_norm(k, cast(lp["k_norm"]), eps)
        q, k = rope(q, pos, inv, rope_style), rope(k, pos, inv, rope_style)
        group = nh // nkv  # query head j reads kv head j // group
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        # Plain matmuls per head (np.einsum here ran without BLAS: 16 s at 700 tokens).
        scores = q.transpose(1, 0, 2) @ k.transpose(1, 2, 0) * scale + mask  # [h, q, k]
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        attn = (probs @ v.transpose(1, 0, 2)).transpose(1, 0, 2).reshape(t, nh * hd)
        attn = attn @ cast(lp["wo"])
        if "post_attn_norm" in lp:  # Gemma's sandwich norms
            attn = rms_norm(attn, cast(lp["post_attn_norm"]), eps)
        x = x + attn
        h = rms_norm(x, cast(lp["mlp_norm"]), eps)
        gate = h @ cast(lp["w_gate"])
        if config.activation == "gelu_tanh":
            act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))
        else:
            act = gate / (1 + np.exp(-gate))
        out = (act * (h @ cast(lp["w_up"]))) @ cast(lp["w_down"])
        if "post_mlp_norm" in lp:
            out = rms_norm(out, cast(lp["post_mlp_norm"]), eps)
        x = x + out
    if last_only:
        x = x[-1:]
    x = rms_norm(x, cast(params["final_norm"]), config.rms_norm_eps)
    head = params["embed"].T if config.tie_embeddings else params["lm_head"]
    return x @ cast(head)


def greedy(params: dict, config, prompt_ids, max_new_tokens: int, stop_ids=()) -> list[int]:
    """Greedy continuation, recomputing the whole sequence per token (slow, obviously right)."""
    ids, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        nxt = int(np.argmax(forward(params, config, ids, last_only=True)[-1]))
        if nxt in stop_ids:
            break
        ids.append(nxt)
        out.append(nxt)
    return out
