"""GGUF (llama.cpp) files: dequantize every tensor to the engine's parameter tree.

Architectures: `llama` (Llama 2/3, Mistral, SmolLM2), `qwen2` (q/k/v bias), `qwen3`
(per-head q/k norms) and `gemma3` (sliding and global layers, q/k norms, sandwich norms,
GeGLU, scaled embeddings: the options of model/config.py). Every quantized type gguf's
`dequantize` knows (Q4_0..Q8_0, the K-quants Q2_K..Q6_K, ...) loads as f32 here; the
runner then packs the CPU backend's own formats from that (`quantization`).

Three things differ from the Hugging Face layout and are undone here:
- numpy views of GGUF tensors are (out, in); the engine wants (in, out).
- For `llama` the converter permuted the rows of q and k within each head so that
  llama.cpp's interleaved rope (pairs 2i, 2i+1) works; we undo it to get the half-split
  (NeoX) layout the model code uses. `qwen2` files are stored unpermuted (llama.cpp runs
  NeoX rope for them). Getting this wrong still gives fluent text, so the tests compare
  logits against a numpy reference.
- Tied embeddings: no `output.weight`; the engine then uses embed.T.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from ..base import (LoadedModel, ModelLoadError, check_shape, param_shapes, resolve_dtype,
                    tensor_name, unflatten)
from ..config import ModelConfig, gemma3_options
from ..progress import progress as _progress
from .gguf_reader import open_reader
from .gguf_tokenizer import tokenizer_from_gguf

SUPPORTED = ("llama", "qwen2", "qwen3", "gemma3")
_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
    "wv": "attn_v.weight", "wo": "attn_output.weight", "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
    "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight", "post_mlp_norm": "post_ffw_norm.weight",
}  # fmt: skip
_MODEL_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
                "lm_head": "output.weight"}


def gguf_name(param: str) -> str:
    """Our flat parameter name -> the GGUF tensor name."""
    return tensor_name(param, "blk.{n}.", _LAYER_NAMES, _MODEL_NAMES)


def permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF half-split rows -> llama.cpp interleaved rows (what convert_hf_to_gguf does).

    Within each head, row i of the first half and row i of the second half (a rotary
    pair under half-split rope) become rows 2i and 2i+1.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_from_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute_for_gguf`: rows of (out, in) weights or of a bias."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_gguf(reader, path: Path, tensor_names: set[str]) -> ModelConfig:
    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in SUPPORTED:
        raise ModelLoadError(
            f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED)})"
        )

    def need(key):
        value = field(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: metadata {arch}.{key} is missing")
        return value

    hidden, heads = need("embedding_length"), need("attention.head_count")
    head_dim = field(f"{arch}.attention.key_length", hidden // heads)
    rot = field(f"{arch}.rope.dimension_count", head_dim)
    if rot != head_dim:
        raise ModelLoadError(f"{path}: partial rotary ({rot} of {head_dim} dims) is not supported")
    scaling = field(f"{arch}.rope.scaling.type", "none")
    rope_scaling = None
    if scaling == "linear":  # Gemma 3 4B and up: positions / factor in the global layers
        rope_scaling = {"rope_type": "linear",
                        "factor": float(field(f"{arch}.rope.scaling.factor", 1.0))}
    elif scaling not in ("none", None):
        raise ModelLoadError(f"{path}: rope scaling {scaling!r} is not supported")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = field(f"{arch}.vocab_size") or (len(tokens.data) if tokens else None)
    if vocab is None:
        raise ModelLoadError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens present")
    return _config(
        path,
        name=field("general.name") or path.stem,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=int(heads),
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(field(f"{arch}.context_length", 4096)),
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        rope_scaling=rope_scaling,
        **(_gemma3(field, arch, int(hidden), int(heads), int(need("block_count")))
           if arch == "gemma3" else {"family": arch}),
    )


def _gemma3(field, arch: str, hidden: int, heads: int, layers: int) -> dict:
    """Gemma 3's options, as llama.cpp runs it: the converter already added 1 to every
    norm weight; every sixth layer is global, the others slide over the window with rope
    base 10,000; the 27B (62 layers) scales queries by (hidden / heads) ** -0.5."""
    return gemma3_options(hidden=hidden, layers=layers,
                          window=int(field(f"{arch}.attention.sliding_window", 0) or 0),
                          query_scale=(hidden / heads) ** -0.5 if layers == 62 else 0.0)


def _config(path: Path, **fields) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ValueError as e:  # e.g. heads not a multiple of kv heads
        raise ModelLoadError(f"{path}: {e}") from None


def load_gguf(path: str | Path, progress: bool = True, *, dtype=None) -> LoadedModel:
    from gguf.quants import dequantize

    path = Path(path)
    dt = resolve_dtype(dtype)
    with _progress(progress) as p:
        task = p.add_task(f"read {path.name}", total=None)
        reader = open_reader(path)
        tensors = {t.name: t for t in reader.tensors}
        config = config_from_gguf(reader, path, set(tensors))
        tokenizer = None
        if "tokenizer.ggml.tokens" in reader.fields:
            tokenizer = tokenizer_from_gguf(reader)
            config = _with_special_ids(config, tokenizer)
        rope_scaling = _llama3_rope_scaling(tensors, config, path)
        if rope_scaling is not None:
            config = replace(config, rope_scaling=rope_scaling)
        if tokenizer is not None and config.family == "gemma3":
            tokenizer = tokenizer.with_family_chat("gemma3")
            config = _with_special_ids(config, tokenizer)
        p.update(task, total=1, completed=1)

        shapes = param_shapes(config)
        task = p.add_task("dequantize", total=len(shapes))
        permute = reader.fields["general.architecture"].contents() == "llama"
        flat = {}
        for name, shape in shapes.items():
            tname = gguf_name(name)
            t = tensors.get(tname)
            if t is None:
                raise ModelLoadError(f"{path}: tensor {tname} is missing (needed for {name})")
            try:
                w = dequantize(t.data, t.tensor_type)
            except Exception as e:  # noqa: BLE001
                raise ModelLoadError(
                    f"{path}: tensor {tname} ({t.tensor_type.name}) cannot be dequantized: {e}"
                ) from None
            transpose = len(shape) == 2 and name != "embed"  # file (out, in) -> ours (in, out)
            check_shape(w, shape[::-1] if transpose else shape, path, tname)
            key = name.rsplit(".", 1)[-1]
            if permute and key in ("wq", "bq", "wk", "bk"):
                heads = config.num_heads if key[1] == "q" else config.num_kv_heads
                w = unpermute_from_gguf(w, heads)
            if transpose:
                w = w.T
            # A copy, never a view: an F32 tensor dequantizes to a view of the memory-mapped
            # file, which would keep all of it resident for as long as the weights live.
            flat[name] = np.array(w, dtype=dt, order="C")
            p.advance(task)
    return LoadedModel(config, unflatten(flat, config), tokenizer, str(path))


def _with_special_ids(config: ModelConfig, tok) -> ModelConfig:
    eos = tuple(sorted(tok.eos_token_ids))
    return replace(config, bos_token_id=tok.bos_token_id, eos_token_ids=eos)


def _llama3_rope_scaling(tensors: dict, config: ModelConfig, path: Path) -> dict | None:
    """Llama 3.1+ GGUFs carry rope scaling only as per-frequency factors (`rope_freqs`).

    Every Llama 3.x uses low/high frequency factors 1 and 4 around an original context of
    8192; recompute the factors for the observed maximum and accept them if they match.
    """
    t = tensors.get("rope_freqs.weight")
    if t is None:
        return None
    stored = np.asarray(t.data, np.float64).reshape(-1)
    factor, lo, hi, old = float(stored.max()), 1.0, 4.0, 8192
    inv = 1.0 / config.rope_theta ** (np.arange(0, config.head_dim, 2) / config.head_dim)
    wavelen = 2 * np.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    expected = np.where(wavelen > old / lo, factor, 1.0 / ((1 - smooth) / factor + smooth))
    expected = np.where(wavelen < old / hi, 1.0, expected)
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-3):
        raise ModelLoadError(
            f"{path}: tensor rope_freqs.weight holds a rope scaling this loader does not know"
        )
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": lo, "high_freq_factor": hi,
            "original_max_position_embeddings": old}  # fmt: skip
