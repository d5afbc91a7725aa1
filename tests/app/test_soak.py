"""benchmarks/soak.py end to end, small: it starts `sluice serve` on a tiny random model
with its four tenants, sends 40 requests of every kind (a quarter cut off on purpose) and
finds no hung stream, no page in use at rest, a clean page audit, no lease left and no
broken answer. (~20 s: the server's start is most of it.)"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parents[2]

TINY = """
[[pools]]
name = "tiny"
model = "random:tiny"
served_model_names = ["tiny"]
page_size = 16
kv_cache_bytes = 16777216
decode_buckets = [4, 16]
prefill_buckets = [64, 256]
mixed_decode_buckets = [16]
dtype = "float32"

[pools.scheduler]
max_running = 16
max_step_tokens = 272

[batches]
enabled = false
"""


def test_soak_on_a_tiny_model(tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--requests", "40",
         "--concurrency", "8", "--config", str(config), "--workdir", str(tmp_path / "work"),
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.exists(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report
    assert report["requests"] == sum(report["outcomes"].values()) == 40
    assert report["hung_streams"] == 0
    assert report["kv_pages_in_use_end"] == 0
    for point in ("start", "middle", "end"):
        rest = report["at_rest"][point]
        assert rest["kv_pages_in_use"] == 0 and rest["kv_audit_problems"] == []
        assert rest["tenant_leases_in_flight"] == 0
        assert rest["process"]["rss_mb"] > 0 and rest["process"]["fds"] > 0
    assert report["outcomes"].get("ok", 0) > 0 and report["outcomes"].get("disconnected", 0) > 0
    assert report["errors"] == {}, report["errors"]
    # Memory and descriptor growth need the real run's few hundred warm-up requests: after
    # ten, the process still settles (thread arenas, first uses of each path).
    checks = {k: v for k, v in report["checks"].items() if not k.endswith("_growth_ok")}
    assert all(checks.values()), checks


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


async def test_a_stream_that_stalls_counts_as_hung():
    """The soak's detector: a server that sends one event and then nothing."""
    soak = _soak_module()

    async def stall(stream: trio.SocketStream) -> None:
        await stream.receive_some()
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                              b"transfer-encoding: chunked\r\n\r\n")
        event = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
        await stream.send_all(b"%x\r\n%s\r\n" % (len(event), event))
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, stall, 0)
        port = listeners[0].socket.getsockname()[1]
        requests = soak.Requests(0, "m", (soak.Tenant("t", 0, 1.0),))
        plan = next(p for p in map(requests.plan, range(100)) if p.stream and not p.disconnect)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            rec = await soak.run_one(http, plan, hung_s=0.5)
        nursery.cancel_scope.cancel()
    assert rec.outcome == "hung" and rec.ttft_s is not None and rec.max_wait_s >= 0.5
