"""The console's server side: static pages and their caching, and GET /v1/stats (fake runner).

The pages themselves are driven in a real browser in test_console_browser.py.
"""

from __future__ import annotations

import re

import trio

from tests.app.harness import MODEL, assert_error, serve, settings, sha
from config.settings import TenantConfig


async def test_pages_are_served_with_hashed_files_and_cache_headers():
    async with serve() as srv, srv.client() as c:
        for path, marker in (("/", 'id="conversation"'), ("/dashboard", 'id="pools"')):
            r = await c.get(path)
            assert r.status_code == 200 and marker in r.text
            assert r.headers["content-type"].startswith("text/html")
            assert r.headers["cache-control"] == "no-cache"
            assert "default-src 'self'" in r.headers["content-security-policy"]
            again = await c.get(path, headers={"If-None-Match": r.headers["etag"]})
            assert again.status_code == 304 and not again.content
        page = (await c.get("/dashboard")).text
        links = re.findall(r'"/static/([\w./-]+)\?v=(\w+)"', page)
        assert {name for name, _ in links} >= {"dashboard.js", "common.js", "console.css",
                                              "vendor/uPlot.iife.min.js"}
        assert "http://" not in page and "https://" not in page  # nothing from a CDN
        for name, v in links:
            r = await c.get(f"/static/{name}?v={v}")
            assert r.status_code == 200, name
            assert r.headers["cache-control"] == "public, max-age=31536000, immutable"
            assert r.headers["x-content-type-options"] == "nosniff"
        stale = await c.get("/static/dashboard.js?v=0000000000")
        assert stale.status_code == 200 and stale.headers["cache-control"] == "no-cache"
        assert (await c.get("/static/vendor/uPlot.LICENSE.txt")).text.startswith("The MIT")
        assert (await c.get("/static/nope.js")).status_code == 404
        assert (await c.get("/static/index.html")).status_code == 404  # pages live at / only
        assert (await c.get("/static/partials/header.html")).status_code == 404
        # one header for both pages, its own link marked current on each
        assert '<a href="/dashboard" aria-current="page">' in page
        assert '<a href="/" aria-current="page">' in (await c.get("/")).text
        assert "<!-- include" not in page


async def test_console_off_serves_no_page():
    cfg = settings(console=False)
    async with serve(cfg) as srv, srv.client() as c:
        for path in ("/", "/dashboard", "/static/chat.js"):
            assert (await c.get(path)).status_code == 404
        assert (await c.get("/v1/stats")).status_code == 200  # the JSON stays


async def _stream(c, n: int, max_tokens: int = 12) -> None:
    """`n` chat streams at once, each read to its end."""
    async def one() -> None:
        r = await c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens, "stream": True})
        assert r.status_code == 200, r.text

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)


async def test_stats_report_what_ran_and_agree_with_metrics():
    async with serve(step_delay_s=0.002) as srv, srv.client() as c:
        await _stream(c, 6)
        await srv.wait_idle()
        body = (await c.get("/v1/stats", params={"window_s": 30})).json()
        (pool,) = body["pools"]
        assert pool["name"] == "test" and pool["model"] == MODEL
        assert pool["ttft"]["count"] == 6
        assert pool["itl"]["count"] >= 6  # coalesced tokens count one gap
        assert 0 < pool["ttft"]["p50"] <= pool["ttft"]["p95"]
        assert pool["running"] == pool["waiting"] == 0
        assert pool["kv_pages"]["in_use"] == 0 and pool["kv_pages"]["total"] > 0
        assert pool["output_tokens_per_s"] > 0 and pool["busy_fraction"] > 0
        assert pool["slo"] == {"ttft_s": 1.0, "itl_s": 0.05}
        (rep,) = pool["replicas"]
        assert rep["steps"] and rep["last_step_index"] == rep["steps"][-1]["index"]
        assert sum(s["decode_rows"] for s in rep["steps"]) > 0
        assert all(s["duration_s"] >= 0 and s["ago_s"] >= 0 for s in rep["steps"])
        # every step says which rule sized its prompt chunks; the window's shares sum to 1
        from scheduler.policy import STEP_PLANS
        assert all(s["plan"] in STEP_PLANS for s in rep["steps"])
        assert pool["step_plans"] and abs(sum(pool["step_plans"].values()) - 1) < 1e-3
        assert body["tenants"] == [{"name": "anonymous", "in_flight": 0, "max_concurrency": None,
                                    "tokens_per_min": body["tenants"][0]["tokens_per_min"],
                                    "quota_tokens_per_min": None, "priority": 0}]
        assert body["tenants"][0]["tokens_per_min"] > 0
        # the same requests in /metrics
        metrics = (await c.get("/metrics")).text
        count = re.search(r'sluice:time_to_first_token_seconds_count\{model="fake-model",'
                          r'pool="test"\} (\S+)', metrics)
        assert count and float(count.group(1)) == 6
        assert 'sluice:ttft_target_seconds{model="fake-model",pool="test"} 1.0' in metrics
        assert 'sluice:itl_target_seconds{model="fake-model",pool="test"} 0.05' in metrics
        planned = re.findall(r'sluice:steps_total\{model="fake-model",plan="([a-z-]+)",'
                             r'pool="test"\} (\S+)', metrics)
        assert planned and sum(float(n) for _, n in planned) > 0
        for family in ("step_time_prediction_ratio", "step_host_seconds"):
            assert f'sluice:{family}_bucket{{le="+Inf",model="fake-model",pool="test"}}' \
                in metrics
        assert 'sluice:step_compute_seconds_total{model="fake-model",pool="test"}' in metrics
        assert 'sluice:step_idle_seconds_total{model="fake-model",pool="test"}' in metrics
        # steps_since: only what ran after
        last = rep["last_step_index"]
        again = (await c.get("/v1/stats", params={"steps_since": f"test/0:{last}"})).json()
        assert again["pools"][0]["replicas"][0]["steps"] == []
        await _stream(c, 1)
        await srv.wait_idle()
        more = (await c.get("/v1/stats", params={"steps_since": f"test/0:{last}"})).json()
        assert all(s["index"] > last for s in more["pools"][0]["replicas"][0]["steps"])
        assert more["pools"][0]["replicas"][0]["steps"]


async def test_stats_count_refusals_per_second_by_reason():
    async with serve(settings(max_streams=1), step_delay_s=0.05) as srv, srv.client() as c:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stream, c, 1, 30)
            await trio.sleep(0.2)
            r = await c.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 429
            pool = (await c.get("/v1/stats")).json()["pools"][0]
            assert pool["refused_per_s"]["max_streams"] > 0
            assert pool["running"] == 1


async def test_stats_need_a_key_and_show_a_tenant_only_itself():
    tenants = [TenantConfig(name="acme", api_key_sha256=sha("k-acme"), tokens_per_minute=6000),
               TenantConfig(name="globex", api_key_sha256=sha("k-globex"))]
    async with serve(settings(tenants=tenants, admin_key="k-admin")) as srv, srv.client() as c:
        assert_error(await c.get("/v1/stats"), 401, code="missing_api_key")
        assert_error(await c.get("/v1/stats", headers={"Authorization": "Bearer nope"}), 401)
        acme = (await c.get("/v1/stats", headers={"Authorization": "Bearer k-acme"})).json()
        assert [t["name"] for t in acme["tenants"]] == ["acme"]
        assert acme["tenants"][0]["quota_tokens_per_min"] == 6000
        assert acme["pools"][0]["name"] == "test"
        admin = (await c.get("/v1/stats", headers={"Authorization": "Bearer k-admin"})).json()
        assert sorted(t["name"] for t in admin["tenants"]) == ["acme", "globex"]
        # the pages load without a key (their API calls carry it)
        assert (await c.get("/dashboard")).status_code == 200


async def test_stats_refuse_bad_parameters():
    async with serve() as srv, srv.client() as c:
        for params in ({"window_s": "x"}, {"window_s": "-1"}, {"window_s": "nan"},
                       {"window_s": "601"}, {"steps_since": "test:3"},
                       {"steps_since": "test/a:1"}, {"steps_since": "test/0:1,,test/1:2"}):
            assert_error(await c.get("/v1/stats", params=params), 400)
        ok = await c.get("/v1/stats", params={"window_s": "600", "steps_since": "no/pe/3:7"})
        assert ok.status_code == 200 and ok.json()["window_s"] <= 600


def test_recent_latencies_read_back_within_half_a_percent_and_forget_old_seconds():
    import numpy as np

    from app.stats import KEEP_S, Recent

    now = [0.0]
    r = Recent(clock=lambda: now[0])
    values = np.random.default_rng(0).lognormal(-2.0, 1.0, 5000)
    for i, v in enumerate(values):
        now[0] = i * 0.01
        r.add(float(v))
    for since, part in ((0.0, values), (30.0, values[3000:])):
        got = r.since(since)
        want = np.percentile(part, (50, 95))
        assert got.count == len(part)
        assert abs(got.p50 / want[0] - 1) < 0.01 and abs(got.p95 / want[1] - 1) < 0.01
        assert abs(got.mean / part.mean() - 1) < 1e-4
    now[0] += KEEP_S + 2
    r.add(0.5)
    assert r.since(0.0).count == 1 and len(r.seconds) == 1  # older seconds dropped


async def test_stats_show_batch_progress_to_its_tenant(tmp_path):
    from .test_batches import chat_body, wait_done

    tenants = [TenantConfig(name="acme", api_key_sha256=sha("k-acme")),
               TenantConfig(name="globex", api_key_sha256=sha("k-globex"))]
    cfg = settings(data_dir=str(tmp_path), tenants=tenants)
    acme, globex = ({"Authorization": f"Bearer {k}"} for k in ("k-acme", "k-globex"))
    async with serve(cfg, step_delay_s=0.01) as srv, srv.client() as c:
        r = await c.post("/v1/batches", headers=acme, json={
            "requests": [chat_body(i, 30) for i in range(12)], "completeWithin": "24h"})
        assert r.status_code == 200, r.text
        bid = r.json()["id"]
        with trio.fail_after(10):
            while True:  # the worker takes the new batch up in its own time
                batches = (await c.get("/v1/stats", headers=acme)).json()["batches"]
                if batches and batches[0]["completed"]:
                    break
                await trio.sleep(0.02)
        (b,) = batches
        assert b["id"] == bid and b["tenant"] == "acme" and b["total"] == 12
        assert 0 < b["expires_in_s"] <= 24 * 3600 and b["at_risk"] is False
        assert (await c.get("/v1/stats", headers=globex)).json()["batches"] == []
        await wait_done(c, bid, headers=acme)
        assert (await c.get("/v1/stats", headers=acme)).json()["batches"] == []
