"""Which int8 scheme (issue 20): the embedded model's forward in numpy (the test oracle's
arithmetic, tests/model/numpy_llama.py), its projections and tied lm_head quantized each
way, on three chat exchanges teacher-forced (~130 positions), against the f32 forward:
top-1 agreement and the logprob difference of the f32 top token. Emulated (rounding
applied to the operands, products in f32), so schemes compare before any kernel is
written. Prints one JSON line; ~2 minutes.

Schemes: weights in 32-value blocks (Q8_0's) or per output channel; activations f32,
bf16, in 32/64-value blocks (Q8_0 x Q8_0, what llama.cpp's CPU path multiplies), or per
token (W8A8).

    .venv/bin/python benchmarks/experiments/int8_schemes.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from model.weights import load_model  # noqa: E402
from tests.model import numpy_llama as nl  # noqa: E402

TEXTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum "
    "and its cafes along the Seine river.",
    "<|im_start|>user\nExplain photosynthesis in two sentences.<|im_end|>\n"
    "<|im_start|>assistant\nPhotosynthesis is the process by which plants use sunlight, "
    "water and carbon dioxide to make glucose and oxygen. It takes place in the "
    "chloroplasts of leaf cells.",
    "<|im_start|>user\nHow do I reverse a list in Python?<|im_end|>\n<|im_start|>assistant\n"
    "You can reverse a list in Python with the reverse() method, which changes the list in "
    "place, or with slicing: my_list[::-1] returns a new reversed list.",
]
SCHEMES = {  # name: (weight blocks, activations)
    "w_block32_x_f32": (32, "f32"),
    "w_block32_x_bf16 (Sluice's kernel)": (32, "bf16"),
    "w_channel_x_f32": (None, "f32"),
    "w_block32_x_block32 (Q8_0 x Q8_0)": (32, 32),
    "w_block32_x_block64": (32, 64),
    "w_channel_x_token (W8A8)": (None, None),
}


def bf16(a: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def blocks(a: np.ndarray, size: int | None) -> np.ndarray:
    """Symmetric int8 of `a` [rows, n] in blocks of `size` along n (None: whole rows)."""
    r, n = a.shape
    b = a.reshape(r, n // (size or n), size or n)
    s = np.abs(b).max(-1, keepdims=True) / 127
    s[s == 0] = 1
    return (np.clip(np.rint(b / s), -127, 127) * s).reshape(r, n).astype(np.float32)


def weights(w: np.ndarray, size, act) -> np.ndarray:  # (in, out): blocks along `in`
    q = blocks(np.asarray(w, np.float32).T, size).T
    return bf16(q) if act == "bf16" else q


def activations(x: np.ndarray, act) -> np.ndarray:
    if act == "f32":
        return x
    return bf16(x) if act == "bf16" else blocks(x, act)


def forward(p, cfg, ids, w_size, act, head):
    t, hd, nh, nkv = len(ids), cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    pos, inv = np.arange(t), nl.inv_frequencies(cfg)
    mask = np.triu(np.full((t, t), -np.inf, np.float32), k=1)
    x = np.asarray(p["embed"], np.float32)[ids]
    a = lambda v: activations(v, act)  # noqa: E731
    for lp in p["layers"]:
        h = a(nl.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps))
        q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
        q = nl.rope(q.reshape(t, nh, hd), pos, inv, "half")
        k = nl.rope(k.reshape(t, nkv, hd), pos, inv, "half")
        k, v = np.repeat(k, nh // nkv, 1), np.repeat(v.reshape(t, nkv, hd), nh // nkv, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        attn = np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), v).reshape(t, -1)
        x = x + a(attn) @ lp["wo"]
        h = a(nl.rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps))
        gate = h @ lp["w_gate"]
        x = x + a(gate / (1 + np.exp(-gate)) * (h @ lp["w_up"])) @ lp["w_down"]
    x = nl.rms_norm(x, p["final_norm"], cfg.rms_norm_eps)
    z = a(x) @ head
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def main() -> int:
    m = load_model("embedded", progress=False)
    cfg, p = m.config, m.params
    seqs = [m.tokenizer.encode(t) for t in TEXTS]
    f32_head = np.asarray(p["embed"], np.float32).T
    ref = [forward(p, cfg, s, None, "f32", f32_head) for s in seqs]
    out = {"positions": sum(len(s) for s in seqs)}
    for name, (w_size, act) in SCHEMES.items():
        q = {**p, "layers": [{**lp, **{k: weights(lp[k], w_size, act) for k in (
            "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}} for lp in p["layers"]]}
        head = weights(f32_head, w_size, act)
        agree, diff = [], []
        for s, r in zip(seqs, ref):
            o = forward(q, cfg, s, w_size, act, head)
            top = r.argmax(-1)
            agree += list(o.argmax(-1) == top)
            diff += list(np.abs(o[np.arange(len(s)), top] - r[np.arange(len(s)), top]))
        d = np.asarray(diff)
        out[name] = {"top1_agreement": round(float(np.mean(agree)), 4),
                     "logprob_diff_mean": round(float(d.mean()), 4),
                     "logprob_diff_max": round(float(d.max()), 4)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
