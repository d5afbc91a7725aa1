"""LoRA adapters through the HTTP layer, on the fake runner (tests/app/harness.py): admin
endpoints, model names, tenant allow-lists, unloading under load, metrics.

The fake runner adds `adapter_offset(name)` to every token a sequence samples under an
adapter, so a stream's tokens show which adapter (if any) it really ran under."""

from __future__ import annotations

from functools import partial

import msgspec
import trio

from config.settings import AdapterConfig, TenantConfig
from tests.scheduler.fake_runner import adapter_offset

from .harness import CHAT_MARKER, MODEL, VOCAB, assert_error, serve, settings, sha, sse_events

ADMIN = "admin-key"


def expected(name: str | None, n: int) -> list[int]:
    """Token ids a chat answer of n tokens runs to under `name` (succ rule + offset)."""
    out, last = [], CHAT_MARKER
    for _ in range(n):
        last = (last + 1 + adapter_offset(name)) % VOCAB
        out.append(last)
    return out


def chat(model: str, n: int = 4, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": n,
            "temperature": 0, **kw}


def lora_settings(tmp_path, slots=2, declared=("alpha",), **kw):
    paths = {}
    for name in ("alpha", "beta", "gamma"):
        (tmp_path / name).mkdir(exist_ok=True)
        paths[name] = str(tmp_path / name)
    adapters = [AdapterConfig(n, paths[n]) for n in declared]
    return settings(pool={"max_loras": slots, "adapters": adapters}, admin_key=ADMIN,
                    **kw), paths


def letters(name: str | None, n: int) -> str:
    return "".join(chr(ord("a") + t % 26) for t in expected(name, n))


async def test_declared_adapter_is_listed_with_its_parent_and_served_by_name(tmp_path):
    cfg, paths = lora_settings(tmp_path)
    async with serve(cfg) as srv, srv.client() as c:
        models = (await c.get("/v1/models")).json()["data"]
        by_id = {m["id"]: m for m in models}
        assert by_id["alpha"]["parent"] == MODEL and by_id["alpha"]["root"] == paths["alpha"]
        assert by_id[MODEL]["parent"] is None
        r = await c.post("/v1/chat/completions", json=chat("alpha"))
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "alpha"
        assert r.json()["choices"][0]["message"]["content"] == letters("alpha", 4)
        base = await c.post("/v1/chat/completions", json=chat(MODEL))
        assert base.json()["choices"][0]["message"]["content"] == letters(None, 4)

        client = srv.openai()
        stream = await client.chat.completions.create(
            model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            temperature=0, stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream
                        if ch.choices])
        assert text == letters("alpha", 5)
        await client.close()
        await srv.wait_idle()
        assert srv.pages_in_use() == 0


async def test_admin_endpoints_need_the_admin_key(tmp_path):
    tenant = TenantConfig(name="t", api_key_sha256=sha("tenant-key"))
    cfg, paths = lora_settings(tmp_path, tenants=[tenant])
    body = {"lora_name": "beta", "lora_path": paths["beta"]}
    async with serve(cfg) as srv, srv.client() as c:
        load = "/v1/load_lora_adapter"
        assert_error(await c.post(load, json=body), 401, code="missing_api_key")
        assert_error(await c.post(load, json=body, headers={"Authorization": "Bearer nope"}),
                     401, code="invalid_api_key")
        assert_error(await c.post(load, json=body,
                                  headers={"Authorization": "Bearer tenant-key"}),
                     403, type="permission_error", code="admin_required")
        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = await c.post(load, json=body, headers=admin)
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "beta" and r.json()["parent"] == MODEL
        assert_error(await c.post(load, json=body, headers=admin), 400, code="lora_exists")
        assert_error(await c.post(load, json={"lora_name": MODEL, "lora_path": paths["beta"]},
                                  headers=admin), 400, code="lora_exists")
        assert_error(await c.post(load, json={"lora_name": "x", "lora_path": "/nowhere"},
                                  headers=admin), 400, code="invalid_lora", param="lora_path")
        assert_error(await c.post(load, json={"lora_name": "x"}, headers=admin), 400)
        assert_error(await c.post("/v1/unload_lora_adapter", json={"lora_name": "zzz"},
                                  headers=admin), 404, code="lora_not_found")
        key = {"Authorization": "Bearer tenant-key"}
        r = await c.post("/v1/chat/completions", json=chat("beta"), headers=key)
        assert r.json()["choices"][0]["message"]["content"] == letters("beta", 4)
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "beta"}, headers=admin)
        assert r.status_code == 200, r.text
        assert_error(await c.post("/v1/chat/completions", json=chat("beta"), headers=key),
                     404, code="model_not_found")
        assert "beta" not in {m["id"] for m in (await c.get("/v1/models", headers=key)
                                                ).json()["data"]}


async def test_without_an_admin_key_configured_loading_is_off(tmp_path):
    cfg, paths = lora_settings(tmp_path)
    cfg = msgspec.structs.replace(cfg, server=msgspec.structs.replace(
        cfg.server, admin_api_key_sha256=None))
    async with serve(cfg) as srv, srv.client() as c:
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/x"},
                         headers={"Authorization": "Bearer anything"})
        assert_error(r, 403, code="admin_disabled")


async def test_unknown_adapter_404_and_tenant_allow_list_403(tmp_path):
    tenants = [TenantConfig(name="a", api_key_sha256=sha("ka"), adapters=["alpha"]),
               TenantConfig(name="b", api_key_sha256=sha("kb"), adapters=[])]
    cfg, _ = lora_settings(tmp_path, declared=("alpha", "beta"), tenants=tenants)
    async with serve(cfg) as srv, srv.client() as c:
        ka, kb = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
        err = assert_error(await c.post("/v1/chat/completions", json=chat("nope"), headers=ka),
                           404, code="model_not_found", param="model")
        assert "alpha" in err["message"]  # the adapters are among the models it lists
        assert (await c.post("/v1/chat/completions", json=chat("alpha"), headers=ka)
                ).status_code == 200
        assert_error(await c.post("/v1/chat/completions", json=chat("beta"), headers=ka),
                     403, type="permission_error", code="adapter_not_allowed")
        assert_error(await c.post("/v1/chat/completions", json=chat("alpha"), headers=kb),
                     403, code="adapter_not_allowed")
        assert (await c.post("/v1/chat/completions", json=chat(MODEL), headers=kb)
                ).status_code == 200


async def test_unloading_an_adapter_in_use_lets_its_streams_finish(tmp_path):
    cfg, paths = lora_settings(tmp_path)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with serve(cfg, step_delay_s=0.01) as srv, srv.client() as c:
        runner = srv.pool.engines[0].runner
        results = {}

        async def stream(i):
            r = await c.post("/v1/chat/completions", json=chat("alpha", 40, stream=True))
            results[i] = r

        async with trio.open_nursery() as n:
            for i in range(3):
                n.start_soon(stream, i)
            with trio.fail_after(5):
                while srv.pool.stats()[0].running < 3:
                    await trio.sleep(0.005)
            r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "alpha"},
                             headers=admin)
            assert r.status_code == 200
            assert_error(await c.post("/v1/chat/completions", json=chat("alpha")), 404)
            assert_error(await c.post("/v1/load_lora_adapter", headers=admin, json={
                "lora_name": "alpha", "lora_path": paths["alpha"]}), 400, code="lora_retiring")
            assert runner.dropped == []  # still in use
        for r in results.values():
            events = sse_events(r.text)
            assert events[-1] == "[DONE]" and '"finish_reason":"length"' in events[-2]
        await srv.wait_idle()
        assert runner.dropped == ["alpha"]
        assert srv.pool.stats()[0].adapters["resident"] == []
        r = await c.post("/v1/load_lora_adapter", headers=admin,
                         json={"lora_name": "alpha", "lora_path": paths["alpha"]})
        assert r.status_code == 200, r.text
        r = await c.post("/v1/chat/completions", json=chat("alpha"))
        assert r.json()["choices"][0]["message"]["content"] == letters("alpha", 4)


async def test_more_adapters_than_slots_wait_and_never_fail(tmp_path):
    """One slot, three adapters and the base, 12 streams at once: every answer is its own
    adapter's, and the metrics count the swaps and each adapter's requests and tokens."""
    cfg, _ = lora_settings(tmp_path, slots=1, declared=("alpha", "beta", "gamma"))
    async with serve(cfg, step_delay_s=0.002) as srv, srv.client() as c:
        names = [None, "alpha", "beta", "gamma"] * 3
        got = {}

        async def one(i, name):
            r = await c.post("/v1/chat/completions", json=chat(name or MODEL, 6))
            assert r.status_code == 200, r.text
            got[i] = r.json()["choices"][0]["message"]["content"]

        async with trio.open_nursery() as n:
            for i, name in enumerate(names):
                n.start_soon(one, i, name)
        for i, name in enumerate(names):
            assert got[i] == letters(name, 6), (i, name)
        await srv.wait_idle()
        stats = srv.pool.stats()[0].adapters
        assert stats["swaps"] >= 2 and stats["running"] == {} and stats["waiting"] == {}
        text = (await c.get("/metrics")).text
        assert 'sluice:lora_requests_total{adapter="beta",model="fake-model",pool="test"} 3.0' \
            in text
        assert 'sluice:lora_generation_tokens_total{adapter="gamma",model="fake-model",' \
            'pool="test"} 18.0' in text
        info = [line for line in text.splitlines()
                if line.startswith("sluice:lora_requests_info{")]
        assert len(info) == 1 and 'max_lora="1"' in info[0]
        assert 'running_lora_adapters=""' in info[0]
        assert "sluice:lora_slot_swaps_total" in text
        assert srv.pages_in_use() == 0


async def test_lora_info_names_running_and_waiting_adapters(tmp_path):
    cfg, _ = lora_settings(tmp_path, slots=1, declared=("alpha", "beta"))
    async with serve(cfg, step_delay_s=0.01) as srv, srv.client() as c:
        async with trio.open_nursery() as n:
            for name, tokens in (("alpha", 150), ("beta", 30)):
                n.start_soon(partial(c.post, "/v1/chat/completions", json=chat(name, tokens)))
                await trio.sleep(0.05)
            # beta's request may reach the scheduler a moment after alpha shows as
            # running on a loaded host: wait for one scrape that shows both.
            with trio.fail_after(10):
                while True:
                    text = (await c.get("/metrics")).text
                    if 'running_lora_adapters="alpha"' in text \
                            and 'waiting_lora_adapters="beta"' in text:
                        break
                    await trio.sleep(0.01)
