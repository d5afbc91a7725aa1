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


def inv_frequencies(config) -> np.ndarray:
    """Rotary frequencies, with Llama 3 long-context scaling when the config asks for it."""
    d = config.head_dim
    inv = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    rs = config.rope_scaling
    if rs:  # transformers' _compute_llama3_parameters
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
    inv = inv_frequencies(config)
    mask = np.triu(np.full((t, t), -np.inf, dtype), k=1)
    x = cast(params["embed"])[ids]
    for lp in params["layers"]:
        h = rms_norm(x, cast(lp["attn_norm"]), config.rms_norm_eps)
        q, k, v = h @ cast(lp["wq"]), h @ cast(lp["wk"]), h @ cast(lp["wv"])
        if config.qkv_bias:
            q, k, v = q + cast(lp["bq"]), k + cast(lp["bk"]), v + cast(lp["bv"])
        q = rope(q.reshape(t, nh, hd), pos, inv, rope_style)
        k = rope(k.reshape(t, nkv, hd), pos, inv, rope_style)
        v = v.reshape(t, nkv, hd)
        group = nh // nkv  # query head j reads kv head j // group
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(t, nh * hd)
        x = x + attn @ cast(lp["wo"])
        h = rms_norm(x, cast(lp["mlp_norm"]), config.rms_norm_eps)
        gate = h @ cast(lp["w_gate"])
        x = x + (gate / (1 + np.exp(-gate)) * (h @ cast(lp["w_up"]))) @ cast(lp["w_down"])
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
