"""Tenants: hashed Bearer keys, priority classes, concurrency limits and token quotas."""

from __future__ import annotations

import time

import pytest
import trio

from app.errors import APIError
from app.tenants import Tenants, TokenBucket
from config.settings import TenantConfig
from tests.app.harness import MODEL, assert_error, serve, settings, sha


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def test_token_bucket_refills_and_waits():
    clock = Clock()
    b = TokenBucket(rate_per_s=10, capacity=100, clock=clock)
    assert b.wait_s(100) == 0
    b.charge(100)
    assert b.wait_s(30) == pytest.approx(3.0)
    clock.t += 1
    assert b.wait_s(30) == pytest.approx(2.0)
    b.refund(1000)
    assert b.level == 100  # never above capacity
    # Bigger than the bucket: admitted once the bucket is full, leaving it in debt.
    assert b.wait_s(500) == 0
    b.charge(500)
    assert b.wait_s(1) == pytest.approx(40.1)


def test_authenticate_and_admit():
    clock = Clock()
    t = Tenants([TenantConfig("a", sha("key-a"), max_concurrency=1, tokens_per_minute=600)],
                clock)
    with pytest.raises(APIError) as e:
        t.authenticate(None)
    assert e.value.status == 401 and e.value.detail.code == "missing_api_key"
    with pytest.raises(APIError) as e:
        t.authenticate("Bearer nope")
    assert e.value.detail.code == "invalid_api_key"
    a = t.authenticate("Bearer key-a")
    assert a.name == "a" and t.authenticate("bearer  key-a ") is a
    lease = t.admit(a, 500)
    with pytest.raises(APIError) as e:  # one in flight already
        t.admit(a, 1)
    assert e.value.status == 429 and e.value.detail.code == "tenant_concurrency"
    lease.release(used_tokens=100)  # 400 refunded: 500 left
    lease.release(used_tokens=100)  # idempotent
    assert a.in_flight == 0 and a.bucket.level == pytest.approx(500)
    lease = t.admit(a, 500)
    lease.release(used_tokens=500)
    with pytest.raises(APIError) as e:  # the bucket is empty: 10 tokens a second come back
        t.admit(a, 100)
    assert e.value.detail.code == "tenant_tokens_per_minute"
    assert e.value.headers == {"retry-after-ms": "10000", "Retry-After": "10"}


def test_no_tenants_means_anonymous_whatever_the_header():
    t = Tenants([])
    for header in (None, "", "Bearer x", "Basic Zm9vOmJhcg==", "garbage"):
        assert t.authenticate(header).name == "anonymous"


GOLD = TenantConfig("gold", sha("gold-key"), priority=0, max_concurrency=8)
FREE = TenantConfig("free", sha("free-key"), priority=5, max_concurrency=2)
METERED = TenantConfig("metered", sha("metered-key"), tokens_per_minute=600)


def hdr(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def test_keys_limits_and_401_over_http():
    async with serve(settings(tenants=[GOLD, FREE, METERED]), step_delay_s=0.001) as srv, \
            srv.client() as http:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 3}
        assert_error(await http.post("/v1/completions", json=body), 401,
                     type="authentication_error", code="missing_api_key")
        assert_error(await http.post("/v1/completions", json=body, headers=hdr("bad")), 401,
                     type="authentication_error", code="invalid_api_key")
        assert_error(await http.get("/v1/models", headers=hdr("bad")), 401)
        assert (await http.get("/health")).status_code == 200  # open for load balancers
        r = await http.post("/v1/completions", json=body, headers=hdr("gold-key"))
        assert r.status_code == 200, r.text

        # free may have 2 in flight: a third concurrent one is refused at once.
        long = {**body, "max_tokens": 300, "stream": True}
        async with http.stream("POST", "/v1/completions", json=long,
                               headers=hdr("free-key")) as r1, \
                http.stream("POST", "/v1/completions", json=long,
                            headers=hdr("free-key")) as r2:
            assert (r1.status_code, r2.status_code) == (200, 200)
            r3 = await http.post("/v1/completions", json=body, headers=hdr("free-key"))
            err = assert_error(r3, 429, type="rate_limit_error", code="tenant_concurrency")
            assert "free" in err["message"] and r3.headers["retry-after-ms"] == "500"
            # gold is not affected by free's limit
            r = await http.post("/v1/completions", json=body, headers=hdr("gold-key"))
            assert r.status_code == 200
        # metered's quota: 600 tokens a minute (10 a second), charged prompt + max_tokens.
        once = {"model": MODEL, "prompt": "abc", "max_tokens": 500}
        r = await http.post("/v1/completions", json=once, headers=hdr("metered-key"))
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 503
        r = await http.post("/v1/completions", json=once, headers=hdr("metered-key"))
        err = assert_error(r, 429, type="rate_limit_error", code="tenant_tokens_per_minute")
        wait_ms = int(r.headers["retry-after-ms"])  # (503 - ~97 left) / 10 a second
        assert 35_000 < wait_ms <= 41_000, wait_ms
        assert r.headers["Retry-After"] == str(-(-wait_ms // 1000))
        assert "600 tokens per minute" in err["message"]
        metrics = (await http.get("/metrics")).text
        assert 'reason="tenant_tokens_per_minute"' in metrics
        assert 'reason="tenant_concurrency"' in metrics


async def test_priority_class_orders_the_queue():
    cfg = settings(tenants=[GOLD, FREE], max_running=1)
    done: list[str] = []
    async with serve(cfg, step_delay_s=0.01) as srv, srv.client() as http:

        async def run(name: str, key: str, max_tokens: int, priority: int | None = None,
                      started: trio.Event | None = None) -> None:
            body = {"model": MODEL, "prompt": name, "max_tokens": max_tokens,
                    "stream": True}
            if priority is not None:
                body["priority"] = priority
            async with http.stream("POST", "/v1/completions", json=body,
                                   headers=hdr(key)) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if started is not None and line.startswith("data: "):
                        started.set()
            done.append(name)

        async with trio.open_nursery() as nursery:
            first = trio.Event()
            nursery.start_soon(run, "free-1", "free-key", 20, None, first)
            await first.wait()  # free-1 runs; the next two wait for the one slot
            nursery.start_soon(run, "free-2", "free-key", 3, -100)  # asks to jump: clamped
            await trio.sleep(0.05)
            nursery.start_soon(run, "gold-1", "gold-key", 3)
    assert done == ["free-1", "gold-1", "free-2"]


async def test_no_tenants_configured_any_header_is_anonymous():
    async with serve() as srv, srv.client() as http:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 2}
        for headers in ({}, hdr("whatever"), {"Authorization": "Basic abc"}):
            r = await http.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text


async def test_tenant_max_running_queues_instead_of_refusing():
    """`max_running` holds a tenant to one running sequence per replica: its other
    requests wait in the queue (unlike max_concurrency, no 429) and all complete, one
    at a time."""
    queued = TenantConfig("queued", sha("queued-key"), max_running=1)
    async with serve(settings(tenants=[queued]), step_delay_s=0.002) as srv, \
            srv.client() as http:
        running = []

        def watch(plan):
            running.append(len({c.seq_id for c in plan.chunks}))
            time.sleep(0.002)

        srv.pool.engines[0].runner.on_step = watch
        results = []

        async def one(i: int) -> None:
            body = {"model": MODEL, "prompt": f"q{i}", "max_tokens": 5}
            r = await http.post("/v1/completions", json=body, headers=hdr("queued-key"))
            results.append(r.status_code)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
    assert results == [200, 200, 200]
    assert running and max(running) == 1


async def test_tenant_queue_deadline_sheds_its_waiting_requests():
    """A tenant's own `queue_deadline_s` overrides the pool's: stuck behind a long
    answer, its next request is shed with a 429 once it has waited that long."""
    impatient = TenantConfig("impatient", sha("imp-key"), max_running=1, queue_deadline_s=0.2)
    async with serve(settings(tenants=[impatient]), step_delay_s=0.01) as srv, \
            srv.client() as http:
        long = {"model": MODEL, "prompt": "long", "max_tokens": 200, "stream": True}
        async with http.stream("POST", "/v1/completions", json=long,
                               headers=hdr("imp-key")) as r1:
            assert r1.status_code == 200
            r2 = await http.post("/v1/completions", headers=hdr("imp-key"),
                                 json={"model": MODEL, "prompt": "next", "max_tokens": 3})
            assert_error(r2, 429, type="rate_limit_error")
            assert "waited" in r2.json()["error"]["message"]
        await srv.wait_idle()
        assert srv.pages_in_use() == 0
