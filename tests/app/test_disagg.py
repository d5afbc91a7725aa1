"""Prefill and decode apart (app/disagg.py): a decode server whose prompts a prefill server
computes, both real hypercorn servers on the tiny random model (a real second process for
the kill test): the same tokens as one replica, pages already held not sent again,
cancellation on either side and a lost prefill server leave no page behind.

The wire format and the inbox alone first (model/kv_transfer.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgspec
import numpy as np
import pytest
import trio

from app import disagg, kv_wire
from app.bench.spawn import free_port, wait_healthy
from config.settings import BatchConfig, PoolConfig, SchedulerConfig, ServerConfig, Settings
from model import kv_transfer
from tests.app.test_faults import pages_in_use, settle
from tests.app.test_kv_tiers_server import metric
from tests.app.test_real_model import real_server

MODEL = "tiny"
SHAPE = (2, 2, 16, 2, 8)
PROMPTS = [f"Customer {i}: " + "the keeper opens the gates one at a time. " * (5 + 3 * i)
           for i in range(5)]


# -- the wire and the inbox --------------------------------------------------------------------
def test_pages_cross_the_wire_intact_and_a_wrong_one_is_refused():
    pages = np.random.default_rng(0).standard_normal((3, *SHAPE)).astype(np.float32)
    msg = kv_wire.encode(pages, fingerprint="fp", first_page=4)
    first, got = kv_wire.decode(msg, fingerprint="fp", page_shape=SHAPE,
                                       dtype=np.float32)
    assert first == 4 and np.array_equal(got, pages)
    with pytest.raises(kv_wire.WireError, match="another model"):
        kv_wire.decode(msg, fingerprint="other", page_shape=SHAPE, dtype=np.float32)
    with pytest.raises(kv_wire.WireError, match="pages of"):
        kv_wire.decode(msg, fingerprint="fp", page_shape=SHAPE, dtype=np.int8)
    broken = bytearray(msg)
    broken[len(msg) // 2] ^= 0xFF  # a payload byte
    with pytest.raises(kv_wire.WireError, match="checksum"):
        kv_wire.decode(bytes(broken), fingerprint="fp", page_shape=SHAPE,
                           dtype=np.float32)
    with pytest.raises(kv_wire.WireError, match="not a KV transfer"):
        kv_wire.decode(b"\x01garbage", fingerprint="fp", page_shape=SHAPE,
                           dtype=np.float32)


def test_the_inbox_gives_a_page_once_and_only_for_its_prefix():
    inbox = kv_transfer.Inbox()
    page = np.ones(SHAPE, np.float32)
    meta = (0, "salt", (1, 2, 3))
    inbox.deposit([(7, meta, page), (8, (7, "salt", (4, 5, 6)), page)])
    assert 7 in inbox and 8 in inbox and 9 not in inbox
    assert inbox.take(7, (0, "other tenant", (1, 2, 3))) is None  # a different salt
    assert inbox.take(7, meta) is page
    assert inbox.take(7, meta) is None and 7 not in inbox
    inbox.discard([8, 9])
    assert inbox.num_pages == 0
    assert inbox.inbox_stats() == {"pages": 0, "received_pages": 2, "taken_pages": 1,
                                   "dropped_pages": 1}


def test_the_prefill_server_with_least_ahead_goes_first_and_a_failed_one_last():
    cfg = pool("decode", prefill_urls=["http://a:1", "http://b:1", "http://c:1"])
    remote = disagg.RemotePrefill(SimpleNamespace(config=cfg, name="p", model_name="m"), None)
    remote.load = [(3, 1.0, 100), (0, 0.0, 50), (0, 0.0, 90)]  # (waiting, oldest s, free)
    assert remote._order() == [2, 1, 0]
    remote.in_flight[2] = 1  # one prompt of ours there, unanswered
    assert remote._order() == [1, 2, 0]
    remote.down_until[1] = time.monotonic() + 5
    assert remote._order() == [2, 0, 1]
    remote._note_load(0, {kv_wire.WAITING: "0", kv_wire.OLDEST: "0.0",
                          kv_wire.FREE_PAGES: "500"})
    assert remote._order() == [0, 2, 1]


# -- two servers -------------------------------------------------------------------------------
def pool(role: str = "both", **kw) -> PoolConfig:
    return PoolConfig(model="random:tiny", served_model_names=[MODEL], max_context=2048,
                      page_size=16, kv_cache_bytes=8 << 20, decode_buckets=[4],
                      prefill_buckets=[64], mixed_decode_buckets=[4], max_prefill_seqs=2,
                      dtype="float32", quantization="none", role=role,
                      scheduler=SchedulerConfig(max_running=4, ttft_target_s=0.0,
                                                queue_deadline_s=120.0), **kw)


def settings(p: PoolConfig) -> Settings:
    return Settings(server=ServerConfig(port=0, console=False), pools=[p],
                    batches=BatchConfig(enabled=False))


@asynccontextmanager
async def pair(prefill_url: str | None = None):
    """A prefill server (in this process, unless `prefill_url` names one) and a decode
    server sending it every prompt of 2 pages or more."""
    if prefill_url is None:
        async with real_server(settings(pool("prefill"))) as (purl, pstate):
            async with real_server(settings(pool("decode", prefill_urls=[purl],
                                                 remote_prefill_min_tokens=0))) as (url, state):
                yield url, state, pstate
    else:
        async with real_server(settings(pool("decode", prefill_urls=[prefill_url],
                                             remote_prefill_min_tokens=0))) as (url, state):
            yield url, state, None


async def complete(http: httpx.AsyncClient, prompt: str, max_tokens: int = 12) -> dict:
    r = await http.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def inbox_pages(state) -> int:
    return sum(e.runner.kv_store.inbox.num_pages for p in state.router.pools
               for e in p.engines if p.config.role == "decode")


async def test_tokens_equal_one_replica_and_held_pages_are_not_sent_again():
    async with real_server(settings(pool())) as (url, state):  # one replica, both roles
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            alone = [(await complete(http, p))["choices"][0]["text"] for p in PROMPTS]
    async with pair() as (url, state, pstate):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            apart = [(await complete(http, p))["choices"][0]["text"] for p in PROMPTS]
            assert apart == alone
            text = (await http.get("/metrics")).text
            assert metric(text, "sluice:remote_prefill_requests_total", outcome="ok") == 5
            sent = metric(text, "sluice:kv_transfer_bytes_total", direction="received")
            remote = metric(text, "sluice:prefix_cache_hits_by_tier_total", tier="remote")
            assert sent > 0 and remote >= sum(len(p) // 16 * 16 for p in PROMPTS) - 5 * 16
            assert 'role="decode"' in text
            # The same prompt again is cached here: not sent. A longer one sharing its
            # start: only the pages past the shared ones cross.
            again = await complete(http, PROMPTS[4])
            assert again["choices"][0]["text"] == alone[4]
            text = (await http.get("/metrics")).text
            assert metric(text, "sluice:kv_transfer_bytes_total", direction="received") == sent
            longer = PROMPTS[4] + " and closes them at night. " * 10
            await complete(http, longer)
            text = (await http.get("/metrics")).text
            more = metric(text, "sluice:kv_transfer_bytes_total", direction="received") - sent
            page_bytes = state.router.pools[0].engines[0].runner.kv_store.page_bytes
            assert 0 < more < page_bytes * (len(longer) - len(PROMPTS[4]) + 32) // 16 + 4096
            await settle(state)
            await settle(pstate)
            assert pages_in_use(state) == 0 and pages_in_use(pstate) == 0
            assert inbox_pages(state) == 0
            ptext = (await httpx.AsyncClient(base_url=str(
                state.router.pools[0].remote.urls[0])).get("/metrics")).text
            assert metric(ptext, "sluice:kv_transfer_bytes_total", direction="sent") > 0


async def test_a_prefill_pool_in_the_same_server_computes_the_decode_pools_prompts():
    async with real_server(settings(pool())) as (url, state):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            alone = [(await complete(http, p))["choices"][0]["text"] for p in PROMPTS]
    both = Settings(server=ServerConfig(port=0, console=False), batches=BatchConfig(
        enabled=False), pools=[
            msgspec.structs.replace(pool("prefill"), name="prefill"),
            msgspec.structs.replace(pool("decode", prefill_urls=["pool:prefill"],
                                         remote_prefill_min_tokens=0), name="decode")])
    async with real_server(both) as (url, state):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            apart = [(await complete(http, p))["choices"][0]["text"] for p in PROMPTS]
            assert apart == alone
            text = (await http.get("/metrics")).text
            await settle(state)
        assert metric(text, "sluice:remote_prefill_requests_total", outcome="ok") == 5
        assert metric(text, "sluice:kv_transfer_bytes_total", direction="received") > 0
        prefill, decode = state.router.pools
        # Clients went to the decode pool; the prefill pool only computed its prompts.
        assert sum(s.generation_tokens for s in prefill.stats()) == 5
        assert sum(s.generation_tokens for s in decode.stats()) == 5 * 12
        # Several prompts at once: the prefill pool computes their chunks in shared steps.
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(complete, http, f"batch {i} " + PROMPTS[4], 2)
        await settle(state)
        assert any(len(r.prefilled) >= 2 for r in prefill.engines[0].step_records)
        assert pages_in_use(state) == 0 and inbox_pages(state) == 0
        # The pages went straight into the decode pool (device hits), not through the host.
        assert decode.engines[0].runner.kv_store.inbox.received_pages == 0
        assert sum(s.prefix_cache_hits_tokens for s in decode.stats()) >= sum(
            len(p) // 16 * 16 for p in PROMPTS) - 5 * 16


def test_pools_on_their_own_devices_move_pages_device_to_device():
    """A prefill pool on devices 0-1 and a decode pool on 2-3 of one server (tensor
    parallel over each pair): the pages go onto the decode pool's sharding and into its
    pool (device hits, nothing through the host inbox), the answers as one pool's."""
    from tests.model.test_tp import run_forced

    (report,) = run_forced("tests.app.disagg_devices_check")
    assert report["prefill_kv_devices"] == [0, 1] and report["decode_kv_devices"] == [2, 3]
    assert report["apart"] == report["alone"]
    assert report["inbox_received"] == 0
    assert report["decode_prefix_hits"] >= sum(len(p) // 16 * 16 for p in PROMPTS) - 5 * 16


def test_a_decode_pool_names_a_prefill_pool_of_its_model():
    decode = pool("decode", prefill_urls=["pool:pre"])
    with pytest.raises(ValueError, match="pool:pre is not a pool of role"):
        Settings(pools=[decode])
    with pytest.raises(ValueError, match="pool:pre is not a pool of role"):
        Settings(pools=[msgspec.structs.replace(pool(), name="pre"), decode])
    Settings(pools=[msgspec.structs.replace(pool("prefill"), name="pre"), decode])
    with pytest.raises(ValueError, match="needs prefill_urls"):
        pool("decode")


async def test_a_burst_on_a_new_system_prompt_prefills_it_once():
    """Eight requests at once sharing a new system prompt: the first one's prefill
    brings its pages, the others wait for them and then ask only for their own
    question's; the answers are one replica's."""
    system = "You answer for the gatekeepers' guild. " * 12
    questions = [f"{system}Question {i}: when do the gates open?" for i in range(8)]
    async with real_server(settings(pool())) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            alone = [(await complete(http, q, 6))["choices"][0]["text"] for q in questions]
    async with pair() as (url, state, pstate):
        slow_steps(pstate, 0.02)
        got: dict[int, str] = {}
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async def ask(i: int) -> None:
                got[i] = (await complete(http, questions[i], 6))["choices"][0]["text"]

            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(ask, i)
            text = (await http.get("/metrics")).text
        assert [got[i] for i in range(8)] == alone
        # The system prompt's pages crossed once; each other request asked only for the
        # full pages of its own question (two, past the threshold of this pair).
        assert metric(text, "sluice:remote_prefill_requests_total", outcome="ok") == 8
        pages = len(questions[0]) // 16  # (one token a character)
        received = state.router.pools[0].engines[0].runner.kv_store.inbox.received_pages
        assert pages <= received <= pages + 7 * 3
        await settle(state)
        assert pages_in_use(state) == 0 and inbox_pages(state) == 0


def slow_steps(state, seconds: float) -> None:
    """Every step of the server's runners takes `seconds` longer (in the step's thread)."""
    for p in state.router.pools:
        for e in p.engines:
            launch = e.runner.launch

            def slow(plan, launch=launch):
                time.sleep(seconds)
                return launch(plan)
            e.runner.launch = slow


async def test_cancel_during_prefill_and_during_decode_leaves_no_page_on_either_side():
    async with pair() as (url, state, pstate):
        slow_steps(pstate, 0.05)  # a prompt of 30 pages: ~30 slow steps there
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            prompt = "one two three four five six seven eight " * 20
            with trio.move_on_after(30):
                async with trio.open_nursery() as nursery:
                    async def go():
                        await complete(http, prompt, max_tokens=50)
                    nursery.start_soon(go)
                    while not any(s.running for s in pstate.router.pools[0].stats()):
                        await trio.sleep(0.005)
                    nursery.cancel_scope.cancel()  # the client leaves during the prefill
            await settle(pstate)
            await settle(state)
            assert pages_in_use(pstate) == 0 and pages_in_use(state) == 0
            assert inbox_pages(state) == 0
            text = (await httpx.AsyncClient(base_url=state.router.pools[0].remote.urls[0])
                    .get("/metrics")).text
            assert metric(text, "sluice:requests_rejected_total") == 0

            # During decode: a streamed answer read for a few tokens, then the client goes.
            body = {"model": MODEL, "prompt": prompt + " again", "max_tokens": 400,
                    "stream": True, "temperature": 0, "ignore_eos": True}
            got = 0
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        got += 1
                        if got == 3:
                            break
            await settle(state)
            await settle(pstate)
            assert pages_in_use(state) == 0 and pages_in_use(pstate) == 0
            assert inbox_pages(state) == 0
            text = (await http.get("/metrics")).text
            assert metric(text, "sluice:remote_prefill_requests_total", outcome="ok") >= 1


async def test_a_decode_server_short_of_pages_refuses_before_the_prefill():
    async with real_server(settings(pool("prefill"))) as (purl, pstate):
        small = pool("decode", prefill_urls=[purl], remote_prefill_min_tokens=0)
        small = msgspec.structs.replace(small, kv_cache_bytes=40 * 16 * 2048)  # ~40 pages
        async with real_server(settings(small)) as (url, state):
            engine = state.router.pools[0].engines[0]
            hold = engine.scheduler.pages.allocate(engine.scheduler.pages.num_available - 4)
            try:
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    r = await http.post("/v1/completions", json={
                        "model": MODEL, "prompt": PROMPTS[4], "max_tokens": 4})
                    assert r.status_code == 429 and "Retry-After" in r.headers, r.text
                    assert r.json()["error"]["code"] == "kv_full"
            finally:
                engine.scheduler.pages.release(hold)
            ptext = (await httpx.AsyncClient(base_url=purl).get("/metrics")).text
            assert metric(ptext, "sluice:prompt_tokens_total") == 0  # never prefilled


async def test_bad_asks_get_openai_shaped_errors_and_a_full_prefill_server_a_429():
    full = msgspec.structs.replace(pool("prefill"), scheduler=SchedulerConfig(
        max_running=4, max_waiting=0, ttft_target_s=0.0))  # every prompt refused
    async with real_server(settings(full)) as (purl, pstate):
        async with httpx.AsyncClient(base_url=purl, timeout=30) as ph:
            for body, status, param in (
                    (b"\x01not msgpack", 400, None),
                    (msgspec.msgpack.encode({"model": "nope", "prompt_ids": [1, 2]}), 404,
                     "model"),
                    (msgspec.msgpack.encode({"model": MODEL, "prompt_ids": []}), 400,
                     "prompt_ids"),
                    (msgspec.msgpack.encode({"model": MODEL, "prompt_ids": [1, 10 ** 9]}),
                     400, "prompt_ids")):
                r = await ph.post(kv_wire.PATH, content=body)
                assert r.status_code == status, r.text
                assert r.json()["error"]["param"] == param, r.text
            r = await ph.post(kv_wire.PATH, content=msgspec.msgpack.encode(
                {"model": MODEL, "prompt_ids": list(range(40))}))
            assert r.status_code == 429 and "Retry-After" in r.headers, r.text
            assert kv_wire.WAITING in r.headers  # its load, for the decode servers' choice
        decode = pool("decode", prefill_urls=[purl], remote_prefill_min_tokens=0)
        async with real_server(settings(decode)) as (url, state):
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                r = await http.post("/v1/completions", json={
                    "model": MODEL, "prompt": PROMPTS[2], "max_tokens": 4})
                assert r.status_code == 429 and "Retry-After" in r.headers, r.text
                assert r.json()["error"]["code"] == "prefill_busy"
                await complete(http, "short")  # computed here: the server goes on
            await settle(state)
            assert pages_in_use(state) == 0 and pages_in_use(pstate) == 0


# -- a real second process ---------------------------------------------------------------------
PREFILL_TOML = """
[[pools]]
model = "random:tiny"
served_model_names = ["tiny"]
max_context = 2048
kv_cache_bytes = 8388608
decode_buckets = [4]
prefill_buckets = [16]
mixed_decode_buckets = [4]
max_prefill_seqs = 1
dtype = "float32"
quantization = "none"
role = "prefill"
warmup = "full"
[pools.scheduler]
max_running = 4
ttft_target_s = 0.0
[batches]
enabled = false
"""


async def test_killing_the_prefill_process_mid_request_errors_nothing_and_leaks_nothing(
        tmp_path):
    cfg = tmp_path / "prefill.toml"
    cfg.write_text(PREFILL_TOML)
    log = tmp_path / "prefill.log"
    port = free_port()
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "app.cli", "serve", "--config", str(cfg), "--port", str(port)],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    purl = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(purl, proc, 300, log)
        async with pair(purl) as (url, state, _):
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                # A stream already decoding here is not the prefill server's business.
                streaming = trio.Event()
                results: dict[str, list] = {"stream": [], "prompts": []}

                async def stream_one():
                    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200,
                            "stream": True, "temperature": 0, "ignore_eos": True}
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                results["stream"].append(line[6:])
                                streaming.set()

                async def long_prompt(i: int):
                    r = await http.post("/v1/completions", json={
                        "model": MODEL, "prompt": f"{i} " + "gates and keepers " * 90,
                        "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                    results["prompts"].append(r.status_code)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(stream_one)
                    await streaming.wait()
                    for i in range(3):
                        nursery.start_soon(long_prompt, i)
                    async with httpx.AsyncClient(base_url=purl, timeout=5) as ph:
                        with trio.fail_after(60):  # until the prefill server computes them
                            while True:
                                m = (await ph.get("/metrics")).text
                                if metric(m, "sluice:num_requests_running") > 0:
                                    break
                                await trio.sleep(0.01)
                    proc.send_signal(signal.SIGKILL)
                # The prompts it held were computed here instead; the stream went on.
                assert results["prompts"] == [200, 200, 200]
                assert results["stream"][-1] == "[DONE]"
                assert json.loads(results["stream"][-2])["choices"][0]["finish_reason"]
                text = (await http.get("/metrics")).text
                assert metric(text, "sluice:remote_prefill_requests_total",
                              outcome="local") >= 1
                # And it keeps serving without it.
                assert (await complete(http, PROMPTS[3]))["choices"][0]["text"]
                await settle(state)
                assert pages_in_use(state) == 0 and inbox_pages(state) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        assert Path(log).exists()
