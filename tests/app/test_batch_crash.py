"""Crash test: a real `sluice serve` process on the embedded model runs a batch of 120
short requests and is killed with SIGKILL at random points, twice, each time
restarted on the same store. In the end there are 120 results, each custom_id exactly
once, each equal to the same request's interactive greedy answer."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from app.bench.spawn import free_port, wait_healthy

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
N = 120


def config(tmp: Path, gguf: Path) -> Path:
    path = tmp / "crash.toml"
    path.write_text(f"""
[[pools]]
model = "{gguf}"
max_context = 1024
kv_cache_bytes = {300 * 16 * 46080}
decode_buckets = [16]
prefill_buckets = [128]
mixed_decode_buckets = [16]
dtype = "float32"
quantization = "none"  # f32 products: the answers compared below are near-ties that bf16
                       # activations can tip either way between a batch and a lone request
warmup = "full"
[pools.scheduler]
max_running = 16
max_step_tokens = 144
[batches]
data_dir = "{tmp / 'store'}"
""")
    return path


def body(i: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i % 9 + 2}."}],
            "max_tokens": 4, "temperature": 0}


async def start(cfg: Path, log: Path) -> tuple[trio.Process, str]:
    port = free_port()
    out = open(log, "ab")
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "app.cli", "serve", "--config", str(cfg), "--port", str(port)],
        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    await wait_healthy(url, proc, 600, log)
    return proc, url


async def test_kill_9_twice_loses_nothing_and_doubles_nothing(tmp_path, embedded_gguf):
    cfg, log = config(tmp_path, embedded_gguf), tmp_path / "server.log"
    rng = random.Random(7)
    with trio.fail_after(1500):
        proc, url = await start(cfg, log)
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            r = await http.post("/v1/batches", json={
                "requests": [{**body(i), "custom_id": f"q{i}"} for i in range(N)],
                "completeWithin": "24h"})
            assert r.status_code == 200, r.text
            bid = r.json()["id"]
        for kill in range(2):
            await trio.sleep(rng.uniform(1.0, 6.0))  # somewhere in the middle of things
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            proc, url = await start(cfg, log)
        try:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                while True:
                    b = (await http.get(f"/v1/batches/{bid}")).json()
                    if b["status"] in ("completed", "failed", "expired", "cancelled"):
                        break
                    await trio.sleep(0.5)
                assert b["status"] == "completed", b
                assert b["request_counts"] == {"total": N, "completed": N, "failed": 0}
                out = [json.loads(x) for x in
                       (await http.get(f"/v1/files/{b['output_file_id']}/content")).text
                       .splitlines()]
                ids = [x["custom_id"] for x in out]
                assert len(ids) == N and set(ids) == {f"q{i}" for i in range(N)}
                answers = {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]
                           ["content"] for x in out}
                for i in range(9):  # the 9 distinct prompts, asked interactively
                    r = await http.post("/v1/chat/completions", json=body(i))
                    want = r.json()["choices"][0]["message"]["content"]
                    for j in range(i, N, 9):
                        assert answers[f"q{j}"] == want, (j, answers[f"q{j}"], want)
        finally:
            proc.send_signal(signal.SIGINT)
            with trio.move_on_after(30):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
