"""Hugging Face checkpoint directories: config.json + *.safetensors + tokenizer.json.

Covers the families as `transformers` writes them: LlamaForCausalLM (Llama 2/3,
SmolLM2), MistralForCausalLM (its sliding window where set), Qwen2ForCausalLM (q/k/v
bias), Qwen3ForCausalLM (per-head q/k norms) and Gemma 3: Gemma3ForCausalLM (270M, 1B)
and the text model of Gemma3ForConditionalGeneration (4B and up: `text_config`, its
tensors under `language_model.model.` or `model.language_model.`, the vision tower left
unread); sliding and global layers, q/k and sandwich norms, GeGLU; its norms store w - 1,
so 1 is added here to each, as llama.cpp's converter does. Tensors are read with
safetensors' numpy API, one at a time and straight into the target dtype (bf16
checkpoints come back as ml_dtypes.bfloat16, which numpy converts), so peak memory is the
result plus one tensor. q/k are already in the half-split rope layout here; only the
(out, in) -> (in, out) transpose is needed.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..base import LoadedModel, ModelLoadError, check_shape, param_shapes, resolve_dtype
from ..base import tensor_name, unflatten
from ..config import ModelConfig, gemma3_options
from ..progress import progress as _progress
from ..tokenizer import Tokenizer

ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"}
# transformers' Gemma3TextConfig defaults: a multimodal checkpoint's text_config omits them.
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_local_base_freq": 10000.0,
    "max_position_embeddings": 131072, "tie_word_embeddings": True,
}
# Where a checkpoint keeps its decoder: causal LMs under "model.", Gemma 3's multimodal
# checkpoints under either of these (older and newer transformers).
_PREFIXES = ("model.", "language_model.model.", "model.language_model.")
_FAMILY = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
           "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
           "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight", "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
}  # fmt: skip
# Gemma's four norms a layer: its post_attention_layernorm is the attention output's.
_GEMMA_LAYER_NAMES = _LAYER_NAMES | {
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}
_MODEL_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                "lm_head": "lm_head.weight"}


def hf_name(param: str, family: str = "llama", prefix: str = "model.") -> str:
    """Our flat parameter name -> the transformers state-dict key (`prefix`: where the
    checkpoint keeps its decoder)."""
    names = _GEMMA_LAYER_NAMES if family == "gemma3" else _LAYER_NAMES
    name = tensor_name(param, "model.layers.{n}.", names, _MODEL_NAMES)
    return prefix + name[len("model."):] if name.startswith("model.") else name


def config_from_hf(cfg: dict, file: Path) -> ModelConfig:
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch == "Gemma3ForConditionalGeneration":  # its text model, with the ids outside
        ids = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
        cfg = {**_GEMMA3_TEXT_DEFAULTS, **ids, **(cfg.get("text_config") or {}),
               "architectures": [arch], "_name_or_path": cfg.get("_name_or_path")}
    if arch not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ModelLoadError(f"{file}: architecture {arch!r} is not supported (supported: {known})")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):  # fmt: skip
        if not isinstance(cfg.get(key), int):
            raise ModelLoadError(f"{file}: {key} is missing or not an integer")
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{file}: mlp_bias is not supported")
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    max_position = int(cfg.get("max_position_embeddings", 4096))
    family = _FAMILY[arch]
    window = cfg.get("sliding_window") or 0
    options: dict = {"family": family}
    if family == "gemma3":
        options = _gemma3(cfg, file)
    elif window and cfg.get("use_sliding_window", arch == "MistralForCausalLM"):
        # Mistral v0.1 attends over a 4096-token window in every layer; where Qwen2 sets
        # `use_sliding_window`, its layers from `max_window_layers` on slide (transformers'
        # layer_types), or as `layer_types` says.
        layers = cfg["num_hidden_layers"]
        first = int(cfg.get("max_window_layers", 0)) if family == "qwen2" else 0
        kinds = cfg.get("layer_types") or ["sliding_attention" if i >= first
                                           else "full_attention" for i in range(layers)]
        options |= {"sliding_window": int(window), "sliding_layers": tuple(
            i for i, k in enumerate(kinds) if k == "sliding_attention")}
    return ModelConfig(
        name=cfg.get("_name_or_path") or file.parent.name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=max_position,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma3")),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        rope_scaling=_rope_scaling(cfg.get("rope_scaling"), file),
        qk_norm=family in ("qwen3", "gemma3"),
        **options,
    )


def _gemma3(cfg: dict, file: Path) -> dict:
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(cap):
            raise ModelLoadError(f"{file}: {cap} is not supported (Gemma 3 sets none)")
    layers = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % int(cfg.get("sliding_window_pattern", 6)) == 0
        else "sliding_attention" for i in range(layers)]
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu"):
        raise ModelLoadError(f"{file}: hidden_activation {act!r} is not supported")
    return gemma3_options(
        hidden=cfg["hidden_size"], layers=layers, window=int(cfg.get("sliding_window") or 0),
        sliding_layers=tuple(i for i, k in enumerate(kinds) if k == "sliding_attention"),
        query_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        rope_local_theta=float(cfg.get("rope_local_base_freq", 10000.0)))


def _rope_scaling(rs: dict | None, file: Path) -> dict | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        return None
    if kind == "linear":  # Gemma 3 4B and up
        return {"rope_type": "linear", "factor": float(rs["factor"])}
    if kind != "llama3":
        raise ModelLoadError(f"{file}: rope_scaling type {kind!r} is not supported "
                             "(llama3 and linear are)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in rs]
    if missing:
        raise ModelLoadError(f"{file}: rope_scaling lacks {', '.join(missing)}")
    return {"rope_type": "llama3"} | {k: rs[k] for k in keys}


def _index_tensors(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (sharded or not)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():  # sharded: the index says which shard holds each tensor
        try:
            return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index ({e})") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    where: dict[str, Path] = {}
    for f in files:
        with _open(f) as st:
            where.update((k, f) for k in st.keys())
    return where


def _open(f: Path):
    from safetensors import safe_open

    try:
        return safe_open(f, framework="np")
    except Exception as e:  # noqa: BLE001 -- SafetensorError / OSError
        cut = _cut_off_tensor(f)
        if cut:
            raise ModelLoadError(f"{f}: file is truncated: {cut}") from None
        raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None


def _cut_off_tensor(f: Path) -> str | None:
    """Name the first tensor whose bytes lie past the end of a truncated file."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
    except (OSError, ValueError):
        return None
    for name, info in header.items():
        end = 8 + n + info["data_offsets"][1] if name != "__metadata__" else 0
        if end > size:
            return f"tensor {name} needs bytes up to {end:,}, file has {size:,}"
    return None


def load_hf(path: str | Path, progress: bool = True, *, dtype=None) -> LoadedModel:

    path = Path(path)
    dt = resolve_dtype(dtype)
    cfg_file = path / "config.json"
    try:
        config = config_from_hf(json.loads(cfg_file.read_text()), cfg_file)
    except (OSError, ValueError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{cfg_file}: {e}") from None
    tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").is_file() else None
    if tokenizer is not None:
        eos = set(config.eos_token_ids) | tokenizer.eos_token_ids
        bos = config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id
        config = replace(config, bos_token_id=bos, eos_token_ids=tuple(sorted(eos)))
    if tokenizer is not None:
        tokenizer = tokenizer.with_family_chat(config.family)
    where = _index_tensors(path)
    prefix = next((p for p in _PREFIXES if f"{p}embed_tokens.weight" in where), "model.")
    shapes = param_shapes(config)
    flat = {}
    handles = {}
    with _progress(progress) as p:
        task = p.add_task(f"read {path.name}", total=len(shapes))
        for name, shape in shapes.items():
            tname = hf_name(name, config.family, prefix)
            f = where.get(tname)
            if f is None:
                raise ModelLoadError(f"{path}: tensor {tname} is missing (needed for {name})")
            if f not in handles:
                if not f.is_file():
                    raise ModelLoadError(f"{f}: shard is missing (it should hold tensor {tname})")
                handles[f] = _open(f)
            try:
                w = handles[f].get_tensor(tname)
            except Exception as e:  # noqa: BLE001
                raise ModelLoadError(f"{f}: tensor {tname} cannot be read ({e})") from None
            transpose = len(shape) == 2 and name != "embed"  # file (out, in) -> ours (in, out)
            check_shape(w, shape[::-1] if transpose else shape, f, tname)
            if transpose:
                w = w.T
            if config.family == "gemma3" and name.endswith("norm"):
                w = np.asarray(w, np.float32) + 1.0  # Gemma's (1 + w) norms, as ours multiply
            flat[name] = np.ascontiguousarray(w, dtype=dt)
            p.advance(task)
    return LoadedModel(config, unflatten(flat, config), tokenizer, str(path))
