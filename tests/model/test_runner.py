"""The model runner on a tiny random model: compiled shapes, pool updates, sampling.

(About 400 lines: the runner's promises — no compiles in steady state, chunked equals
one-shot, batch independence, prefix copies, layouts, warm-up order, its locks — each
tested against the same small model, built once per module.)"""

from __future__ import annotations

import re
import threading
import time

import jax
import numpy as np
import pytest

from model.config import ModelConfig
from model.packing import Bucket
from model.runner import ModelRunner
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan

TINY = ModelConfig(name="tiny-test", vocab_size=300, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position=1024, tie_embeddings=True, eos_token_ids=(2,))


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def r(*s):
        return (rng.standard_normal(s) * 0.1).astype(np.float32)

    h, i = cfg.hidden_size, cfg.intermediate_size
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = [{"attn_norm": 1 + r(h), "wq": r(h, qd), "wk": r(h, kd), "wv": r(h, kd),
               "wo": r(qd, h), "mlp_norm": 1 + r(h), "w_gate": r(h, i), "w_up": r(h, i),
               "w_down": r(i, h)} for _ in range(cfg.num_layers)]
    return {"embed": r(cfg.vocab_size, h), "final_norm": 1 + r(h), "layers": layers}


@pytest.fixture(scope="module")
def runner():
    r = ModelRunner(TINY, random_params(TINY), page_size=8, num_pages=96, max_context=512,
                    decode_buckets=(1, 4), prefill_buckets=(32, 64), block_q=8,
                    max_prefill_seqs=2)
    r.warmup()
    return r


def chunk(seq_id, toks, start, pages, *, sample=True, sampling=None, num_generated=0):
    return SeqChunk(seq_id=seq_id, token_ids=list(toks), start_pos=start, page_table=pages,
                    sample=sample, sampling=sampling or SamplingParams(temperature=0.0),
                    num_generated=num_generated)


def full_pool_copies(runner) -> dict:
    """Compiled step -> how many whole copies of the KV pool it makes, in any of the
    shapes the pool may be viewed in (empty: none anywhere)."""
    cfg = runner.config
    rows, ps = cfg.num_layers * runner.num_pages, runner.page_size
    kvh, d = cfg.num_kv_heads, runner.pool.row
    shapes = "|".join(",".join(map(str, s)) for s in [
        (rows, ps, kvh, d), (rows, ps * kvh * d), (rows * ps, kvh, d), (rows * ps, kvh * d)])
    found = {b: len(re.findall(rf"= \w+\[(?:{shapes})\]\S* copy\(", runner._steps[b].as_text()))
             for b in runner.programs.ready}
    return {b: n for b, n in found.items() if n}


def test_no_full_pool_copies_in_compiled_steps(runner):
    """XLA:CPU once copied the whole pool per layer per step, at one-token steps
    (docs/architecture.md): never again, whatever shape the pool is viewed in."""
    assert Bucket(1, 0) in runner.programs.ready  # the one-token step
    assert full_pool_copies(runner) == {}


def test_steady_state_never_compiles(runner, compilations):
    pages = [list(range(1 + 10 * s, 11 + 10 * s)) for s in range(5)]
    rng = np.random.default_rng(1)
    for n_dec, pf in [(1, []), (3, []), (4, [20]), (0, [7, 40]), (2, [64]), (4, [9])]:
        chunks = [chunk(s, [5], 30, pages[s]) for s in range(n_dec)]
        chunks += [chunk(4 - k, rng.integers(3, 300, n).tolist(), 0, pages[4 - k])
                   for k, n in enumerate(pf)]
        runner.step(StepPlan(chunks))
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3,
                            presence_penalty=0.5)
    runner.step(StepPlan([chunk(0, [5], 3, pages[0], sampling=seeded)]))
    runner.step(StepPlan([chunk(0, [5], 3, pages[0])], copies=[(pages[0][0], 95)]))
    assert compilations == []


def test_chunked_prefill_and_decode_match_one_shot(runner):
    """The same sequence prefilled in one chunk or three, with scrambled pages, ends with
    the same logits, and decoding on continues identically."""
    rng = np.random.default_rng(2)
    toks = rng.integers(3, 300, 45).tolist()
    pages_a = [3, 17, 9, 40, 22, 5, 61]
    pages_b = [70, 2, 33, 81, 14, 50, 11]
    a = runner.step(StepPlan([chunk(0, toks, 0, pages_a)]), return_logits=True)
    runner.step(StepPlan([chunk(1, toks[:13], 0, pages_b, sample=False)]))
    runner.step(StepPlan([chunk(1, toks[13:30], 13, pages_b, sample=False)]))
    b = runner.step(StepPlan([chunk(1, toks[30:], 30, pages_b)]), return_logits=True)
    np.testing.assert_allclose(a.logits[0], b.logits[1], atol=1e-4)
    ta, tb = a.sampled[0].token_id, b.sampled[1].token_id
    assert ta == tb
    for pos in range(45, 50):
        res = runner.step(StepPlan([chunk(0, [ta], pos, pages_a), chunk(1, [tb], pos, pages_b)]),
                          return_logits=True)
        np.testing.assert_allclose(res.logits[0], res.logits[1], atol=1e-4)
        ta, tb = res.sampled[0].token_id, res.sampled[1].token_id
        assert ta == tb


def test_a_step_that_samples_nothing_has_run_when_it_returns(runner):
    """A prompt's middle chunk samples nothing, so no result waits for it; the step must
    still have run when `step` returns (else the engine would queue a long prompt's
    chunks ahead of requests arriving meanwhile, and learn dispatch times as step times)."""
    toks = np.random.default_rng(5).integers(3, 300, 60).tolist()
    res = runner.step(StepPlan([chunk(0, toks, 0, [4, 18, 7, 30, 25, 41, 52, 60],
                                      sample=False)]))
    assert res.sampled == {}
    assert all(leaf.is_ready() for leaf in jax.tree.leaves(runner.kv))


def test_prompts_of_different_lengths_in_one_step_match_each_alone(runner):
    """A chunk deep into a long prompt and a short prompt share a step: their blocks are
    sorted by context and walked in groups, and each gets the logits it gets alone."""
    rng = np.random.default_rng(6)
    long_toks = rng.integers(3, 300, 200).tolist()
    short_toks = rng.integers(3, 300, 11).tolist()
    lp_a, lp_b = list(range(2, 28)), list(range(30, 56))
    sp_a, sp_b = [60, 61], [62, 63]
    for a in range(0, 184, 32):  # the long prompt's first 184 tokens, twice
        runner.step(StepPlan([chunk(0, long_toks[a:min(a + 32, 184)], a, lp_a, sample=False),
                              chunk(1, long_toks[a:min(a + 32, 184)], a, lp_b, sample=False)]))
    alone_long = runner.step(StepPlan([chunk(0, long_toks[184:], 184, lp_a)]),
                             return_logits=True)
    alone_short = runner.step(StepPlan([chunk(2, short_toks, 0, sp_a)]), return_logits=True)
    # The short prompt first in the plan: the runner puts the deeper chunk first.
    both = runner.step(StepPlan([chunk(3, short_toks, 0, sp_b),
                                 chunk(1, long_toks[184:], 184, lp_b)]), return_logits=True)
    np.testing.assert_allclose(both.logits[1], alone_long.logits[0], atol=1e-4)
    np.testing.assert_allclose(both.logits[3], alone_short.logits[2], atol=1e-4)
    assert both.sampled[1].token_id == alone_long.sampled[0].token_id
    assert both.sampled[3].token_id == alone_short.sampled[2].token_id


def test_seeded_sampling_is_independent_of_batch(runner):
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    pages = [list(range(1 + 8 * s, 9 + 8 * s)) for s in range(4)]
    prompt = [7, 8, 9, 10, 11]

    def run(batch_mates: int) -> list[int]:
        chunks = [chunk(0, prompt, 0, pages[0], sampling=sp)]
        chunks += [chunk(s, [s + 20], 0, pages[s],
                         sampling=SamplingParams(temperature=1.0)) for s in
                   range(1, 1 + batch_mates)]
        out = []
        res = runner.step(StepPlan(chunks))
        for n in range(1, 6):
            tok = res.sampled[0].token_id
            out.append(tok)
            chunks = [chunk(0, [tok], len(prompt) + n - 1, pages[0], sampling=sp,
                            num_generated=n)]
            chunks += [chunk(s, [3], n, pages[s], sampling=SamplingParams(
                temperature=1.0)) for s in range(1, 1 + batch_mates)]
            res = runner.step(StepPlan(chunks))
        return out

    assert run(0) == run(3)


def test_logprobs_are_log_softmax(runner):
    sp = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5)
    res = runner.step(StepPlan([chunk(0, [4, 5, 6], 0, [1], sampling=sp)]),
                      return_logits=True)
    tok = res.sampled[0]
    logits = res.logits[0].astype(np.float64)
    lp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    assert tok.token_id == int(np.argmax(logits))
    assert tok.logprob == pytest.approx(lp[tok.token_id], abs=1e-4)
    assert [t.token_id for t in tok.top_logprobs] == list(np.argsort(-lp)[:5])


def test_shared_prefix_pages_give_the_same_logits_as_private_copies(runner):
    """Cascade attention kicks in when decode rows share page-table prefixes (a system
    prompt); the numbers must equal those of a sequence holding its own copy."""
    _compare_shared_with_private(runner, np.random.default_rng(5))


def test_prefix_copy_rereads_rewritten_pages():
    """The CPU backend's jnp cascade keeps a shared prefix gathered between steps (its
    prefix copy). When its pages are written again (freed, then reused by another
    prompt), the next steps must read the new contents, never the stale copy."""
    runner = ModelRunner(TINY, random_params(TINY), page_size=8, num_pages=96,
                         max_context=512, decode_buckets=(1, 4), prefill_buckets=(32, 64),
                         block_q=8, max_prefill_seqs=2, attention_options={"native": False})
    runner.warmup()
    copy = runner.attention.copy
    assert copy is not None
    rng = np.random.default_rng(6)
    fills = copy.fills
    _compare_shared_with_private(runner, rng)  # fills the copy with one system prompt
    _compare_shared_with_private(runner, rng)  # same pages, another prompt written there
    assert copy.fills >= fills + 2


def _compare_shared_with_private(runner, rng):
    system = rng.integers(3, 300, 32).tolist()  # 4 full pages of 8
    shared = [60, 61, 62, 63]
    runner.step(StepPlan([chunk(9, system, 0, shared, sample=False)]))
    tails = [rng.integers(3, 300, n).tolist() for n in (5, 11)]
    tables = [shared + [70, 71], shared + [72, 73]]
    private = [[80, 81, 82, 83, 84, 85], [86, 87, 88, 89, 90, 91]]
    for s in range(2):
        runner.step(StepPlan([chunk(s, tails[s], 32, tables[s], sample=False)]))
        runner.step(StepPlan([chunk(s + 2, system + tails[s], 0, private[s], sample=False)]))
    last = [t[-1] for t in tails]
    pos = [32 + len(t) for t in tails]
    for _ in range(3):
        a = runner.step(StepPlan([chunk(s, [last[s]], pos[s], tables[s]) for s in range(2)]),
                        return_logits=True)  # rows share 4 pages: cascade attention
        b = runner.step(StepPlan([chunk(s + 2, [last[s]], pos[s], private[s])
                                  for s in range(2)]), return_logits=True)
        for s in range(2):
            np.testing.assert_allclose(a.logits[s], b.logits[s + 2], atol=1e-4)
            assert a.sampled[s].token_id == b.sampled[s + 2].token_id
        last = [a.sampled[s].token_id for s in range(2)]
        pos = [p + 1 for p in pos]


@pytest.mark.parametrize("variant", ["tied", "untied-with-bias"])
def test_cpu_and_gpu_layouts_agree(variant):
    """The CPU default keeps the residual stream [hidden, T] with (out, in) weights and
    the MLP weights per layer behind a switch; the GPU path keeps [T, hidden] with (in,
    out) weights, stacked under a scan or per layer with the loop unrolled. Same logits,
    mixed step included, for tied embeddings and for an untied lm_head with qkv biases."""
    cfg, params = TINY, random_params(TINY, seed=4)
    if variant != "tied":
        import dataclasses

        cfg = dataclasses.replace(TINY, tie_embeddings=False, qkv_bias=True)
        rng = np.random.default_rng(5)
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        params["lm_head"] = (rng.standard_normal((cfg.hidden_size, cfg.vocab_size)) * 0.1
                             ).astype(np.float32)
        for lp in params["layers"]:
            lp["bq"], lp["bk"], lp["bv"] = (rng.standard_normal(n).astype(np.float32) * 0.1
                                            for n in (qd, kd, kd))
    out = []
    for fm, unrolled in ((True, False), (False, False), (False, True)):
        r = ModelRunner(cfg, params, page_size=8, num_pages=32, max_context=256,
                        decode_buckets=(2,), prefill_buckets=(64,), block_q=8,
                        max_prefill_seqs=2, feature_major=fm, switched_mlp=fm,
                        unrolled_layers=unrolled)
        assert r.describe()["feature_major"] is fm and r.describe()["switched_mlp"] is fm
        assert r.describe()["unrolled_layers"] is unrolled
        assert isinstance(r.params["layers"]["attn"], tuple) is unrolled
        r.warmup()
        toks = list(range(3, 23))
        r.step(StepPlan([chunk(0, toks, 0, [1, 2, 3]), chunk(1, toks[:9], 0, [4, 5, 6])]))
        res = r.step(StepPlan([chunk(0, [7], 20, [1, 2, 3]), chunk(1, toks[9:], 9, [4, 5, 6])]),
                     return_logits=True)
        out.append(res.logits)
    for s in (0, 1):
        np.testing.assert_allclose(out[0][s], out[1][s], atol=1e-4)
        np.testing.assert_allclose(out[2][s], out[1][s], atol=1e-5)


def test_prefix_copy_follows_the_longer_prefix_and_gathers_the_other():
    """Decode rows share a system prompt while a long prompt is prefilled in chunks beside
    them: the two attention groups share different prefixes. The prefix copy moves to
    the long prompt once its earlier chunks outgrow the system prompt, and the group it
    does not serve gathers its prefix from the pages, in whole blocks: the logits stay
    those of a runner that gathers everything."""
    params = random_params(TINY, seed=7)
    kw = dict(page_size=2, num_pages=600, max_context=512, decode_buckets=(2,),
              prefill_buckets=(32,), block_q=8, max_prefill_seqs=2)
    buffered, gathered = ModelRunner(
        TINY, params, attention_options=dict(native=False), **kw), ModelRunner(
        TINY, params, attention_options=dict(native=False, prefix_copy_tokens=0), **kw)
    assert buffered.attention.copy is not None and gathered.attention.copy is None
    rng = np.random.default_rng(8)
    system, long = rng.integers(3, 300, 130).tolist(), rng.integers(3, 300, 300).tolist()
    sys_pages, long_pages = list(range(1, 66)), list(range(200, 350))
    tables = [sys_pages + list(range(100, 110)), sys_pages + list(range(120, 130))]
    tails = [rng.integers(3, 300, n).tolist() for n in (5, 9)]
    for r in (buffered, gathered):
        r.warmup()
        for a in range(0, 130, 32):
            r.step(StepPlan([chunk(9, system[a:a + 32], a, sys_pages, sample=False)]))
        r.step(StepPlan([chunk(s, tails[s], 130, tables[s], sample=False)
                         for s in range(2)]))
    last, pos = [t[-1] for t in tails], [130 + len(t) for t in tails]
    for a in range(0, 300, 32):
        plan = StepPlan([chunk(s, [last[s]], pos[s], tables[s]) for s in range(2)]
                        + [chunk(5, long[a:a + 32], a, long_pages)])
        x, y = (r.step(plan, return_logits=True) for r in (buffered, gathered))
        for s in (0, 1, 5):
            np.testing.assert_allclose(x.logits[s], y.logits[s], atol=1e-4)
        last, pos = [x.sampled[s].token_id for s in range(2)], [p + 1 for p in pos]
    # It held the system prompt, then the long prompt's earlier pages too.
    assert buffered.attention.copy.fills >= 2
    assert any(list(h[:100]) == long_pages[:100] for h in buffered.attention.copy.held)


def test_serves_before_every_shape_is_compiled():
    """Warmed up on its essential shapes only, the runner runs every step in the smallest
    ready bucket that holds it (padded, never compiling), with the logits it gives once
    the exact bucket is ready; the background compile then fills in the rest."""
    r = ModelRunner(TINY, random_params(TINY, seed=9), page_size=8, num_pages=64,
                    max_context=256, decode_buckets=(1, 4), prefill_buckets=(16, 64),
                    mixed_decode_buckets=(0, 4), block_q=8, max_prefill_seqs=2)
    r.warm_essential([10])
    assert set(r.programs.ready) == {Bucket(4, 64), Bucket(1, 0), Bucket(0, 16)}
    assert r.warmup_remaining == len(r.buckets()) - 3
    toks = list(range(3, 40))
    plan = StepPlan([chunk(0, [5], 9, [1, 2]), chunk(1, [6], 9, [3, 4]),
                     chunk(2, toks[:30], 0, [5, 6, 7, 8])])
    padded = r.step(plan, return_logits=True)  # needs (2, 32): only (4, 64) holds it
    assert padded.padded_tokens == 4 + 64
    done = threading.Event()
    r.warm_in_background(on_done=done.set)
    assert done.wait(300) and r.warmup_remaining == 0
    exact = r.step(plan, return_logits=True)
    assert exact.padded_tokens == 4 + 64  # (4, 64) is the smallest mixed bucket here
    single = r.step(StepPlan([chunk(0, [5], 9, [1, 2])]), return_logits=True)
    assert single.padded_tokens == 1
    for s in (0, 1, 2):
        np.testing.assert_allclose(padded.logits[s], exact.logits[s], atol=1e-4)


def test_prompt_logprobs_match_the_oracle_across_chunks_and_rows(runner):
    """Prompt scoring (completions' `echo` with `logprobs`): each prompt token's logprob
    under the tokens before it, computed in the steps that prefill the prompt — a prompt
    cut in chunks, beside a decode row and another prompt — equals the independent numpy
    forward's log-softmax at every position; the top alternatives are its top k."""
    from tests.model import numpy_llama

    rng = np.random.default_rng(11)
    toks = rng.integers(3, 300, 50).tolist()
    other = rng.integers(3, 300, 9).tolist()
    pages = [12, 3, 44, 27, 8, 90, 35]
    want = numpy_llama.forward(random_params(TINY), TINY, toks).astype(np.float64)
    want = want - np.log(np.exp(want - want.max(-1, keepdims=True)).sum(-1, keepdims=True)
                         ) - want.max(-1, keepdims=True)
    got: dict[int, object] = {}
    for start, end in [(0, 20), (20, 37), (37, 49), (49, 50)]:
        c = chunk(0, toks[start:end], start, pages, sample=end == 50)
        c.score_targets = [toks[i + 1] if i + 1 < 50 else -1 for i in range(start, end)]
        c.score_top = 3
        plan = [c, chunk(1, [5], 30, [60, 61, 62, 63]), chunk(2, other, 0, [70, 71])]
        res = runner.step(StepPlan(plan))
        assert set(res.prompt_logprobs) == {0}
        scores = res.prompt_logprobs[0]
        assert len(scores) == end - start
        for pos, s in enumerate(scores, start):
            if pos + 1 < 50:
                got[pos] = s
            else:
                assert s is None
    assert sorted(got) == list(range(49))
    for pos, s in got.items():
        assert s.token_id == toks[pos + 1]
        assert s.logprob == pytest.approx(want[pos, toks[pos + 1]], abs=2e-4)
        assert [t.token_id for t in s.top_logprobs] == list(np.argsort(-want[pos])[:3])


def test_a_prefill_bucket_too_small_for_its_chunks_padding_is_refused():
    # 4 chunks may each pad 15 tokens: a 32-token bucket would hold no prompt token.
    with pytest.raises(ValueError, match=r"largest prefill bucket \(32\) leaves no room"):
        ModelRunner(TINY, random_params(TINY), page_size=8, num_pages=8, max_context=64,
                    decode_buckets=(1,), prefill_buckets=(32,), block_q=16, max_prefill_seqs=4)


def test_pallas_interpret_runner_gives_the_cpu_backends_greedy_tokens():
    """GPU readiness without a GPU (issue 18 point 5): the whole runner with the Pallas
    kernels in interpret mode produces the CPU backend's greedy tokens for a mixed batch
    (prompts prefilled together, then decoded together)."""
    from tests.model.tp_check import greedy_run

    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 300, n).tolist() for n in (3, 17, 30)]
    tokens = {}
    for attention in ("cpu", "pallas_interpret"):
        r = ModelRunner(TINY, random_params(TINY, seed=2), page_size=8, num_pages=40,
                        max_context=128, decode_buckets=(4,), prefill_buckets=(64,),
                        mixed_decode_buckets=(0,), block_q=8, max_prefill_seqs=3,
                        attention=attention)
        r.warmup()
        tokens[attention], _ = greedy_run(r, prompts, 8)
    assert tokens["pallas_interpret"] == tokens["cpu"]


def test_a_compile_waiting_for_the_device_lock_holds_no_compile_lock():
    """A multi-host follower replays a call (holding the device lock) for a shape its
    background precompile has not reached, while that precompile is at another shape:
    the precompile takes its example inputs under the device lock before the compile
    lock, so the replay's own compile is never stuck behind it (the other order
    deadlocked a two-process replica's warm-up now and then)."""
    r = ModelRunner(TINY, random_params(TINY, seed=5), page_size=8, num_pages=32,
                    max_context=128, decode_buckets=(1, 2), prefill_buckets=(16,),
                    mixed_decode_buckets=(0,), block_q=8, max_prefill_seqs=1)
    first, second = Bucket(1, 0), Bucket(2, 0)
    replayed = threading.Event()

    def replay():
        with r._lock:
            background = threading.Thread(target=r._program, args=(second,), daemon=True)
            background.start()
            time.sleep(0.5)  # the precompile is waiting for the device lock by now
            r._program(first)
            replayed.set()
        background.join(120)

    threading.Thread(target=replay, daemon=True).start()
    assert replayed.wait(120), "the replay's compile waited on the precompile"
    deadline = time.monotonic() + 120
    while second not in r._steps and time.monotonic() < deadline:
        time.sleep(0.1)
    assert first in r._steps and second in r._steps
