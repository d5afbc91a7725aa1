"""`sluice bench`: the numbers are right, against a stand-in server with known timings.

Exact checks run on hand-made records (percentiles, throughput, goodput, refusals, the
interference windows). Against the stand-in (tests/app/bench_standin.py) the checks are
on what a real clock allows on a shared 2-core machine: exact counts, timings within
generous bounds of the stand-in's delays.
"""

from __future__ import annotations

import json
import sys
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import AsyncIterator

import numpy as np
import pytest
import trio

from app.bench import main, sweep_main
from app.bench.client import RequestRecord, apportion
from app.bench.options import BenchConfig
from app.bench.report import write_run
from app.bench.run import run_bench
from app.bench.stats import interference, summarize
from app.bench.sweep import LEVEL_STRIDE
from app.bench.workloads import LongInterference, make_workload
from tests.app.bench_standin import MODEL, StandIn, serve

PNG = b"\x89PNG\r\n\x1a\n"


@asynccontextmanager
async def standin(**kw) -> AsyncIterator[tuple[StandIn, str]]:
    app = StandIn(**kw)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(serve, app))
        yield app, url
        nursery.cancel_scope.cancel()


def rec(index: int, status: str = "ok", *, start: float = 0.0, times=(), tokens=(),
        e2e: float | None = None, **kw) -> RequestRecord:
    return RequestRecord(index=index, tag="main", start=start, max_tokens=8, status=status,
                         chunk_times=list(times), chunk_tokens=list(tokens), e2e=e2e,
                         ttft=times[0] if times else None,
                         output_tokens=sum(tokens) if tokens else None, **kw)


# ----------------------------------------------------------------------------- pure stats
def test_summary_of_known_records():
    records = [
        rec(0, times=[0.1, 0.2, 0.4], tokens=[1, 2, 1], e2e=0.5, prompt_tokens=10),
        rec(1, start=0.5, times=[0.3, 0.35], tokens=[1, 1], e2e=0.4, prompt_tokens=20),
        rec(2, "rate_limited", start=0.6, e2e=0.002, retry_after=0.25, http_status=429),
        rec(3, "http_error", start=0.7, e2e=0.01, http_status=503, error="boom"),
        rec(4, "cancelled", start=0.8, times=[0.1]),
    ]
    s = summarize(records, wall_s=2.0, slo_ttft=0.35, slo_itl=0.1)
    assert s["ttft_s"]["count"] == 2 and s["ttft_s"]["p50"] == pytest.approx(0.2)
    assert s["ttft_s"]["max"] == pytest.approx(0.3)
    gaps = [0.1, 0.2, 0.05]
    for q in (50, 90, 95, 99):
        assert s["itl_s"][f"p{q}"] == pytest.approx(np.percentile(gaps, q))
    assert s["itl_s"]["count"] == 3 and s["itl_s"]["max"] == pytest.approx(0.2)
    assert s["e2e_s"]["p50"] == pytest.approx(0.45)
    assert s["tpot_s"]["p50"] == pytest.approx((0.1 + 0.05) / 2)  # 0.3/3 and 0.05/1
    thr = dict(s["throughput"])
    assert thr.pop("full_concurrency") is None  # no concurrency given: not a closed loop
    assert thr == pytest.approx(
        {"requests_per_s": 1.0, "output_tokens_per_s": 3.0, "prompt_tokens_per_s": 15.0})
    assert s["tokens"]["per_chunk_mean"] == pytest.approx(6 / 5)
    # r0 misses the ITL SLO (its p95 gap is 0.195 s), r1 meets both; 4 were sent.
    assert s["slo"]["good"] == 1
    assert s["slo"]["attainment"] == pytest.approx(1 / 4)
    assert s["slo"]["attainment_admitted"] == pytest.approx(1 / 2)
    assert s["slo"]["goodput_output_tokens_per_s"] == pytest.approx(1.0)
    req = s["requests"]
    assert (req["total"], req["ok"], req["rate_limited"], req["http_error"],
            req["cancelled"], req["server_errors_5xx"]) == (5, 2, 1, 1, 1, 1)
    ref = s["refusals"]
    assert ref["count"] == 1 and ref["fraction"] == pytest.approx(1 / 4)
    assert ref["latency_s"]["p99"] == pytest.approx(0.002)
    assert ref["with_retry_after"] == 1 and ref["retry_after_s"]["max"] == 0.25
    assert s["errors"] == {"http_error: boom": 1}


def test_full_concurrency_throughput_leaves_out_ramp_up_and_drain():
    # Two streams: sends at 0 and 1 (ramp-up), then each next send as one ends, the last
    # at 4. Every token arrives at send + 0.5 s (2 tokens) and + 1 s (1 token).
    sends = [0.0, 1.0, 2.0, 3.0, 4.0]
    records = [rec(i, start=t, times=[0.5, 1.0], tokens=[2, 1], e2e=1.0)
               for i, t in enumerate(sends)]
    s = summarize(records, concurrency=2)
    full = s["throughput"]["full_concurrency"]
    assert full["window_s"] == [1.0, 4.0]
    # In [1, 4): 1.0 (1 token), 1.5 (2), 2.0 (1), 2.5 (2), 3.0 (1), 3.5 (2) -> 9.
    assert full["output_tokens_per_s"] == pytest.approx(9 / 3)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(15 / 5)
    assert summarize(records[:2], concurrency=2)["throughput"]["full_concurrency"] is None


def test_apportion_splits_usage_over_chunks_by_characters():
    assert apportion(10, [1, 1, 2]) == [3, 3, 4]
    assert apportion(6, [4, 4, 4]) == [2, 2, 2]
    assert sum(apportion(97, [3, 1, 8, 2, 5])) == 97
    assert apportion(2, [5, 5, 5]) == [1, 1, 1]  # usage below the chunk count
    assert apportion(0, []) == []


def test_interference_windows():
    long = rec(-1, start=1.0, times=[2.0], tokens=[1], e2e=2.1)  # window: 1.0 .. 3.0
    shorts = [
        rec(0, start=0.0, times=[0.5, 0.6, 0.7, 0.9], tokens=[1] * 4),  # before
        rec(1, start=0.0, times=[0.8, 0.95, 2.95, 3.05, 3.1], tokens=[1] * 5),
        rec(2, "cancelled", start=3.2, times=[0.0, 0.1], tokens=[1, 1]),  # after
    ]
    li = interference(shorts, long)
    assert li["window_s"] == [1.0, 3.0]
    assert li["short_itl_before_s"]["count"] == 4  # 0.1, 0.1, 0.2, 0.15
    # 0.95 -> 2.95 lies in the window; 2.95 -> 3.05 straddles its end: both "during".
    assert li["short_itl_during_s"]["count"] == 2
    assert li["short_itl_during_s"]["max"] == pytest.approx(2.0)
    assert li["short_itl_after_s"]["count"] == 2  # 3.05 -> 3.1 and the cancelled one's
    assert li["p95_during_over_before"] > 5
    assert li["long"]["ttft_s"] == 2.0
    # Its decode, 3.0 .. 3.1: only 3.05 -> 3.1 lies wholly inside.
    assert li["long_decode_window_s"] == [3.0, pytest.approx(3.1)]
    assert li["short_itl_while_long_decodes_s"]["count"] == 1
    assert li["p95_while_long_decodes_over_before"] == pytest.approx(0.05 / 0.1, rel=0.6)


# ------------------------------------------------------------------------------ workloads
def test_workloads_are_deterministic_and_sized():
    a = make_workload("shared-prefix", seed=1)
    b = make_workload("shared-prefix", seed=1)
    assert [b.request(i) for i in (7, 3)] == [a.request(i) for i in (7, 3)]  # any order
    assert make_workload("shared-prefix", seed=2).request(3) != a.request(3)
    r3, r4 = a.request(3), a.request(4)
    assert r3.messages[0] == r4.messages[0] and r3.messages[1] != r4.messages[1]
    system_words = len(r3.messages[0][1].split())
    assert 1480 <= system_words <= 1540  # 2000 tokens at 0.75 words a token
    for i in range(50):
        spec = a.request(i)
        q = len(spec.messages[1][1].split()) - 2  # "Question i:"
        assert 22 <= q <= 75 and 128 <= spec.max_tokens <= 400
    fixed = make_workload("shared-prefix", seed=1, max_tokens=9)
    assert fixed.request(3).messages == r3.messages and fixed.request(3).max_tokens == 9
    calibrated = make_workload("shared-prefix", seed=1, words_per_token=0.5)
    assert len(calibrated.request(3).messages[0][1].split()) == pytest.approx(1000, abs=20)

    mixed = make_workload("mixed", seed=1)
    sizes = [len(mixed.request(i).messages[0][1].split()) for i in range(40)]
    assert min(sizes) >= 75 and max(sizes) <= 1130 and len(set(sizes)) > 30
    li = make_workload("long-interference", seed=1)
    assert isinstance(li, LongInterference)
    assert len(li.long().messages[0][1].split()) == pytest.approx(4500, abs=20)
    assert li.request(0).tag == "short" and li.long().tag == "long"


# ---------------------------------------------------------------------- against a server
async def test_closed_loop_timings_tokens_and_server_metrics(tmp_path: Path):
    async with standin(ttft_s=0.1, itl_s=0.03, tokens_per_chunk=2) as (app, url):
        cfg = BenchConfig(url=url, concurrency=4, requests=12, max_tokens=8, progress=False)
        result = await run_bench(cfg)
    s = result.summary
    assert s["model"] == MODEL and s["calibration"] == {"words_per_token": 0.5,
                                                         "source": "tokenize"}
    assert s["requests"]["ok"] == 12 and s["requests"]["total"] == 12
    assert s["tokens"]["output"] == 96 and s["tokens"]["per_chunk_mean"] == 2.0
    assert all(r.chunk_tokens == [2, 2, 2, 2] for r in result.records)
    assert s["itl_s"]["count"] == 36
    assert 0.028 <= s["itl_s"]["p50"] <= 0.09
    assert 0.1 <= s["ttft_s"]["p50"] <= 0.3
    assert s["e2e_s"]["p50"] >= 0.1 + 3 * 0.03
    assert s["tpot_s"]["p50"] == pytest.approx(s["itl_s"]["p50"] / 2, rel=0.5)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(96 / s["duration_s"])
    server = s["server"]
    assert server["prefix_cache_hit_rate"] == pytest.approx(0.5)  # deltas, not totals
    assert server["generation_tokens"] == 96 and server["preemptions"] == 0
    assert server["engine_busy_fraction"] == 0.25
    # What went over the wire.
    assert len(app.bodies) == 12
    assert len(app.clients) <= 4  # the pool's connections, kept alive between requests
    systems = {b["messages"][0]["content"] for b in app.bodies}
    questions = {b["messages"][1]["content"] for b in app.bodies}
    assert len(systems) == 1 and len(questions) == 12
    for body in app.bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == MODEL and body["max_tokens"] == 8
        assert "ignore_eos" not in body

    names = write_run(result, tmp_path)
    assert (tmp_path / "latency_cdf.png").read_bytes()[:8] == PNG
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["ttft_s"] == s["ttft_s"] and "latency_cdf.png" in names
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 12


async def test_open_loop_refusals_are_counted_with_their_retry_after():
    async with standin(ttft_s=0.05, itl_s=0.01, capacity=2, retry_after_ms=250) as (app, url):
        cfg = BenchConfig(url=url, rate=200.0, requests=30, max_tokens=4, ignore_eos=True,
                          progress=False)
        s = (await run_bench(cfg)).summary
    req, ref = s["requests"], s["refusals"]
    assert req["total"] == 30 and req["ok"] + req["rate_limited"] == 30
    assert req["rate_limited"] >= 5 and req["server_errors_5xx"] == 0
    assert ref["count"] == req["rate_limited"] == ref["with_retry_after"]
    assert ref["fraction"] == pytest.approx(req["rate_limited"] / 30)
    assert ref["retry_after_s"]["p50"] == pytest.approx(0.25)
    assert ref["latency_s"]["max"] < 0.5
    assert s["server"]["rejected"] == {"overloaded": req["rate_limited"]}
    assert s["load"]["mode"] == "open" and s["ttft_s"]["count"] == req["ok"]
    assert all(b["ignore_eos"] is True for b in app.bodies)


async def test_long_interference_reports_the_stall(tmp_path: Path):
    async with standin(ttft_s=0.02, itl_s=0.02, long_words=1000, long_ttft_s=0.5) as (_, url):
        # Shorts of 40 tokens (~0.8 s) are mid-stream when the long prompt comes at 0.4 s.
        cfg = BenchConfig(url=url, workload="long-interference", short_streams=2,
                          warmup_s=0.4, tail_s=0.4, max_tokens=40, long_prompt_tokens=2400,
                          progress=False)
        result = await run_bench(cfg)
    li = result.summary["long_interference"]
    assert li["long"]["status"] == "ok" and 0.5 <= li["long"]["ttft_s"] <= 0.9
    send, first = li["window_s"]
    assert first - send == pytest.approx(li["long"]["ttft_s"])
    assert li["short_itl_before_s"]["count"] >= 10
    assert li["short_itl_during_s"]["count"] >= 2
    assert li["short_itl_during_s"]["max"] >= 0.3  # the stalled decode step
    assert li["p95_during_over_before"] > 3
    assert result.summary["requests"]["ok"] >= 2  # the shorts only
    assert result.summary["requests"]["cancelled"] >= 1  # in flight when the run ended
    assert {r.tag for r in result.records} == {"short", "long"}
    write_run(result, tmp_path)
    assert (tmp_path / "itl_timeline.png").read_bytes()[:8] == PNG


async def test_overload_measures_capacity_then_floods():
    async with standin(ttft_s=0.05, itl_s=0.01, capacity=2) as (_, url):
        cfg = BenchConfig(url=url, workload="overload", concurrency=2, capacity_requests=4,
                          duration_s=0.4, max_tokens=4, progress=False, slo_ttft=1.0)
        result = await run_bench(cfg)
    s = result.summary
    cap = s["overload"]["capacity"]
    assert cap["ok"] == 4 and cap["concurrency"] == 2
    assert s["overload"]["rate_rps"] == pytest.approx(5 * cap["requests_per_s"])
    assert s["requests"]["rate_limited"] > 0 and s["requests"]["server_errors_5xx"] == 0
    assert s["requests"]["total"] == s["requests"]["ok"] + s["requests"]["rate_limited"]
    assert s["slo"]["attainment_admitted"] == 1.0
    assert sum(r.tag == "capacity" for r in result.records) == 4


async def test_cli_prints_json_last_and_writes_files(tmp_path: Path, capsys):
    async with standin(ttft_s=0.02, itl_s=0.01) as (_, url):
        argv = ["--url", url, "--workload", "mixed", "--concurrency", "2", "--requests", "4",
                "--max-tokens", "4", "--slo-ttft", "1.0", "--slo-itl", "0.5", "--seed", "3",
                "--no-progress", "--out", str(tmp_path)]
        assert await trio.to_thread.run_sync(main, argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("ttft_s", "itl_s", "e2e_s", "throughput", "slo", "refusals", "requests",
                "server", "load", "calibration", "files"):
        assert key in summary, key
    assert set(summary["ttft_s"]) == {"count", "mean", "p50", "p90", "p95", "p99", "max"}
    assert summary["slo"]["itl_p95_s"] == 0.5 and summary["slo"]["good"] == 4
    assert summary["workload"] == "mixed" and summary["seed"] == 3
    assert all(Path(f).exists() for f in summary["files"])


async def test_sweep_over_a_url_and_a_spawned_server(tmp_path: Path, capsys):
    async with standin(ttft_s=0.02, itl_s=0.01) as (app, url):
        argv = [f"here={url}", "--spawn", "spawned:--ttft 0.01",
                "--sluice", f"{sys.executable} -m tests.app.bench_standin",
                "--concurrencies", "1,2", "--requests-per-stream", "2", "--max-tokens", "3",
                "--no-progress", "--out", str(tmp_path), "--grace", "5"]
        assert await trio.to_thread.run_sync(sweep_main, argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["errors"] == {} and set(out["targets"]) == {"here", "spawned"}
    for rows in out["targets"].values():
        assert [r["concurrency"] for r in rows] == [1, 2]
        assert [r["ok"] for r in rows] == [2, 4]
    assert (tmp_path / "sweep.png").read_bytes()[:8] == PNG
    full = json.loads((tmp_path / "sweep.json").read_text())
    assert full["points"]["spawned"][1]["load"]["concurrency"] == 2
    assert (tmp_path / "here" / "c2" / "summary.json").exists()
    assert "serve --host 127.0.0.1 --port" in (tmp_path / "server-spawned.log").read_text()
    # Each concurrency level sends fresh questions, the same ones to every target.
    questions = [b["messages"][1]["content"] for b in app.bodies]
    assert sum(q.startswith(f"Question {LEVEL_STRIDE}:") for q in questions) == 1


async def test_against_sluice_itself():
    """The real app (fake runner): its SSE and /metrics are what the benchmark expects."""
    from tests.app.harness import serve as serve_sluice
    from tests.app.harness import settings

    async with serve_sluice(settings(max_running=8)) as srv:
        cfg = BenchConfig(url=srv.url, concurrency=4, requests=8, max_tokens=6,
                          system_tokens=200, progress=False)
        s = (await run_bench(cfg)).summary
    assert s["requests"]["ok"] == 8, s["errors"]
    assert s["calibration"]["source"] == "tokenize"
    assert s["tokens"]["output"] == 48 and s["itl_s"]["count"] > 0
    assert s["server"] is not None and s["server"]["generation_tokens"] == 48
    assert s["server"]["prefix_cache_query_tokens"] > 0


async def test_adapters_spread_requests_over_the_servers_adapters(tmp_path: Path):
    """--adapters N: every request names one of the first N adapters /v1/models lists
    for the model (Zipf: the first is the most asked for); Sluice counts them per adapter."""
    from config.settings import AdapterConfig
    from tests.app.harness import serve as serve_sluice
    from tests.app.harness import settings

    names = ["a", "b", "c"]
    for n in names:
        (tmp_path / n).mkdir()
    adapters = [AdapterConfig(n, str(tmp_path / n)) for n in names]
    async with serve_sluice(settings(pool={"max_loras": 2, "adapters": adapters})) as srv:
        cfg = BenchConfig(url=srv.url, concurrency=4, requests=24, max_tokens=4,
                          system_tokens=100, progress=False, adapters=2, adapter_dist="zipf")
        s = (await run_bench(cfg)).summary
        stats = srv.pool.stats()[0].adapters
        with pytest.raises(Exception, match="lists 3 adapters"):
            await run_bench(BenchConfig(url=srv.url, requests=1, adapters=4, progress=False))
    assert s["requests"]["ok"] == 24, s["errors"]
    by = s["adapters"]["ok_by_adapter"]
    assert set(by) == {"a", "b"} and sum(by.values()) == 24 and by["a"] > by["b"]
    assert stats["requests"] == by


async def test_closed_loop_ramp_up_staggers_stream_starts(autojump_clock):
    """--ramp-up: stream k starts k * ramp / concurrency seconds in (steady-state TTFT)."""
    import trio

    from app.bench.loops import closed_loop

    starts: list[float] = []

    class FakeShooter:
        async def fire(self, spec, index):
            starts.append(trio.current_time())
            await trio.sleep(100)

            class Rec:
                status = "ok"
            return Rec()

    t0 = trio.current_time()
    await closed_loop(FakeShooter(), lambda i: i, 4, requests=4, ramp_up_s=8.0)
    assert [round(t - t0, 6) for t in starts] == [0.0, 2.0, 4.0, 6.0]


def test_histograms_between_two_scrapes_give_percentiles():
    from app.bench.server_metrics import histogram_delta, parse

    def text(counts: list[int], total: float) -> str:
        lines = ["# TYPE sluice:step_host_seconds histogram"]
        for le, n in zip(("0.001", "0.01", "0.1", "+Inf"), counts):
            lines.append(f'sluice:step_host_seconds_bucket{{le="{le}",pool="p"}} {n}')
        lines += [f'sluice:step_host_seconds_count{{pool="p"}} {counts[-1]}',
                  f'sluice:step_host_seconds_sum{{pool="p"}} {total}']
        return "\n".join(lines) + "\n"

    first = parse(text([5, 5, 5, 5], 0.004))  # earlier steps: not this run's
    last = parse(text([5, 55, 105, 105], 0.004 + 100 * 0.01))
    h = histogram_delta(first, last, "step_host_seconds")
    assert h["count"] == 100 and h["mean"] == pytest.approx(0.01)
    assert h["p50"] == pytest.approx(0.01)  # the 50th of 100 ends the (1 ms, 10 ms] bucket
    assert h["p95"] == pytest.approx(0.01 + 0.09 * 0.9)
    assert histogram_delta(first, first, "step_host_seconds") is None


async def test_a_request_on_a_connection_the_server_closed_is_sent_once_more():
    """llama.cpp's server closes kept-alive connections; a request that went out on one
    as it closed is sent again (once), as the openai client's retries would, and counted;
    a second failure, or one after the answer began, is the request's error."""
    import httpx

    from app.bench.client import send
    from app.bench.workloads import RequestSpec

    calls = []

    def answer(fail_first: int):
        def handler(request: httpx.Request) -> httpx.Response:
            calls.append(request)
            if len(calls) <= fail_first:
                raise httpx.RemoteProtocolError("Server disconnected without sending a "
                                                "response.", request=request)
            sse = (b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
                   b'data: [DONE]\n\n')
            return httpx.Response(200, content=sse,
                                  headers={"content-type": "text/event-stream"})
        return handler

    spec = RequestSpec(messages=(("user", "hello"),), max_tokens=4, prompt_tokens=2)
    for fail_first, status, reconnects, sent in ((1, "ok", 1, 2), (2, "transport_error", 1, 2)):
        calls.clear()
        r = RequestRecord(index=0, tag="main", start=0.0, max_tokens=4)
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer(fail_first)),
                                     base_url="http://x") as http:
            await send(http, spec, r, model=None, extra={}, timeout_s=10)
        assert (r.status, r.reconnects, len(calls)) == (status, reconnects, sent)
    assert summarize([r], wall_s=1.0)["reconnects"] == 1
