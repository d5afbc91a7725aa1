"""Sliding layers on pages of their own (scheduler/window_pages.py) through the real
runner and engine: the same answers as the shared pool, each sequence's sliding pages
bounded by its window whatever its context, window tails served from the prefix cache,
every page back at the end (a tiny random Gemma 3 of the same code: three sliding
layers of 16 keys and a global one, f32)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from model.presets import PRESETS
from model.runner import ModelRunner, enable_compilation_cache
from model.weights import init_random_params
from scheduler.api import GenerateRequest

from .test_speculative_real import GREEDY, generate

CFG = PRESETS["tiny-gemma3"]


@pytest.fixture(scope="module")
def runners():
    enable_compilation_cache()
    params = init_random_params(CFG, seed=5)

    def make(own):
        r = ModelRunner(CFG, params, page_size=8, num_pages=300, max_context=1024,
                        decode_buckets=(1, 8), prefill_buckets=(64,), block_q=8,
                        max_prefill_seqs=2, dtype="float32", window_pool=own)
        r.warmup()
        return r

    return make(False), make(True)


def test_the_same_memory_holds_more_context(runners):
    shared, own = runners
    assert shared.window_pool == 0 and own.window_pool > 0
    assert own.kv_bytes <= shared.kv_bytes  # the same budget...
    assert own.num_pages > 2 * shared.num_pages  # ...for more than twice the context
    assert own.describe()["window_pool_pages"] == own.window_pool


def _requests(lengths, seed, max_tokens=40):
    rng = np.random.default_rng(seed)
    system = rng.integers(3, CFG.vocab_size, 70).tolist()  # shared, past the window
    return [GenerateRequest(prompt_ids=system + rng.integers(3, CFG.vocab_size, n).tolist(),
                            max_tokens=max_tokens, sampling=GREEDY, ignore_eos=True)
            for n in lengths]


@pytest.mark.parametrize("overlap", [False, True])
def test_answers_equal_the_shared_pool_and_pages_stay_within_the_window(runners, overlap):
    """10 prompts behind a shared system prompt, concurrently, then with n-gram proposals
    verified and trimmed: every answer equals the shared pool's; the system prompt's pages
    are prefix hits as often as in the shared pool (their window tails were cached too);
    no sequence ever held more sliding pages than its bound, far below its context;
    every page back."""
    shared, own = runners
    reqs = _requests([5 + 13 * i for i in range(10)], seed=0)
    base: list = []
    want, _ = trio.run(lambda: generate(shared, reqs, speculative="off", concurrent=True,
                                        seen=base))
    seen: list = []
    for spec in ("off", "ngram"):
        got, _ = trio.run(lambda: generate(own, reqs, speculative=spec, concurrent=True,
                                           seen=seen, overlap=overlap))
        assert [g[0] for g in got] == [w[0] for w in want], spec
    hits = base[0].prefix_cache_hits_tokens
    assert hits >= 9 * 64 and seen[0].prefix_cache_hits_tokens == hits
    win = seen[0].kv_window
    assert win["window"] == 16 and win["pages_in_use"] == 0 and win["pages_cached"] > 0
    assert win["most_pages_held_ever"] <= win["max_pages_per_seq"]
    longest = max(len(r.prompt_ids) for r in reqs) + 40
    assert win["max_pages_per_seq"] * own.page_size < longest


def test_a_long_prompt_holds_its_window_only(runners):
    """A 900-token prompt (56 windows) and its answer: the same tokens as the shared
    pool; the sliding pages it held never passed the bound (11 pages: 88 positions)."""
    shared, own = runners
    reqs = _requests([830], seed=1, max_tokens=24)
    want, _ = trio.run(lambda: generate(shared, reqs, speculative="off", concurrent=False))
    seen: list = []
    got, _ = trio.run(lambda: generate(own, reqs, speculative="off", concurrent=False,
                                       seen=seen))
    assert got[0][0] == want[0][0]
    win = seen[0].kv_window
    assert win["most_pages_held_ever"] <= win["max_pages_per_seq"] == 11
