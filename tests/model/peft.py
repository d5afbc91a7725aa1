"""LoRA adapters written in the PEFT layout by the tests themselves (numpy + safetensors),
and the merged weights the numpy oracle runs them on. Shares no code with model/lora.py.

    tensors = write_peft(tmp_path / "a", config, rank=8, seed=1)
    logits = numpy_llama.forward(merge(params, tensors), config, ids)

PEFT stores torch's (out, in) layout: `lora_A.weight` is [r, in], `lora_B.weight` is
[out, r], and the trained projection is `W_torch + scale * B @ A`. Our parameter tree keeps
matrices (in, out), so the merged matrix is `W + scale * (B @ A).T`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARAM = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
          "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}


def shapes(config, module: str) -> tuple[int, int]:
    """(in, out) of one projection."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]


def write_peft(path, config, *, rank: int, alpha: float | None = None, targets=ALL,
               rslora: bool = False, seed: int = 0, zero_b: bool = False,
               std: float = 0.2, extra_config: dict | None = None) -> dict:
    """Write an adapter directory; returns {"scale", "A": {(layer, mod): [r, in]}, "B": ...}."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    alpha = 2 * rank if alpha is None else alpha
    out = {"scale": alpha / math.sqrt(rank) if rslora else alpha / rank, "A": {}, "B": {}}
    tensors = {}
    for layer in range(config.num_layers):
        for mod in targets:
            n_in, n_out = shapes(config, mod)
            a = (rng.standard_normal((rank, n_in)) * std).astype(np.float32)
            b = np.zeros((n_out, rank), np.float32) if zero_b else (
                rng.standard_normal((n_out, rank)) * std / rank).astype(np.float32)
            sect = "self_attn" if mod in ALL[:4] else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{sect}.{mod}"
            tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"] = a, b
            out["A"][(layer, mod)], out["B"][(layer, mod)] = a, b
    meta = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
            "use_rslora": rslora, "fan_in_fan_out": False, "bias": "none",
            "task_type": "CAUSAL_LM", "base_model_name_or_path": config.name,
            **(extra_config or {})}
    (path / "adapter_config.json").write_text(json.dumps(meta))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return out


def merge(params: dict, adapter: dict) -> dict:
    """The base parameters with the adapter merged in: W + scale * (B @ A).T."""
    layers = [dict(lp) for lp in params["layers"]]
    for (layer, mod), a in adapter["A"].items():
        b = adapter["B"][(layer, mod)]
        key = _PARAM[mod]
        layers[layer][key] = (np.asarray(layers[layer][key], np.float64)
                              + adapter["scale"] * (b.astype(np.float64) @ a).T
                              ).astype(np.float32)
    return {**params, "layers": layers}
