"""Issue 18 point 3: one TP=2 replica over two processes (`jax.distributed` on the CPU,
gloo collectives), real `sluice serve` processes on a tiny random model:
- requests through process 0's HTTP endpoint give the answers of a one-process TP=1
  server, token for token (and their logprobs within 1e-4), the replica's processes
  each reading only their shards of an orbax checkpoint of the model (issue 52);
- `kill -9` of process 1 mid-stream: the stream ends with an error event and [DONE]
  within seconds (no hang), /health turns 503 `engine_dead` naming the lost process, new
  requests get 503, and process 0 still stops cleanly (status 0) on SIGTERM;
- a SIGTERM to process 0 of a healthy replica stops process 1 too, with status 0.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import trio

from app.bench.spawn import free_port, wait_healthy

PROMPTS = ["The quick brown fox", "Once upon a time there was", "1, 2, 3,"]


def config(tmp: Path, tp: int, model: str = "random:tiny") -> Path:
    path = tmp / f"tp{tp}.toml"
    path.write_text(f"""
[server]
drain_grace_s = 5
[[pools]]
model = "{model}"
served_model_names = ["tiny"]
max_context = 512
kv_cache_bytes = {16 << 20}
decode_buckets = [4]
prefill_buckets = [64]
mixed_decode_buckets = [4]
max_prefill_seqs = 2
dtype = "float32"
quantization = "none"  # f32 at every degree: the f32 oracle across processes
warmup = "full"
tensor_parallel = {tp}
[pools.scheduler]
ttft_target_s = 0.0
[batches]
enabled = false
""")
    return path


def spawn(cfg: Path, log: Path, *extra: str) -> trio.Process:
    return trio.lowlevel.open_process(
        [sys.executable, "-m", "app.cli", "serve", "--config", str(cfg), *extra],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


async def answers(url: str) -> list[dict]:
    """The PROMPTS' greedy completions, sent at once (one batch of mixed requests)."""
    out: dict[int, dict] = {}

    async def one(http, i: int) -> None:
        r = await http.post("/v1/completions", json={
            "model": "tiny", "prompt": PROMPTS[i], "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        out[i] = r.json()["choices"][0]

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, http, i)
    return [out[i] for i in range(len(PROMPTS))]


async def start_replica(tmp: Path) -> tuple[trio.Process, trio.Process, str]:
    """The TP=2 replica, from an orbax checkpoint of the same model: each process reads
    only its shards of the split tensors (model/loaders/orbax_ckpt.py)."""
    from model.loaders.orbax_ckpt import save_orbax
    from model.weights import load_model

    ckpt = save_orbax(load_model("random:tiny", progress=False), tmp / "ckpt", progress=False)
    cfg, port, coord = config(tmp, 2, str(ckpt)), free_port(), f"127.0.0.1:{free_port()}"
    group = ["--coordinator", coord, "--num-processes", "2"]
    leader = await spawn(cfg, tmp / "p0.log", "--port", str(port), *group, "--process-id", "0")
    follower = await spawn(cfg, tmp / "p1.log", *group, "--process-id", "1")
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(url, leader, 300, tmp / "p0.log")
    except BaseException:
        for p in (leader, follower):
            p.kill()
        raise
    return leader, follower, url


async def test_two_processes_serve_the_tp1_answer_and_a_lost_follower_fails_cleanly(tmp_path):
    # The one-process TP=1 reference.
    port = free_port()
    ref = await spawn(config(tmp_path, 1), tmp_path / "ref.log", "--port", str(port))
    try:
        await wait_healthy(f"http://127.0.0.1:{port}", ref, 300, tmp_path / "ref.log")
        expected = await answers(f"http://127.0.0.1:{port}")
    finally:
        ref.kill()
        await ref.wait()

    leader, follower, url = await start_replica(tmp_path)
    try:
        got = await answers(url)
        for log in ("p0.log", "p1.log"):  # each read its half of the split tensors
            assert "this process's shards" in (tmp_path / log).read_text(), log
        for want, have in zip(expected, got):
            assert have["text"] == want["text"]
            assert have["logprobs"]["tokens"] == want["logprobs"]["tokens"]
            for a, b in zip(have["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"]):
                assert abs(a - b) < 1e-4

        # A stream in flight when process 1 dies: an error event, then [DONE], no hang.
        events: list = []
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            with trio.fail_after(30):
                async with http.stream("POST", "/v1/completions", json={
                        "model": "tiny", "prompt": "a long answer", "max_tokens": 480,
                        "stream": True, "ignore_eos": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                        if len(events) == 2:
                            follower.kill()
                            killed_at = time.monotonic()
            assert events[-1] == "[DONE]"
            assert "process 1" in events[-2]["error"]["message"], events[-2]
            assert sum("choices" in e for e in events[:-1]) < 480  # cut short, not finished

            with trio.fail_after(10):
                while (h := await http.get("/health")).status_code != 503:
                    await trio.sleep(0.2)
            assert time.monotonic() - killed_at < 10
            assert h.json()["status"] == "engine_dead"
            assert "process 1" in h.json()["detail"]
            r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                          "max_tokens": 2})
            assert r.status_code == 503, r.text
        leader.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await leader.wait() == 0
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()


async def test_stopping_process_0_stops_the_followers_cleanly(tmp_path):
    leader, follower, url = await start_replica(tmp_path)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4})
            assert r.status_code == 200, r.text
        leader.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await leader.wait() == 0
            assert await follower.wait() == 0
        assert "follower stopped (the leader stopped)" in (tmp_path / "p1.log").read_text()
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()


def test_multi_host_config_errors_name_the_key(capsys):
    from app.cli import main
    from app.loading import check_multihost
    from config.settings import PoolConfig

    one = PoolConfig(name="chat", model="random:tiny", tensor_parallel=2)
    with pytest.raises(ValueError, match="serves one pool; the config has 2"):
        check_multihost([one, PoolConfig(name="long", model="random:tiny")])
    with pytest.raises(ValueError, match=r"pools\[chat\].replicas = 2"):
        check_multihost([PoolConfig(name="chat", model="random:tiny", replicas=2)])
    # This test process is one process with one device: TP=2 cannot span it.
    with pytest.raises(ValueError, match=r"pools\[chat\].tensor_parallel = 2, but a multi-host"):
        check_multihost([one])
    assert main(["serve", "--num-processes", "2"]) == 2
    assert "needs --coordinator HOST:PORT" in capsys.readouterr().err
    assert main(["serve", "--coordinator", "h:1", "--num-processes", "2",
                 "--process-id", "2"]) == 2
    assert "--process-id 2 is not in 0..1" in capsys.readouterr().err
