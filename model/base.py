"""The types every part of model/ shares, with no imports from the rest of model/.

Loaders, the tokenizer and the dispatcher in `weights.py` all import from here, so
model/ has no import cycle: `base` <- `tokenizer` <- `loaders/*` <- `weights`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from .config import ModelConfig

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


class ModelLoadError(Exception):
    """A model could not be loaded; the message names the file and, if any, the tensor."""


@dataclass
class LoadedModel:
    config: ModelConfig
    params: dict  # the tree described in model/config.py
    tokenizer: "Tokenizer | None"
    source: str
    # (bytes read, bytes stored) where a loader read only part of its source (an orbax
    # checkpoint's shards: model/loaders/orbax_ckpt.py); None: all of it.
    read_bytes: tuple[int, int] | None = None


# ---- the parameter tree ------------------------------------------------------------------


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Flat names ("embed", "layers.3.wq", ...) of every parameter with its shape."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    qd, kd = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, h), "final_norm": (h,)}
    if not config.tie_embeddings:
        shapes["lm_head"] = (h, v)
    layer = {
        "attn_norm": (h,), "wq": (h, qd), "wk": (h, kd), "wv": (h, kd), "wo": (qd, h),
        "mlp_norm": (h,), "w_gate": (h, i), "w_up": (h, i), "w_down": (i, h),
    }  # fmt: skip
    if config.qkv_bias:
        layer |= {"bq": (qd,), "bk": (kd,), "bv": (kd,)}
    if config.qk_norm:
        layer |= {"q_norm": (config.head_dim,), "k_norm": (config.head_dim,)}
    if config.sandwich_norms:
        layer |= {"post_attn_norm": (h,), "post_mlp_norm": (h,)}
    for n in range(config.num_layers):
        shapes |= {f"layers.{n}.{k}": s for k, s in layer.items()}
    return shapes


def unflatten(flat: dict[str, Any], config: ModelConfig) -> dict:
    tree: dict = {"layers": [{} for _ in range(config.num_layers)]}
    for name, value in flat.items():
        if name.startswith("layers."):
            _, n, key = name.split(".", 2)
            tree["layers"][int(n)][key] = value
        else:
            tree[name] = value
    return tree


def flatten(tree: dict) -> Iterator[tuple[str, Any]]:
    for name, value in tree.items():
        if name == "layers":
            for n, layer in enumerate(value):
                for key, v in layer.items():
                    yield f"layers.{n}.{key}", v
        else:
            yield name, value


def tensor_name(param: str, layer_prefix: str, layer_names: dict[str, str],
                model_names: dict[str, str]) -> str:
    """Our flat parameter name -> a checkpoint format's tensor name: a layer's is
    `layer_prefix` (its "{n}" the layer's number) then `layer_names`' for the key, the
    others' `model_names`' (a KeyError for a name the format has no tensor for)."""
    if param.startswith("layers."):
        _, n, key = param.split(".", 2)
        return layer_prefix.format(n=n) + layer_names[key]
    return model_names[param]


def check_shape(array: np.ndarray, expected: tuple[int, ...], file: object, tensor: str) -> None:
    if tuple(array.shape) != tuple(expected):
        raise ModelLoadError(
            f"{file}: tensor {tensor} has shape {tuple(array.shape)}, expected {tuple(expected)}"
        )


_DTYPE_NAMES = {"f32": "float32", "fp32": "float32", "f16": "float16", "fp16": "float16",
                "bf16": "bfloat16"}


def resolve_dtype(dtype=None, *, default: str = "float32") -> np.dtype:
    """A dtype name (or dtype) as a numpy dtype; bfloat16 through ml_dtypes, which JAX
    uses too (numpy has none of its own). None means `default`. "auto" means the serving
    dtype of the platform JAX runs on: bfloat16 on accelerators, float32 on the CPU
    (XLA:CPU runs bf16 matrix-vector work 10-20x slower than f32;
    docs/history/benchmarks-log.md)."""
    if dtype is None:
        dtype = default
    if isinstance(dtype, str):
        if dtype == "auto":
            import jax

            dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        dtype = _DTYPE_NAMES.get(dtype, dtype)
        if dtype == "bfloat16":
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(dtype)
    except TypeError:
        raise ValueError(f"unknown dtype {dtype!r}; expected float32, bfloat16, float16 or "
                         "auto") from None
