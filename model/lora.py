"""LoRA adapters in the PEFT layout, read and arranged for the runner's adapter slots.

A PEFT adapter is a directory with `adapter_config.json` (`r`, `lora_alpha`,
`target_modules`, `use_rslora`, ...) and `adapter_model.safetensors`, whose tensors are
named `...layers.N.self_attn.q_proj.lora_A.weight` (`[r, in]`) and `...lora_B.weight`
(`[out, r]`). The delta a target projection adds is `scale * B @ A` (torch's (out, in)
layout), `scale = lora_alpha / r` (`/ sqrt(r)` with rsLoRA).

The runner fuses q/k/v and gate/up into one matmul each, so an adapter is arranged in
four groups that follow the fused matmuls. In our (in, out) layout, for each group and
layer: `a` is `[in, targets * R]` (each target's A transposed, zero-padded to the pool's
rank R) and `b` holds one `[R, out]` per target (B transposed, times the scale, padded).
A target the adapter does not train is all zeros. Everything here is host numpy; errors
name the file and the tensor (`AdapterError`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ModelConfig

# group -> the PEFT module names it fuses, in the order of the runner's fused matmul
GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
TARGETS = tuple(m for mods in GROUPS.values() for m in mods)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the file and the tensor."""


def group_shapes(config: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """group -> (input features, output features of each fused target)."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"qkv": (h, (q, kv, kv)), "o": (q, (h,)), "gate_up": (h, (i, i)), "down": (i, (h,))}


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int  # the adapter's own r (<= the pool's rank, which `a`/`b` are padded to)
    scale: float
    targets: tuple[str, ...]
    a: dict[str, np.ndarray]  # group -> [layers, in, targets * R]
    b: dict[str, tuple[np.ndarray, ...]]  # group -> per target [layers, R, out]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.a.values()) + sum(
            x.nbytes for bs in self.b.values() for x in bs)


def load_peft_adapter(path: str | Path, name: str, config: ModelConfig, *,
                      max_rank: int) -> LoraAdapter:
    """Read the adapter at `path` for a base model of `config`, padded to `max_rank`."""
    path = Path(path).expanduser()
    cfg_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not path.is_dir():
        raise AdapterError(f"{path}: no such adapter directory")
    try:
        meta = json.loads(cfg_file.read_text())
    except OSError as e:
        raise AdapterError(f"{cfg_file}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise AdapterError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise AdapterError(f"{cfg_file}: expected a JSON object")
    r = meta.get("r")
    if not isinstance(r, int) or r < 1:
        raise AdapterError(f"{cfg_file}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise AdapterError(f"{cfg_file}: rank r={r} exceeds the pool's max_lora_rank "
                           f"{max_rank}")
    alpha = meta.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)):
        raise AdapterError(f"{cfg_file}: lora_alpha must be a number, got {alpha!r}")
    for key, ok in (("bias", ("none", None)), ("use_dora", (False, None)),
                    ("modules_to_save", (None, []))):
        if meta.get(key) not in ok:
            raise AdapterError(f"{cfg_file}: {key}={meta.get(key)!r} is not supported "
                               "(plain LoRA on the attention and MLP projections is)")
    targets = _targets(meta.get("target_modules"), cfg_file)
    layers = meta.get("layers_to_transform")
    layers = set(range(config.num_layers)) if layers is None else (
        {layers} if isinstance(layers, int) else set(layers))
    # PEFT applies fan_in_fan_out only to Conv1D layers and resets it for nn.Linear ones,
    # which every Llama projection is; so, like PEFT, it changes nothing here.
    scale = alpha / math.sqrt(r) if meta.get("use_rslora") else alpha / r
    tensors = _index(_read(weights_file), weights_file)

    shapes = group_shapes(config)
    a, b = {}, {}
    for group, mods in GROUPS.items():
        n_in, outs = shapes[group]
        a[group] = np.zeros((config.num_layers, n_in, len(mods) * max_rank), np.float32)
        b[group] = tuple(np.zeros((config.num_layers, max_rank, n), np.float32) for n in outs)
        for j, mod in enumerate(mods):
            if mod not in targets:
                continue
            for layer in sorted(layers):
                la = _tensor(tensors, weights_file, layer, mod, "A", (r, n_in))
                lb = _tensor(tensors, weights_file, layer, mod, "B", (outs[j], r))
                a[group][layer, :, j * max_rank:j * max_rank + r] = la.T
                b[group][j][layer, :r] = scale * lb.T
    return LoraAdapter(name, str(path), r, float(scale), tuple(sorted(targets)), a, b)


def _targets(spec, cfg_file: Path) -> set[str]:
    if spec in (None, [], ""):
        raise AdapterError(f"{cfg_file}: target_modules is missing")
    if spec == "all-linear":
        return set(TARGETS)
    if isinstance(spec, str):  # PEFT: a regex matched against the full module name
        found = {m for m in TARGETS if re.fullmatch(spec, f"model.layers.0.x.{m}")
                 or re.fullmatch(spec, m)}
        if not found:
            raise AdapterError(f"{cfg_file}: target_modules {spec!r} matches none of "
                               f"{', '.join(TARGETS)}")
        return found
    names = {str(m).rsplit(".", 1)[-1] for m in spec}
    unknown = sorted(names - set(TARGETS))
    if unknown:
        raise AdapterError(f"{cfg_file}: unknown target module(s) {unknown}; an adapter may "
                           f"train {', '.join(TARGETS)}")
    return names


def _read(f: Path) -> dict[str, np.ndarray]:
    if not f.is_file():
        other = sorted(p.name for p in f.parent.glob("adapter_model.*"))
        hint = f" (found {other}: convert it to safetensors)" if other else ""
        raise AdapterError(f"{f}: missing{hint}")
    from safetensors import safe_open

    try:
        with safe_open(f, framework="np") as st:
            return {k: st.get_tensor(k) for k in st.keys()}
    except Exception as e:  # noqa: BLE001 -- SafetensorError, OSError
        raise AdapterError(f"{f}: not a readable safetensors file ({e})") from None


def _index(tensors: dict[str, np.ndarray], f: Path) -> dict[tuple, tuple[str, np.ndarray]]:
    """(layer, module, "A" | "B") -> (tensor name, array); anything else is an error."""
    out = {}
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise AdapterError(f"{f}: tensor {key} is not a LoRA A or B of "
                               f"{', '.join(TARGETS)}")
        out[(int(m.group(1)), m.group(2), m.group(3))] = (key, value)
    return out


def _tensor(tensors: dict, f: Path, layer: int, mod: str, which: str, shape) -> np.ndarray:
    found = tensors.get((layer, mod, which))
    if found is None:
        sect = "self_attn" if mod in GROUPS["qkv"] + GROUPS["o"] else "mlp"
        raise AdapterError(f"{f}: tensor base_model.model.model.layers.{layer}.{sect}.{mod}."
                           f"lora_{which}.weight is missing")
    key, value = found
    if tuple(value.shape) != tuple(shape):
        raise AdapterError(f"{f}: tensor {key} has shape {tuple(value.shape)}, expected "
                           f"{tuple(shape)} for this base model")
    return np.asarray(value, np.float32)
