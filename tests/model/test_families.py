"""The model families on random weights of their real configs: Llama 3.1 (llama3 rope
scaling), Qwen2.5 (q/k/v bias), Qwen3 (q/k norms), Mistral v0.1 (every layer slides) and
Gemma 3 (five sliding layers to one global, q/k and sandwich norms, GeGLU, scaled
embeddings, two rope bases, linear rope scaling).

Each config is scaled down to fit a 2-core CI machine (`shrunk`: widths and heads by a
factor, head_dim, the head ratio and every family option kept; vocab 512; two layers, or
six for Gemma 3 to hold a global layer; the window 24 keys so a 45-token prompt crosses
it). Against the independent numpy forward (tests/model/numpy_llama.py): one prefill in
chunks, decode steps, and the same sequence batched beside another equal to it alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from model.config import ModelConfig
from model.presets import PRESETS
from model.runner import ModelRunner
from model.weights import init_random_params
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan
from tests.model import numpy_llama
from model.bench import window_table

FAMILIES = {"llama3.1-8b": 8, "qwen2.5-7b": 4, "qwen3-8b": 8, "mistral-7b-v0.1": 8,
            "gemma3-4b": 4}
WINDOW = 24


def shrunk(cfg: ModelConfig, factor: int) -> ModelConfig:
    """The config with its widths divided by `factor` and everything else kept."""
    kv = max(1, cfg.num_kv_heads // factor)
    layers = 6 if cfg.sliding_layers else 2
    return dataclasses.replace(
        cfg, name=cfg.name + "-shrunk", vocab_size=512, num_layers=layers,
        num_kv_heads=kv, num_heads=kv * cfg.q_per_kv,
        hidden_size=cfg.hidden_size // factor, intermediate_size=cfg.intermediate_size // factor,
        max_position=512, sliding_window=WINDOW if cfg.sliding_window else 0,
        sliding_layers=tuple(i for i in cfg.sliding_layers if i < layers),
        embed_scale=(cfg.hidden_size // factor) ** 0.5 if cfg.embed_scale != 1 else 1.0,
        bos_token_id=None, eos_token_ids=(1,))


def chunk(runner, seq, toks, start, pages, sample=True):
    return SeqChunk(seq_id=seq, token_ids=list(toks), start_pos=start, page_table=pages,
                    sample=sample, sampling=SamplingParams(temperature=0.0),
                    window_table=window_table(runner, seq, start, start + len(toks)))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    cfg = shrunk(PRESETS[request.param], FAMILIES[request.param])
    params = init_random_params(cfg, seed=7)
    # (Gemma's sliding layers on pages of their own: a ring of 10 for each of 4 sequences)
    runner = ModelRunner(cfg, params, page_size=8, num_pages=48, max_context=256,
                         decode_buckets=(2,), prefill_buckets=(32,),
                         mixed_decode_buckets=(2,), block_q=8, max_prefill_seqs=2,
                         window_pool=48)
    runner.warmup()
    return cfg, params, runner


def test_each_family_keeps_its_options_when_shrunk():
    for name, factor in FAMILIES.items():
        real, small = PRESETS[name], shrunk(PRESETS[name], factor)
        assert small.head_dim == real.head_dim and small.q_per_kv == real.q_per_kv
        for option in ("family", "qkv_bias", "qk_norm", "sandwich_norms", "activation",
                       "rope_theta", "rope_local_theta", "rope_scaling", "query_scale",
                       "tie_embeddings"):
            assert getattr(small, option) == getattr(real, option), (name, option)
        assert bool(small.sliding_window) == bool(real.sliding_window)
    gemma = shrunk(PRESETS["gemma3-4b"], 4)
    assert gemma.windowed == (True,) * 5 + (False,)


def test_prefill_and_decode_match_the_numpy_forward(family):
    """A 45-token prompt (past the window) in two chunks, then four decode steps: each
    step's logits within 1e-3 of the numpy forward over the whole sequence."""
    cfg, params, runner = family
    toks = np.random.default_rng(1).integers(3, cfg.vocab_size, 45).tolist()
    pages = [5, 17, 2, 30, 11, 8, 40, 23]
    runner.step(StepPlan([chunk(runner, 0, toks[:32], 0, pages, sample=False)]))
    res = runner.step(StepPlan([chunk(runner, 0, toks[32:], 32, pages)]), return_logits=True)
    ids = list(toks)
    for step in range(5):
        want = numpy_llama.forward(params, cfg, ids, last_only=True)[-1]
        np.testing.assert_allclose(res.logits[0], want, atol=1e-3, err_msg=f"step {step}")
        if step == 4:
            break
        ids.append(res.sampled[0].token_id)
        res = runner.step(StepPlan([chunk(runner, 0, ids[-1:], len(ids) - 1, pages)]),
                          return_logits=True)


def test_batched_equals_alone(family):
    """Two sequences decoding in one step, one of them past the window, and a prompt
    prefilled beside a decode row: each gets the logits and tokens it gets alone."""
    cfg, params, runner = family
    rng = np.random.default_rng(2)
    a, b = rng.integers(3, cfg.vocab_size, 40).tolist(), rng.integers(3, cfg.vocab_size, 9)
    pa, pb, pc = [3, 9, 14, 20, 26, 33, 38], [4, 10], [6, 12, 15, 21, 27, 34, 39]
    runner.step(StepPlan([chunk(runner, 0, a[:32], 0, pa, sample=False)]))
    alone_a = runner.step(StepPlan([chunk(runner, 0, a[32:], 32, pa)]), return_logits=True)
    alone_b = runner.step(StepPlan([chunk(runner, 1, b, 0, pb)]), return_logits=True)
    # The same prompt on other pages beside the first sequence's decode row.
    runner.step(StepPlan([chunk(runner, 2, a[:32], 0, pc, sample=False)]))
    t = alone_a.sampled[0].token_id
    both = runner.step(StepPlan([chunk(runner, 0, [t], 40, pa),
                                 chunk(runner, 2, a[32:], 32, pc)]), return_logits=True)
    np.testing.assert_allclose(both.logits[2], alone_a.logits[0], atol=1e-4)
    assert both.sampled[2].token_id == t
    dec_a = runner.step(StepPlan([chunk(runner, 2, [t], 40, pc),
                                  chunk(runner, 1, [alone_b.sampled[1].token_id], 9, pb)]),
                        return_logits=True)
    np.testing.assert_allclose(dec_a.logits[2], both.logits[0], atol=1e-4)
    lone_b = runner.step(StepPlan([chunk(runner, 3, b, 0, [7, 13])]), return_logits=True)
    np.testing.assert_allclose(lone_b.logits[3], alone_b.logits[1], atol=1e-4)


# ---- the loaders read each family's files ----------------------------------------------


OPTIONS = ("family", "qkv_bias", "qk_norm", "sandwich_norms", "activation", "embed_scale",
           "query_scale", "sliding_window", "sliding_layers", "rope_local_theta",
           "tie_embeddings", "head_dim", "num_kv_heads", "rope_scaling")


@pytest.mark.parametrize("name, arch", [
    ("qwen3-8b", "Qwen3ForCausalLM"), ("gemma3-4b", "Gemma3ForCausalLM"),
    ("gemma3-4b", "Gemma3ForConditionalGeneration")])
def test_hugging_face_checkpoints_of_each_family_load(tmp_path, name, arch):
    """config.json and safetensors as transformers writes them (Gemma's norms as w - 1;
    the multimodal Gemma 3's text model under `language_model.model.`, its config in
    `text_config` with transformers' defaults left out, a vision tensor beside it)."""
    import json

    from safetensors.numpy import save_file

    from model.weights import load_model
    from tests.model.test_loaders import assert_same_params, hf_state_dict, write_hf

    cfg = shrunk(PRESETS[name], FAMILIES[name])
    params = init_random_params(cfg, seed=5)
    extra = {"head_dim": cfg.head_dim, "sliding_window": cfg.sliding_window or None}
    if cfg.family == "gemma3":
        extra |= {"query_pre_attn_scalar": 256, "rope_local_base_freq": 10000.0,
                  "layer_types": ["sliding_attention" if w else "full_attention"
                                  for w in cfg.windowed],
                  "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                  "hidden_activation": "gelu_pytorch_tanh"}
    path = write_hf(tmp_path / "m", cfg, params, arch="Gemma3ForCausalLM"
                    if arch.startswith("Gemma3") else arch, family=cfg.family, **extra)
    if arch == "Gemma3ForConditionalGeneration":
        text = json.loads((path / "config.json").read_text())
        for key in ("head_dim", "query_pre_attn_scalar", "rope_local_base_freq"):
            text.pop(key)  # transformers' defaults: what a real text_config leaves out
        (path / "config.json").write_text(json.dumps(
            {"architectures": [arch], "text_config": text, "vision_config": {},
             "eos_token_id": [1, 106]}))
        sd = {"language_model." + k: v for k, v in hf_state_dict(params, "gemma3").items()}
        sd["vision_tower.patch_embedding.weight"] = np.zeros((4, 4), np.float32)
        for f in path.glob("*.safetensors"):
            f.unlink()
        save_file(sd, str(path / "model.safetensors"))
    loaded = load_model(str(path), progress=False)
    assert_same_params(loaded.params, params, atol=1e-6, rtol=0)
    for option in OPTIONS:
        assert getattr(loaded.config, option) == getattr(cfg, option), option


@pytest.mark.parametrize("name", ["qwen3-8b", "gemma3-4b"])
def test_gguf_files_of_each_family_load(tmp_path, name):
    """GGUFs as llama.cpp's converter writes `qwen3` and `gemma3` (unpermuted q/k, Gemma's
    norms already w + 1, its window in the metadata, every sixth layer global)."""
    from dataclasses import replace

    from model.weights import load_model
    from tests.model.test_loaders import assert_same_params, write_gguf

    cfg = replace(shrunk(PRESETS[name], FAMILIES[name]), rope_scaling=None)
    params = init_random_params(cfg, seed=6)
    arch = "qwen3" if name.startswith("qwen3") else "gemma3"
    loaded = load_model(str(write_gguf(tmp_path / "m.gguf", cfg, params, arch=arch)),
                        progress=False)
    assert_same_params(loaded.params, params, atol=0, rtol=0)
    for option in OPTIONS:
        if option not in ("query_scale", "embed_scale"):
            assert getattr(loaded.config, option) == getattr(cfg, option), option
    if arch == "gemma3":  # as llama.cpp runs it: 1/sqrt(head_dim), sqrt(hidden)
        assert loaded.config.query_scale == 0.0
        assert loaded.config.embed_scale == pytest.approx(cfg.hidden_size ** 0.5)


def test_sliding_layers_copy_no_pool(family):
    """The `cond` between a layer's window and its whole context takes the pool as an
    operand: XLA must still update it in place, never copy it (tests/model/test_runner.py
    holds the same for the plain layers)."""
    from tests.model.test_runner import full_pool_copies

    _, _, runner = family
    assert full_pool_copies(runner) == {}
