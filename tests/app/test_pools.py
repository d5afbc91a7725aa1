"""Router (model name, prompt length, context) and replica choice inside a pool."""

from __future__ import annotations

import pytest

from app.errors import APIError
from app.pools import Pool, Router
from config.settings import PoolConfig
from scheduler.api import EngineDead, GenerateRequest, Overloaded
from tests.app.harness import FakeTokenizer


class StubEngine:
    def __init__(self, refuse: Exception | None = None) -> None:
        self.refuse = refuse
        self.alive = True
        self.submitted: list[GenerateRequest] = []
        self.aborted: list[str] = []

    def submit(self, req: GenerateRequest, events=None):
        if self.refuse is not None:
            raise self.refuse
        self.submitted.append(req)
        return req.request_id

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def pool(name: str, names: list[str], context: int, engines=None, **cfg) -> Pool:
    return Pool(PoolConfig(name=name, served_model_names=names, **cfg), FakeTokenizer(),
                engines or [StubEngine()], max_context=context, vocab_size=1000)


def test_router_by_name_then_prompt_length_then_context():
    short = pool("short", ["m", "m-alias"], 256, max_prompt_tokens=100)
    long = pool("long", ["m"], 4096, min_prompt_tokens=101)
    other = pool("other", ["x"], 512)
    router = Router([short, long, other])
    assert router.candidates("m-alias") == [short]
    assert router.candidates(None) == [short, long]  # the first pool's model
    assert router.choose([short, long], 50, 100) is short
    assert router.choose([short, long], 50, 300) is long  # too long for short's context
    assert router.choose([short, long], 500, 1000) is long
    with pytest.raises(APIError) as e:
        router.choose([short, long], 4000, 200)
    assert e.value.status == 400 and "4096" in str(e.value) and "4200" in str(e.value)
    with pytest.raises(APIError) as e:
        router.candidates("nope")
    assert e.value.status == 404 and e.value.detail.param == "model"
    assert "m, m-alias, x" in str(e.value)


def test_pool_prefers_the_least_busy_live_replica_and_falls_through_refusals():
    a, b, c = StubEngine(), StubEngine(), StubEngine()
    p = pool("p", ["m"], 256, engines=[a, b, c])
    req = GenerateRequest([1], 1, request_id="r1")
    assert p.submit(req) == (0, "r1")
    assert p.submit(GenerateRequest([1], 1, request_id="r2")) == (1, "r2")
    p.finish(0, "r1")
    assert a.aborted == ["r1"]  # finish always aborts: a no-op for a finished request
    assert p.submit(GenerateRequest([1], 1, request_id="r3")) == (0, "r3")
    a.refuse = Overloaded("queue_full", 2.0)
    b.refuse = Overloaded("queue_full", 0.5)
    c.alive = False
    with pytest.raises(Overloaded) as e:
        p.submit(GenerateRequest([1], 1, request_id="r4"))
    assert e.value.retry_after_s == 0.5  # the soonest any replica expects room
    a.refuse = b.refuse = EngineDead("x")
    with pytest.raises(EngineDead):
        p.submit(GenerateRequest([1], 1, request_id="r5"))
