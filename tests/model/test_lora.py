"""LoRA adapters on a tiny random model: the PEFT reader, the runner's slots and the
batched delta, checked against the numpy oracle on merged weights (tests/model/peft.py)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from model.adapter_slots import native_available
from model.lora import AdapterError, load_peft_adapter
from model.runner import ModelRunner
from scheduler.protocol import StepPlan

from . import numpy_llama
from .peft import ALL, merge, write_peft
from .test_runner import TINY, chunk, random_params

PARAMS = random_params(TINY)


def make_runner(slots=3, feature_major=None, max_cpu=None, native=None, **kw):
    r = ModelRunner(TINY, PARAMS, page_size=8, num_pages=96, max_context=512,
                    decode_buckets=(1, 4), prefill_buckets=(32, 64), block_q=8,
                    max_prefill_seqs=4, adapter_slots=slots, max_lora_rank=16,
                    feature_major=feature_major, max_cpu_loras=max_cpu, native_lora=native,
                    **kw)
    r.warmup()
    return r


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Ranks 4/8/16, all seven targets, one with rsLoRA, one on q/v only (the usual
    recipe), and one whose B is zero."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {"r4": dict(rank=4, seed=1), "r8": dict(rank=8, seed=2, rslora=True),
             "r16": dict(rank=16, seed=3, alpha=8), "qv": dict(rank=8, seed=4,
                                                              targets=("q_proj", "v_proj")),
             "zero": dict(rank=8, seed=5, zero_b=True)}
    return {name: (root / name, write_peft(root / name, TINY, **spec))
            for name, spec in specs.items()}


def register(runner, adapters, *names):
    for n in names:
        runner.add_adapter(load_peft_adapter(adapters[n][0], n, TINY, max_rank=16))


def prompts(n, length=13, seed=7):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, length + i).tolist() for i in range(n)]


@pytest.mark.parametrize("feature_major,native", [(True, False), (False, False), (True, True)],
                         ids=["feature-major", "row-major", "native"])
def test_mixed_step_matches_numpy_on_merged_weights(adapters, feature_major, native):
    """One step prefills the base and three adapters of ranks 4/8/16 (rsLoRA among them)
    side by side, then decodes them together: every sequence's logits agree with the numpy
    forward on W + scale * B @ A within 1e-3, with the stacked-mask matmuls and with the
    CPU's native kernel (f32 slots)."""
    if native and not native_available():
        pytest.skip("the native kernels do not build here")
    runner = make_runner(feature_major=feature_major, native=native)
    assert runner.describe()["lora_kernel"] == ("native" if native else "stacked")
    register(runner, adapters, "r4", "r8", "r16")
    names = [None, "r4", "r8", "r16"]
    plan = StepPlan([], adapter_loads=[(0, "r4"), (1, "r8"), (2, "r16")])
    ps = prompts(4)
    pages = [[1 + 8 * i + j for j in range(8)] for i in range(4)]
    for i, p in enumerate(ps):
        c = chunk(i, p, 0, pages[i])
        c.adapter_slot = names.index(names[i]) - 1 if names[i] else -1
        plan.chunks.append(c)
    res = runner.step(plan, return_logits=True)
    merged = [PARAMS if n is None else merge(PARAMS, adapters[n][1]) for n in names]
    for i, p in enumerate(ps):
        want = numpy_llama.forward(merged[i], TINY, p, last_only=True)[-1]
        np.testing.assert_allclose(res.logits[i], want, atol=1e-3, err_msg=str(names[i]))
        if names[i] is not None:  # the adapter changes the answer noticeably
            base = numpy_llama.forward(PARAMS, TINY, p, last_only=True)[-1]
            assert np.abs(want - base).max() > 0.05
    seqs = [p + [res.sampled[i].token_id] for i, p in enumerate(ps)]
    dec = [chunk(i, [s[-1]], len(s) - 1, pages[i]) for i, s in enumerate(seqs)]
    for i, c in enumerate(dec):
        c.adapter_slot = plan.chunks[i].adapter_slot
    res = runner.step(StepPlan(dec), return_logits=True)
    for i, s in enumerate(seqs):
        want = numpy_llama.forward(merged[i], TINY, s, last_only=True)[-1]
        np.testing.assert_allclose(res.logits[i], want, atol=1e-3, err_msg=str(names[i]))


def test_int8_base_weights_keep_the_slots_in_bf16_and_track_the_merged_model(adapters):
    """Beside int8 base weights the native kernel's slots are bf16 (half the bytes a step
    reads); the adapter's logits stay as close to the numpy forward on merged weights as
    the int8 base's are to the f32 base (tests/model/test_quant.py), and much closer to
    them than to the base model's."""
    if not native_available():
        pytest.skip("the native kernels do not build here")
    runner = make_runner(slots=2, quantization="int8")
    assert runner.lora.native and runner.lora.dtype == jnp.bfloat16
    register(runner, adapters, "r16")
    ps = prompts(2, seed=5)
    pages = [[1 + 8 * i + j for j in range(8)] for i in range(2)]
    cs = [chunk(i, p, 0, pages[i]) for i, p in enumerate(ps)]
    cs[1].adapter_slot = 1
    res = runner.step(StepPlan(cs, adapter_loads=[(1, "r16")]), return_logits=True)
    merged = merge(PARAMS, adapters["r16"][1])
    for i, params in ((0, PARAMS), (1, merged)):
        want = numpy_llama.forward(params, TINY, ps[i], last_only=True)[-1]
        np.testing.assert_allclose(res.logits[i], want, atol=0.05 * np.abs(want).max())
    base = numpy_llama.forward(PARAMS, TINY, ps[1], last_only=True)[-1]
    want = numpy_llama.forward(merged, TINY, ps[1], last_only=True)[-1]
    assert np.abs(res.logits[1] - want).max() < 0.5 * np.abs(want - base).max()


def test_zero_b_gives_the_base_models_tokens_and_targets_subset_matches(adapters):
    runner = make_runner(slots=2)
    register(runner, adapters, "zero", "qv")
    ps = prompts(3, seed=11)
    ps[0] = ps[1]  # the base and the zero-B adapter on the same prompt, side by side
    pages = [[1 + 8 * i + j for j in range(8)] for i in range(3)]
    cs = [chunk(i, p, 0, pages[i]) for i, p in enumerate(ps)]
    cs[1].adapter_slot, cs[2].adapter_slot = 0, 1
    res = runner.step(StepPlan(cs, adapter_loads=[(0, "zero"), (1, "qv")]),
                      return_logits=True)
    np.testing.assert_allclose(res.logits[1], res.logits[0], atol=1e-6)
    assert res.sampled[1].token_id == res.sampled[0].token_id
    base = numpy_llama.forward(PARAMS, TINY, ps[1], last_only=True)[-1]
    np.testing.assert_allclose(res.logits[1], base, atol=1e-3)
    want = numpy_llama.forward(merge(PARAMS, adapters["qv"][1]), TINY, ps[2], last_only=True)
    np.testing.assert_allclose(res.logits[2], want[-1], atol=1e-3)


def test_loading_into_a_slot_never_compiles_and_swaps_in_place(adapters, compilations):
    runner = make_runner(slots=1, max_cpu=1)
    register(runner, adapters, "r4", "r8", "r16")  # host copies: 2 kept, one re-read
    p = prompts(1, seed=3)[0]
    pages = list(range(1, 9))
    want = {n: numpy_llama.forward(merge(PARAMS, adapters[n][1]), TINY, p, last_only=True)[-1]
            for n in ("r4", "r8", "r16")}
    compilations.clear()  # the runner's own warm-up compiled; loads must not
    for n in ("r4", "r8", "r16", "r4"):
        c = chunk(0, p, 0, pages)
        c.adapter_slot = 0
        res = runner.step(StepPlan([c], adapter_loads=[(0, n)]), return_logits=True)
        np.testing.assert_allclose(res.logits[0], want[n], atol=1e-3, err_msg=n)
    assert compilations == []
    assert runner.lora.disk_reads >= 1  # the host cache held two of the three
    runner.drop_adapter("r4")
    with pytest.raises(KeyError):
        runner.lora.load(0, "r4")


def _raises(path, *fragments, max_rank=16):
    with pytest.raises(AdapterError) as e:
        load_peft_adapter(path, "bad", TINY, max_rank=max_rank)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))


def test_bad_adapter_files_name_the_file_and_tensor(tmp_path):
    _raises(tmp_path / "nowhere", "no such adapter directory")
    write_peft(tmp_path / "big", TINY, rank=32)
    _raises(tmp_path / "big", "adapter_config.json", "r=32", "max_lora_rank 16")
    write_peft(tmp_path / "ok", TINY, rank=4)
    _raises(tmp_path / "ok", "exceeds", max_rank=2)

    d = tmp_path / "unknown"
    write_peft(d, TINY, rank=4, extra_config={"target_modules": ["q_proj", "lm_head"]})
    _raises(d, "unknown target module", "lm_head")

    d = tmp_path / "missing"
    write_peft(d, TINY, rank=4, targets=("q_proj",),
               extra_config={"target_modules": ["q_proj", "v_proj"]})
    _raises(d, "adapter_model.safetensors", "layers.0.self_attn.v_proj.lora_A.weight",
            "missing")

    d = tmp_path / "shape"
    small = TINY.__class__(**{**TINY.__dict__, "intermediate_size": 96})
    write_peft(d, small, rank=4)
    _raises(d, "adapter_model.safetensors", "mlp.gate_proj.lora_B.weight", "(96, 4)",
            "(128, 4)")

    d = tmp_path / "garbage"
    write_peft(d, TINY, rank=4)
    (d / "adapter_model.safetensors").write_bytes(b"\x00not safetensors")
    _raises(d, "adapter_model.safetensors", "not a readable safetensors file")

    d = tmp_path / "json"
    write_peft(d, TINY, rank=4)
    (d / "adapter_config.json").write_text("{r: 4")
    _raises(d, "adapter_config.json", "not valid JSON")

    d = tmp_path / "bin"
    write_peft(d, TINY, rank=4)
    (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")
    _raises(d, "adapter_model.safetensors: missing", "convert it to safetensors")

    d = tmp_path / "dora"
    write_peft(d, TINY, rank=4, extra_config={"use_dora": True})
    _raises(d, "use_dora=True", "not supported")


def test_peft_config_forms(tmp_path):
    """all-linear, a regex, and layers_to_transform read as PEFT reads them."""
    d = tmp_path / "all"
    write_peft(d, TINY, rank=4, extra_config={"target_modules": "all-linear"})
    assert load_peft_adapter(d, "x", TINY, max_rank=16).targets == tuple(sorted(ALL))
    d = tmp_path / "regex"
    write_peft(d, TINY, rank=4, targets=("q_proj", "v_proj"),
               extra_config={"target_modules": r".*\.(q_proj|v_proj)"})
    assert load_peft_adapter(d, "x", TINY, max_rank=16).targets == ("q_proj", "v_proj")
    d = tmp_path / "layers"
    write_peft(d, TINY, rank=4, extra_config={"layers_to_transform": [1]})
    a = load_peft_adapter(d, "x", TINY, max_rank=16)
    assert not a.a["qkv"][0].any() and a.a["qkv"][1].any()
    meta = json.loads((d / "adapter_config.json").read_text())
    assert meta["r"] == 4
