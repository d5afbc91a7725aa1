"""Overlapped scheduling on and off, one process, one runner (issue 16, point 3): the
embedded model as the default preset runs it (int8 weights where the CPU kernel builds),
driven through the engine, runs alternating between `overlap = false` and `true`.

Two workloads:
- `decode16`: 16 requests with distinct 500-token prompts, 256 tokens each (ignore_eos;
  prompts prefilled at the full step budget): tokens/s over the steps that decode all 16
  (nothing else in them), as bench-engine's decode-of-16 but through the engine loop;
- `shared`: 48 requests at concurrency 16 (closed loop), a 2,000-token system prompt
  and a short question each, 64 tokens: output tokens/s and ITL p50 / p95.

For each run: host work per step (p50, ms: the iteration's wall time not spent waiting
for the computation), and the fraction of the wall time the computation stood idle
between steps (`StepRecord.idle_s` summed over the span). Prints one JSON line.

    .venv/bin/python benchmarks/experiments/overlap_ab.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import trio  # noqa: E402

from config.settings import SchedulerConfig  # noqa: E402
from model.runner import ModelRunner, enable_compilation_cache  # noqa: E402
from model.weights import load_model  # noqa: E402
from scheduler.api import FinishEvent, GenerateRequest, TokenEvent  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.protocol import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else None


async def drive(runner, tok, overlap: bool, workload: str) -> dict:
    # decode16: prompts prefilled at the full step budget, so that all 16 decode together
    # soon (beside decodes, adaptive prefill would spread them over many steps).
    cfg = SchedulerConfig(overlap=overlap, ttft_target_s=0.0, max_waiting=256,
                          itl_target_s=0.0 if workload == "decode16" else 0.05)
    eng = Engine(runner, tok, cfg)
    rng = np.random.default_rng(0)
    gaps: list[float] = []
    out_tokens = 0
    async with trio.open_nursery() as nursery:
        await nursery.start(eng.run)

        async def one(prompt, max_tokens):
            nonlocal out_tokens
            h = eng.submit(GenerateRequest(prompt_ids=prompt, max_tokens=max_tokens,
                                           sampling=GREEDY, ignore_eos=True))
            last = None
            async for ev in h.events:
                if isinstance(ev, TokenEvent):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.extend([now - last] + [0.0] * (len(ev.token_ids) - 1))
                    last = now
                    out_tokens += len(ev.token_ids)
                elif isinstance(ev, FinishEvent):
                    return

        t0 = time.perf_counter()
        if workload == "decode16":
            async with trio.open_nursery() as inner:
                for _ in range(16):
                    inner.start_soon(one, rng.integers(10, 40000, 500).tolist(), 256)
        else:
            system = rng.integers(10, 40000, 2000).tolist()
            queue = [system + rng.integers(10, 40000, 24).tolist() for _ in range(48)]

            async def worker():
                while queue:
                    await one(queue.pop(), 64)

            async with trio.open_nursery() as inner:
                for _ in range(16):
                    inner.start_soon(worker)
        wall = time.perf_counter() - t0
        records = list(eng.step_records)
        nursery.cancel_scope.cancel()
    ok = [r for r in records if r.error is None]
    res = {"host_ms_p50": round(1000 * statistics.median(r.host_s for r in ok), 2),
           "host_ms_p95": round(1000 * pct([r.host_s for r in ok], 95), 2)}
    if workload == "decode16":
        full = [r for r in ok if len(r.decoded) == 16 and not r.prefilled]
        span = full[-1].ended_at - full[0].ended_at
        res["decode16_tok_s"] = round(16 * (len(full) - 1) / span, 1)
        idle = sum(r.idle_s for r in full[1:])
        res["step_ms"] = round(1000 * span / (len(full) - 1), 2)
    else:
        span = ok[-1].ended_at - ok[0].started_at
        idle = sum(r.idle_s for r in ok)
        res.update(out_tok_s=round(out_tokens / wall, 1),
                   itl_ms_p50=round(1000 * pct(gaps, 50), 1),
                   itl_ms_p95=round(1000 * pct(gaps, 95), 1))
    res["idle_frac"] = round(idle / span, 4)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", default="decode16,shared")
    args = ap.parse_args(argv)
    enable_compilation_cache()
    loaded = load_model("embedded", progress=False)
    runner = ModelRunner(loaded.config, loaded.params, quantization="auto", page_size=16,
                         kv_cache_bytes=2 << 30, max_context=8192,
                         decode_buckets=(1, 2, 4, 8, 16), prefill_buckets=(64, 256),
                         mixed_decode_buckets=(0, 1, 2, 4, 8, 16), max_prefill_seqs=4)
    runner.warmup()
    out: dict = {"quantization": runner.quantization}
    for workload in args.workloads.split(","):
        runs: dict[str, list] = {"off": [], "on": []}
        trio.run(drive, runner, loaded.tokenizer, False, workload)  # settle
        for _ in range(args.rounds):
            for name, overlap in (("off", False), ("on", True)):
                runs[name].append(trio.run(drive, runner, loaded.tokenizer, overlap, workload))
        out[workload] = runs
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
