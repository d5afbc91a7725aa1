"""Model shapes of real checkpoints, for random-initialised weights.

Benchmarks on an accelerator machine cannot download an 8B checkpoint, and the speed of
a step depends only on the shapes, so `random:llama3-8b` gives the real memory traffic
with made-up numbers. `tiny` and `tiny-bias` are for fast tests of model code.
"""

from __future__ import annotations

from .config import ModelConfig

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
}  # fmt: skip


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
