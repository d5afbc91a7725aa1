"""Issue 17 point 3: SIGTERM under load, on a real `sluice serve` process (a tiny random
model, so it starts in seconds). 32 streams are running when the signal comes:
- one SIGTERM: new requests get 503 with Retry-After, every running stream finishes (its
  finish_reason, then [DONE]: zero truncated), and the process exits with status 0;
- a second SIGTERM: the running streams end at once, each with a final error event and
  [DONE] (never a silent cut), and the process still exits 0.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import trio

from app.bench.spawn import free_port, wait_healthy

STREAMS = 32


def config(tmp: Path, grace_s: float) -> Path:
    path = tmp / "sigterm.toml"
    path.write_text(f"""
[server]
drain_grace_s = {grace_s}
[[pools]]
model = "random:tiny"
served_model_names = ["tiny"]
max_context = 512
kv_cache_bytes = {16 << 20}
decode_buckets = [32]
prefill_buckets = [64]
mixed_decode_buckets = [32]
max_prefill_seqs = 2
dtype = "float32"
warmup = "full"
[pools.scheduler]
max_running = {STREAMS}
max_waiting = {STREAMS}
ttft_target_s = 0.0
[batches]
enabled = false
""")
    return path


async def start(cfg: Path, log: Path) -> tuple[trio.Process, str]:
    port = free_port()
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "app.cli", "serve", "--config", str(cfg), "--port", str(port)],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    await wait_healthy(url, proc, 300, log)
    return proc, url


async def run_streams(tmp: Path, max_tokens: int, signals: int):
    """Start STREAMS streams; once all have a token, send `signals` SIGTERMs (a moment
    apart); returns (each stream's events, the late request's response, exit status)."""
    proc, url = await start(config(tmp, grace_s=60.0), tmp / "server.log")
    results: list[list] = []
    started = trio.Semaphore(0)
    late: list[httpx.Response] = []

    async def one(http: httpx.AsyncClient, i: int) -> None:
        events: list = []
        body = {"model": "tiny", "prompt": f"stream {i}", "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            first = True
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    if first:
                        first = False
                        started.release()
        results.append(events)

    with trio.fail_after(120):
        async with httpx.AsyncClient(base_url=url, timeout=60,
                                     limits=httpx.Limits(max_connections=64)) as http:
            async with trio.open_nursery() as nursery:
                for i in range(STREAMS):
                    nursery.start_soon(one, http, i)
                for _ in range(STREAMS):
                    await started.acquire()
                proc.send_signal(signal.SIGTERM)
                await trio.sleep(0.05)  # the signal handled; streams still running
                async with httpx.AsyncClient(base_url=url, timeout=10) as fresh:
                    late.append(await fresh.post("/v1/completions", json={
                        "model": "tiny", "prompt": "too late", "max_tokens": 2}))
                for _ in range(signals - 1):
                    proc.send_signal(signal.SIGTERM)
            status = await proc.wait()
    return results, late[0], status


async def test_sigterm_under_32_streams_truncates_none_and_exits_0(tmp_path):
    results, late, status = await run_streams(tmp_path, 480, 1)
    assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
    assert int(late.headers["Retry-After"]) >= 1
    assert len(results) == STREAMS
    for events in results:
        assert events[-1] == "[DONE]", events[-2:]
        assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2]
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if "choices" in e)
        assert text
    assert status == 0, (tmp_path / "server.log").read_text()[-2000:]


async def test_a_second_sigterm_ends_streams_with_an_error_event_and_exits_0(tmp_path):
    results, late, status = await run_streams(tmp_path, 480, 2)
    assert late.status_code == 503
    assert len(results) == STREAMS
    stopped = 0
    for events in results:  # each ends with its finish or a final error: never a silent cut
        assert events[-1] == "[DONE]", events[-2:]
        if "error" in events[-2]:
            assert events[-2]["error"]["code"] == "stopped", events[-2]
            stopped += 1
        else:
            assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2]
    assert stopped > STREAMS // 2, stopped  # the second signal did not wait for them
    assert status == 0, (tmp_path / "server.log").read_text()[-2000:]
