"""Model shapes of real checkpoints, for random-initialised weights.

Benchmarks on an accelerator machine cannot download an 8B checkpoint, and the speed of
a step depends only on the shapes, so `random:llama3-8b` gives the real memory traffic
with made-up numbers. `tiny` and `tiny-bias` are for fast tests of model code.
"""

from __future__ import annotations

from .config import ModelConfig, gemma3_options

def _gemma3(name: str, *, vocab: int, hidden: int, inter: int, layers: int, heads: int,
            kv: int, window: int, **kw) -> ModelConfig:
    """A Gemma 3 text model: head_dim 256, five sliding layers to one global, its norms,
    GeGLU and scaled embeddings (the text model of gemma-3-4b-it and up; 270m and 1b)."""
    return ModelConfig(
        name=name, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=256,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_embeddings=True, qk_norm=True,
        bos_token_id=2, eos_token_ids=(1, 106), **kw,
        **gemma3_options(hidden=hidden, layers=layers, window=window,
                         query_scale=256 ** -0.5))


PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
        rms_norm_eps=1e-5, max_position=8192, tie_embeddings=True,
        bos_token_id=1, eos_token_ids=(2, 0),
    ),
    "llama3-8b": ModelConfig(
        name="llama3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rms_norm_eps=1e-5, max_position=8192, bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
    "llama2-7b": ModelConfig(
        name="llama2-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, rope_theta=10000.0,
        rms_norm_eps=1e-5, max_position=4096, bos_token_id=1, eos_token_ids=(2,),
    ),
    "mistral-7b": ModelConfig(  # v0.3 (32768 vocab, rope 1e6, no sliding window)
        name="mistral-7b", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0,
        rms_norm_eps=1e-5, max_position=32768, bos_token_id=1, eos_token_ids=(2,),
    ),
    "qwen2-0.5b": ModelConfig(
        name="qwen2-0.5b", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1000000.0,
        rms_norm_eps=1e-6, max_position=32768, tie_embeddings=True, qkv_bias=True,
        eos_token_ids=(151643, 151645),
    ),
    # The families' real shapes (their checkpoints' config.json; issue 52's test set).
    "llama3.1-8b": ModelConfig(
        name="llama3.1-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rms_norm_eps=1e-5, max_position=131072, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "qwen2.5-7b": ModelConfig(
        name="qwen2.5-7b", family="qwen2", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
        rope_theta=1000000.0, rms_norm_eps=1e-6, max_position=32768, qkv_bias=True,
        eos_token_ids=(151643, 151645),
    ),
    "qwen3-8b": ModelConfig(
        name="qwen3-8b", family="qwen3", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
        rope_theta=1000000.0, rms_norm_eps=1e-6, max_position=40960, qk_norm=True,
        eos_token_ids=(151643, 151645),
    ),
    "mistral-7b-v0.1": ModelConfig(  # every layer slides over 4096 keys
        name="mistral-7b-v0.1", family="mistral", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rope_theta=10000.0, rms_norm_eps=1e-5, max_position=32768, sliding_window=4096,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "gemma3-4b": _gemma3("gemma3-4b", vocab=262208, hidden=2560, inter=10240, layers=34,
                         heads=8, kv=4, window=1024, max_position=131072,
                         rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "gemma3-270m": _gemma3("gemma3-270m", vocab=262144, hidden=640, inter=2048, layers=18,
                           heads=4, kv=1, window=512, max_position=32768),
    # Test models. Vocab 272 = the byte-level tokenizer's 259 ids + reserved specials.
    "tiny": ModelConfig(
        name="tiny", vocab_size=272, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position=2048,
        bos_token_id=1, eos_token_ids=(2, 0),
    ),
    "tiny-bias": ModelConfig(  # the Qwen2 path: q/k/v bias and tied embeddings
        name="tiny-bias", vocab_size=272, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=1, head_dim=16, rope_theta=1000000.0, max_position=2048,
        tie_embeddings=True, qkv_bias=True, bos_token_id=1, eos_token_ids=(2, 0),
    ),
    "tiny-gemma3": ModelConfig(  # Gemma 3's options: 3 sliding layers of 16 keys, 1 global
        name="tiny-gemma3", family="gemma3", vocab_size=272, hidden_size=64,
        intermediate_size=128, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=32,
        rope_theta=1000000.0, rope_local_theta=10000.0, rms_norm_eps=1e-6,
        max_position=2048, tie_embeddings=True, qk_norm=True, sandwich_norms=True,
        activation="gelu_tanh", embed_scale=8.0, sliding_window=16,
        sliding_layers=(0, 1, 2), bos_token_id=1, eos_token_ids=(2, 0),
    ),
}  # fmt: skip


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
