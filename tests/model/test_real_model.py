"""The engine's numbers against an independent numpy forward pass, on the real embedded
SmolLM2-135M-Instruct: batched sequences of different lengths, pages in scrambled order,
prefill split into chunks of different sizes. Greedy tokens must match too."""

from __future__ import annotations

import numpy as np
import pytest

from model.runner import ModelRunner, enable_compilation_cache
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan
from tests.model import numpy_llama

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runner(embedded_model):
    enable_compilation_cache()
    r = ModelRunner(embedded_model.config, embedded_model.params, page_size=16,
                    num_pages=200, max_context=2048, decode_buckets=(4,),
                    prefill_buckets=(64, 256), block_q=16, max_prefill_seqs=4,
                    dtype="float32")
    r.warmup()
    return r


def test_logits_match_numpy_reference_batched_chunked_scrambled(runner, embedded_model):
    cfg, params, tok = embedded_model.config, embedded_model.params, embedded_model.tokenizer
    prompts = [
        tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]),
        tok.encode("The quick brown fox jumps over the lazy dog. " * 3),
        tok.encode("1, 2, 3, 4,"),
    ]
    rng = np.random.default_rng(7)
    free = list(rng.permutation(np.arange(1, runner.num_pages)))
    tables = [[int(free.pop()) for _ in range(-(-(len(p) + 8) // 16))] for p in prompts]
    # Chunk sizes differ per sequence so chunks start mid-page and mid-block.
    splits = [[13, 9, 50], [21, 40], [4]]
    pos = [0, 0, 0]
    last = {}
    while any(pos[s] < len(prompts[s]) for s in range(3)):
        chunks = []
        for s in range(3):
            if pos[s] >= len(prompts[s]):
                continue
            n = splits[s].pop(0) if splits[s] else len(prompts[s]) - pos[s]
            n = min(n, len(prompts[s]) - pos[s])
            done = pos[s] + n == len(prompts[s])
            chunks.append(SeqChunk(seq_id=s, token_ids=prompts[s][pos[s]:pos[s] + n],
                                   start_pos=pos[s], page_table=tables[s], sample=done,
                                   sampling=GREEDY))
            pos[s] += n
        res = runner.step(StepPlan(chunks), return_logits=True)
        last.update({s: (res.logits[s], res.sampled[s].token_id) for s in res.sampled})

    seqs = [list(p) for p in prompts]
    for step in range(4):
        for s in range(3):
            ref = numpy_llama.forward(params, cfg, seqs[s], last_only=True)[-1]
            got, token = last[s]
            np.testing.assert_allclose(got, ref, atol=1e-3, rtol=0,
                                       err_msg=f"seq {s} after {step} decode steps")
            assert token == int(np.argmax(ref))
            seqs[s].append(token)
        res = runner.step(StepPlan([
            SeqChunk(seq_id=s, token_ids=[seqs[s][-1]], start_pos=len(seqs[s]) - 1,
                     page_table=tables[s], sample=True, sampling=GREEDY) for s in range(3)]),
            return_logits=True)
        last = {s: (res.logits[s], res.sampled[s].token_id) for s in res.sampled}


def test_greedy_answer_says_paris(runner, embedded_model):
    tok = embedded_model.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    table = list(range(1, 1 + -(-(len(ids) + 32) // 16)))
    res = runner.step(StepPlan([SeqChunk(0, ids, 0, table, True, GREEDY)]))
    out = []
    for _ in range(24):
        t = res.sampled[0].token_id
        if t in tok.eos_token_ids:
            break
        out.append(t)
        res = runner.step(StepPlan([SeqChunk(0, [t], len(ids) + len(out) - 1, table, True,
                                             GREEDY)]))
    text = tok.decode(out)
    assert "Paris" in text, text
