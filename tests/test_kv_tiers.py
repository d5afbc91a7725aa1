"""The KV cache's tiers below the device pool, end to end on a tiny random model: the
engine, the runner's host buffer and swap programs, and the disk store.

- prefixes evicted from a pool too small for them are served from the host tier: tokens
  identical to a cold computation, the prompt not recomputed;
- a fresh runner on the same disk folder (a restart) serves a known prefix from disk,
  tokens identical, logprobs within the pool's distance, whether the prefix had been
  evicted or was still on the device when the server stopped;
- one tenant's prefix is never another's hit, on any tier;
- corrupt, truncated and foreign-model files, and the folder removed while serving: the
  engine keeps serving (those pages are computed) and says so once in the log;
- nothing leaks: device pages, host slots and disk bytes are back within the books.
"""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import trio

from config.settings import SchedulerConfig
from model.runner import ModelRunner, enable_compilation_cache
from scheduler.api import ErrorEvent, FinishEvent, GenerateRequest, TokenEvent
from scheduler.engine import Engine
from scheduler.protocol import SamplingParams

from .app.faults import FaultyRunner, InjectedFault
from .model.test_runner import TINY, random_params
from .scheduler.fake_runner import FakeDetokenizer

PAGE = 8
SYSTEM = 96  # tokens of each tenant's system prompt: 12 pages
GREEDY = SamplingParams(temperature=0.0, logprobs=True)
CFG = SchedulerConfig(max_step_tokens=68, max_running=4, kv_reserve_pages=0,
                      ttft_target_s=0.0, queue_deadline_s=600.0)


def make_runner(tmp_path=None, *, host_bytes=0, seed=0, disk_bytes=1 << 30) -> ModelRunner:
    enable_compilation_cache()  # the runners after the first compile nothing
    r = ModelRunner(TINY, random_params(TINY, seed), page_size=PAGE, num_pages=40,
                    max_context=512, decode_buckets=(1, 4), prefill_buckets=(32, 64),
                    block_q=8, max_prefill_seqs=2, kv_host_bytes=host_bytes,
                    kv_disk_dir=None if tmp_path is None else str(tmp_path),
                    kv_disk_bytes=disk_bytes)
    r.warmup()
    return r


def prompt(tenant: int, question: int) -> list[int]:
    rng = np.random.default_rng(1000 + tenant)
    system = rng.integers(3, TINY.vocab_size, SYSTEM).tolist()
    return system + [(question * 7 + j) % 290 + 5 for j in range(5)]


async def generate(engine: Engine, ids: list[int], salt: str = "",
                   errors: bool = False) -> tuple[list, list] | None:
    """Greedy tokens and logprobs; None for a request that ended with an error (only
    when `errors`)."""
    h = engine.submit(GenerateRequest(prompt_ids=ids, max_tokens=6, sampling=GREEDY,
                                      ignore_eos=True, cache_salt=salt))
    toks, lps = [], []
    async for ev in h.events:
        if isinstance(ev, TokenEvent):
            toks += ev.token_ids
            lps += [lp.logprob for lp in ev.logprobs]
        elif isinstance(ev, FinishEvent):
            return toks, lps
        elif errors and isinstance(ev, ErrorEvent):
            return None
        else:
            raise AssertionError(f"unexpected {ev!r}")
    raise AssertionError("no finish")


async def serve(runner, requests, errors: bool = False):
    """Run (tenant, question, salt) requests one after another on a fresh engine:
    their outputs and the engine."""
    engine = Engine(runner, FakeDetokenizer(), CFG)
    out = []
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        for tenant, q, salt in requests:
            out.append(await generate(engine, prompt(tenant, q), salt, errors))
        nursery.cancel_scope.cancel()
    return out, engine


def check_books(engine: Engine) -> None:
    pages = engine.scheduler.pages
    pages.check([s.kv_pages for s in engine.scheduler.running.values()])
    assert pages.num_in_use == 0
    assert not pages.swap_out and not pages.swap_in
    if pages.tiers is not None:
        assert not pages.tiers.num_loading and not pages.tiers.num_unsettled


@pytest.fixture(scope="module")
def cold():
    """Each tenant's answer computed with no tiers, one engine per request (no hits)."""
    r = make_runner()
    return {t: trio.run(serve, r, [(t, 0, "")])[0][0] for t in range(6)}


async def test_host_tier_serves_evicted_prefixes(cold):
    runner = make_runner(host_bytes=200 * 4096)
    tenants = [(t, 0, "") for t in range(6)]
    # Six 12-page prompts through a 39-page pool: the first ones are evicted, down a tier.
    out, engine = await serve(runner, tenants + tenants[:3])
    tiers = engine.scheduler.pages.tiers
    for (t, _, _), got in zip(tenants + tenants[:3], out):
        assert got[0] == cold[t][0]
        np.testing.assert_allclose(got[1], cold[t][1], atol=1e-5)
    assert tiers.hit_tokens["host"] >= 3 * SYSTEM - 3 * PAGE
    assert tiers.copy_down_bytes > 0 and tiers.copy_up_bytes > 0
    check_books(engine)


async def test_disk_tier_survives_a_restart(tmp_path, cold, caplog):
    runner = make_runner(tmp_path, host_bytes=40 * 4096)
    await serve(runner, [(t, 0, "") for t in range(6)])
    runner.close()  # the disk writes finish
    assert len(runner.kv_store.disk) > 0
    again = make_runner(tmp_path, host_bytes=40 * 4096)
    out, engine = await serve(again, [(0, 0, ""), (1, 0, "")])
    tiers = engine.scheduler.pages.tiers
    assert tiers.hit_tokens["disk"] >= 2 * (SYSTEM - PAGE)
    for t, got in enumerate(out):
        assert got[0] == cold[t][0]
        np.testing.assert_allclose(got[1], cold[t][1], atol=1e-5)
    check_books(engine)
    # A different model (other weights) finds nothing of these.
    other = make_runner(tmp_path, host_bytes=40 * 4096, seed=1)
    _, engine = await serve(other, [(0, 0, "")])
    assert engine.scheduler.pages.tiers.hit_tokens == {"host": 0, "disk": 0, "remote": 0}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_cached_prefixes_are_written_to_disk_at_shutdown(tmp_path, cold):
    runner = make_runner(tmp_path, host_bytes=40 * 4096)
    _, engine = await serve(runner, [(0, 0, "")])  # nothing evicted: nothing on disk yet
    runner.kv_store.disk.flush()
    assert len(runner.kv_store.disk) == 0
    assert engine.persist_prefixes() >= SYSTEM // PAGE
    assert engine.persist_prefixes() == 0  # all there already
    runner.close()
    again = make_runner(tmp_path, host_bytes=40 * 4096)
    out, engine = await serve(again, [(0, 0, "")])
    assert engine.scheduler.pages.tiers.hit_tokens["disk"] >= SYSTEM - PAGE
    assert out[0][0] == cold[0][0]
    check_books(engine)


async def test_one_tenants_prefix_is_never_anothers_hit(tmp_path):
    runner = make_runner(tmp_path, host_bytes=40 * 4096)
    # Tenant a's prompt, pushed down to host and disk by five others; then tenant b
    # sends the very same tokens.
    reqs = [(0, 0, "a")] + [(t, 0, "a") for t in range(1, 6)] + [(0, 0, "b")]
    _, engine = await serve(runner, reqs)
    pages = engine.scheduler.pages
    assert pages.tiers.hit_tokens == {"host": 0, "disk": 0, "remote": 0}
    # The last request computed its whole prompt: no device hit either.
    assert pages.hit_tokens == 0
    check_books(engine)


def _files(tmp_path):
    return sorted(tmp_path.rglob("*.kv"))


async def test_bad_files_are_skipped_and_the_server_keeps_serving(tmp_path, cold, caplog):
    runner = make_runner(tmp_path, host_bytes=40 * 4096)
    await serve(runner, [(t, 0, "") for t in range(6)])
    runner.close()
    files = _files(tmp_path)
    assert len(files) >= 20
    # Corrupt one byte of some, truncate others, put another model's file under a name.
    for f in files[0::3]:
        data = bytearray(f.read_bytes())
        data[-7] ^= 0xFF
        f.write_bytes(bytes(data))
    for f in files[1::3]:
        f.write_bytes(f.read_bytes()[:100])
    caplog.set_level(logging.WARNING, logger="sluice.kv_disk")
    again = make_runner(tmp_path, host_bytes=40 * 4096)
    out, engine = await serve(again, [(t, 0, "") for t in range(6)])
    for t, got in enumerate(out):
        assert got[0] == cold[t][0]
    def warnings():
        return [r.getMessage() for r in caplog.records if r.name == "sluice.kv_disk"]

    # Once per kind of problem (corrupt, truncated), however many files had it.
    assert 1 <= len(warnings()) <= 2
    assert all("recomputed" in w for w in warnings())
    check_books(engine)
    # The folder removed while serving: still serving, said once.
    shutil.rmtree(tmp_path)
    out, engine2 = await serve(again, [(t, 1, "") for t in range(6)] + [(0, 0, "")])
    assert all(len(toks) == 6 for toks, _ in out)
    assert out[-1][0] == cold[0][0]
    again.kv_store.disk.flush()
    assert len(warnings()) <= 3
    check_books(engine2)
    disk = again.kv_store.disk.stats()
    assert disk["bytes"] <= disk["capacity_bytes"]


class FailingSwaps(FaultyRunner):
    """Fails the first step whose plan copies pages down (`swap_out`) or up (`swap_in`),
    before anything of it runs."""

    def __init__(self, inner, kind: str) -> None:
        super().__init__(inner)
        self.kind = kind

    def launch(self, plan):
        if not self.failed_steps and getattr(plan, self.kind):
            self.failed_steps += 1
            raise InjectedFault(f"injected failure of a step with a {self.kind}")
        return self.inner.launch(plan)


@pytest.mark.parametrize("kind", ["swap_out", "swap_in"])
async def test_a_failed_step_leaves_no_tier_page_that_was_never_copied(kind, cold):
    """A step that fails before its copies ran: the host slots it was to fill and the
    device pages it was to fill are forgotten, so no later request reads them."""
    runner = FailingSwaps(make_runner(host_bytes=200 * 4096), kind)
    tenants = [(t, 0, "") for t in range(6)]
    requests = tenants * 3  # each prefix evicted and hit again, twice, in one engine
    out, engine = await serve(runner, requests, errors=True)
    assert runner.failed_steps == 1 and 1 <= sum(o is None for o in out) <= 2
    for (t, _, _), got in zip(requests, out):
        assert got is None or got[0] == cold[t][0]
    assert engine.scheduler.pages.tiers.hit_tokens["host"] > 0
    check_books(engine)
