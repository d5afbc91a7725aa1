"""Model architecture description shared by every loader and the model code.

Parameter tree (what every loader returns, numpy float32 arrays unless noted):

    {
      "embed":      [vocab, hidden],
      "final_norm": [hidden],
      "lm_head":    [hidden, vocab]            # absent when tie_embeddings (embed.T is used)
      "layers": [                              # one dict per layer, num_layers of them
        {
          "attn_norm": [hidden],
          "wq": [hidden, num_heads * head_dim],
          "wk": [hidden, num_kv_heads * head_dim],
          "wv": [hidden, num_kv_heads * head_dim],
          "bq": [num_heads * head_dim], "bk": [...], "bv": [...]   # only when qkv_bias
          "q_norm": [head_dim], "k_norm": [head_dim]               # only when qk_norm
          "post_attn_norm": [hidden], "post_mlp_norm": [hidden]    # only when sandwich_norms
          "wo": [num_heads * head_dim, hidden],
          "mlp_norm": [hidden],
          "w_gate": [hidden, intermediate], "w_up": [hidden, intermediate],
          "w_down": [intermediate, hidden],
        }, ...
      ],
    }

Norm weights multiply as they are (Gemma's checkpoints store w - 1; loaders add the 1).
Matrices are stored (in, out) so the model computes ``x @ w``. q/k follow the Hugging Face
convention: rotary embedding in the half-split ("NeoX") layout. The GGUF loader undoes
llama.cpp's per-head q/k row permutation to get there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 8192
    tie_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Llama 3.x long-context rope scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None for plain rope.
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    # The family options: one model definition (model/llama.py), these switches per family
    # (docs/architecture.md, "Model families").
    family: str = "llama"  # llama, qwen2, qwen3, mistral, gemma3: names, chat defaults
    qk_norm: bool = False  # Qwen3, Gemma 3: RMS norm of each head's q and k before rope
    sandwich_norms: bool = False  # Gemma 3: attention and MLP outputs normed before the add
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden)
    query_scale: float = 0.0  # attention's score scale; 0: head_dim ** -0.5
    # Sliding-window attention: `sliding_window` keys (a query sees itself and the
    # window - 1 before it) in the layers `sliding_layers` (empty: every layer, Mistral);
    # 0: none. Gemma 3 interleaves five sliding layers and one global.
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float = 0.0  # the sliding layers' rope base (Gemma 3: 1e4); 0: same

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}"
            )
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation {self.activation!r} is not one of silu, gelu_tanh")
        object.__setattr__(self, "sliding_layers", tuple(int(i) for i in self.sliding_layers))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def windowed(self) -> tuple[bool, ...]:
        """Per layer: whether it attends over the sliding window only."""
        if not self.sliding_window:
            return (False,) * self.num_layers
        if not self.sliding_layers:
            return (True,) * self.num_layers
        return tuple(i in self.sliding_layers for i in range(self.num_layers))

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for one token over all layers, in float32 bytes (scale for bf16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qd, kd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = 2 * h + h * qd + 2 * h * kd + qd * h + 3 * h * i
        if self.qkv_bias:
            per_layer += qd + 2 * kd
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.sandwich_norms:
            per_layer += 2 * h
        total = v * h + h + self.num_layers * per_layer
        if not self.tie_embeddings:
            total += h * v
        return total

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["sliding_layers"] = list(self.sliding_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["sliding_layers"] = tuple(d.get("sliding_layers", ()))
        return cls(**d)


def gemma3_options(*, hidden: int, layers: int, window: int,
                   sliding_layers: tuple[int, ...] | None = None, query_scale: float = 0.0,
                   rope_local_theta: float = 10000.0) -> dict:
    """The `ModelConfig` fields of a Gemma 3 (besides `qk_norm`, which loaders read from
    the file): sandwich norms, GeGLU, embeddings times sqrt(hidden), and the sliding
    layers (None: five of every six, each sixth global, as Gemma 3 interleaves them)."""
    if sliding_layers is None:
        sliding_layers = tuple(i for i in range(layers) if (i + 1) % 6)
    return {"family": "gemma3", "sandwich_norms": True, "activation": "gelu_tanh",
            "embed_scale": float(hidden) ** 0.5, "query_scale": query_scale,
            "sliding_window": window, "sliding_layers": tuple(sliding_layers) if window else (),
            "rope_local_theta": rope_local_theta}
