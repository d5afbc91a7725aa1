"""The engine batching LoRA adapters on a real (tiny, random) model: requests of the base
model and of three adapters, with only two device slots, run together and each produces
token for token what it produces alone, although adapters are swapped out of their slots
and back while others run. Every page and every slot is free again at the end."""

from __future__ import annotations

import numpy as np
import trio

from config.settings import SchedulerConfig
from model.lora import load_peft_adapter
from model.runner import ModelRunner
from scheduler.api import FinishEvent, GenerateRequest, TokenEvent
from scheduler.engine import Engine
from scheduler.protocol import SamplingParams
from tests.model.peft import write_peft
from tests.model.test_runner import TINY, random_params
from tests.scheduler.fake_runner import FakeDetokenizer


async def run(engine: Engine, reqs: list[GenerateRequest], concurrent: bool) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in reqs]

    async def one(i: int) -> None:
        h = engine.submit(reqs[i])
        async for ev in h.events:
            if isinstance(ev, TokenEvent):
                out[i].extend(ev.token_ids)
            else:
                assert isinstance(ev, FinishEvent), ev
                return

    if concurrent:
        async with trio.open_nursery() as n:
            for i in range(len(reqs)):
                n.start_soon(one, i)
    else:
        for i in range(len(reqs)):
            await one(i)
    return out


async def test_mixed_adapters_match_each_alone_through_swaps(tmp_path):
    runner = ModelRunner(TINY, random_params(TINY), page_size=8, num_pages=120,
                         max_context=512, decode_buckets=(1, 4, 8), prefill_buckets=(32, 64),
                         block_q=8, max_prefill_seqs=4, adapter_slots=2, max_lora_rank=16)
    runner.warmup()
    for name, rank in (("a4", 4), ("a8", 8), ("a16", 16)):
        write_peft(tmp_path / name, TINY, rank=rank, seed=rank, rslora=rank == 8)
        runner.add_adapter(load_peft_adapter(tmp_path / name, name, TINY, max_rank=16))
    rng = np.random.default_rng(0)
    names = [None, "a4", "a8", "a16"] * 3
    reqs = [GenerateRequest(prompt_ids=rng.integers(3, 300, 10 + 3 * i).tolist(),
                            max_tokens=12, sampling=SamplingParams(temperature=0.0),
                            ignore_eos=True, adapter=name)
            for i, name in enumerate(names)]
    engine = Engine(runner, FakeDetokenizer(), SchedulerConfig(
        max_running=8, max_step_tokens=64, kv_reserve_pages=2, ttft_target_s=0))
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        alone = await run(engine, reqs, concurrent=False)
        swaps_alone = engine.stats().adapters["swaps"]
        together = await run(engine, reqs, concurrent=True)
        nursery.cancel_scope.cancel()
    for i, name in enumerate(names):
        assert together[i] == alone[i], (i, name)
    # The adapters change the answers (the comparison is not between base-model runs).
    assert len({tuple(alone[i]) for i in range(4)}) == 4
    stats = engine.stats()
    assert stats.adapters["swaps"] > swaps_alone  # slots changed hands while others ran
    assert stats.kv_pages_in_use == 0 and stats.running == 0
    assert stats.adapters["running"] == {} and stats.adapters["waiting"] == {}
    assert engine.scheduler.adapters.users.total() == 0


async def test_adapters_verify_speculative_rows_under_their_own_slots(tmp_path):
    """Speculative verifies of base and adapter sequences in the same steps (every guess
    verified: the step-cost check is bypassed): the same tokens as without speculation,
    each row under its sequence's adapter."""
    runner = ModelRunner(TINY, random_params(TINY, seed=4), page_size=8, num_pages=160,
                         max_context=512, decode_buckets=(1, 4, 8, 16),
                         prefill_buckets=(32, 64), block_q=8, max_prefill_seqs=4,
                         adapter_slots=2, max_lora_rank=16)
    runner.warmup()
    for name, rank in (("a4", 4), ("a8", 8)):
        write_peft(tmp_path / name, TINY, rank=rank, seed=rank)
        runner.add_adapter(load_peft_adapter(tmp_path / name, name, TINY, max_rank=16))
    rng = np.random.default_rng(1)
    names = [None, "a4", "a8"] * 2
    prompts = [rng.integers(3, 12, 8).tolist() * 3 for _ in names]  # spans that repeat
    outs = {}
    for mode in ("off", "ngram"):
        reqs = [GenerateRequest(prompt_ids=p, max_tokens=20, ignore_eos=True, adapter=n,
                                sampling=SamplingParams(temperature=0.0))
                for p, n in zip(prompts, names)]
        engine = Engine(runner, FakeDetokenizer(), SchedulerConfig(
            max_running=4, max_step_tokens=64, kv_reserve_pages=2, ttft_target_s=0,
            overlap=False, speculative=mode, ngram_min=1))
        engine.scheduler._spec_step_time = lambda rows, explore=True: 0.0
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            outs[mode] = await run(engine, reqs, concurrent=True)
            nursery.cancel_scope.cancel()
        spec = engine.scheduler.spec_stats()
        assert engine.stats().kv_pages_in_use == 0
    assert outs["ngram"] == outs["off"]
    assert spec["drafts"] > 10
