"""Serving on one accelerator through the real engine: random Llama-3-8B weights (bf16),
TP = 1, the seed's SLO checked (issue 18 point 5).

`scheduler.engine.Engine` (the trio loop `sluice serve` runs per replica) drives the
model runner while C closed-loop clients each send request after request: a shared
2,000-token system prompt plus a question of 100-1,000 tokens, answers of 200 tokens.
Over the measured window it reports TTFT and inter-token latency percentiles as a client
of the engine sees them (no HTTP: that layer is measured on the CPU), output tokens/s,
and the fraction of wall time the device spent in steps (busy), then checks the seed's
bar: TTFT p95 <= 1 s, ITL p95 < 50 ms, busy > 80%.

Runs from benchmarks/h200_attention.py (last), or alone:

    python3 benchmarks/h200_serving.py [--concurrency 64] [--seconds 60] [--out FILE]
    python3 benchmarks/h200_serving.py --cpu-smoke      # tiny shapes on the CPU: it runs

The accelerator image has no trio or msgspec (the engine needs both): carry their wheels
as the device README says (`trio sniffio outcome attrs sortedcontainers idna msgspec`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SLO = {"ttft_p95_s": 1.0, "itl_p95_s": 0.05, "busy_min": 0.8}


class _Detokenizer:
    """Random weights have no tokenizer: every token is one character of text."""

    class _Decoder:
        def push(self, token_id: int) -> str:
            return "x"

        def flush(self) -> str:
            return ""

    def incremental(self, prompt_ids):
        return self._Decoder()


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def bench_serving(*, smoke: bool = False, concurrency: int = 64, seconds: float = 60.0,
                  runner_opts: dict | None = None) -> dict:
    """`smoke`: tiny shapes and the CPU backend (the kernels' interpret mode is checked by
    the attention benchmark; a serving window needs steps that take milliseconds)."""
    import trio

    from config.settings import SchedulerConfig
    from model.presets import get_preset
    from model.runner import ModelRunner
    from model.weights import init_random_params
    from scheduler.api import (ErrorEvent, FinishEvent, GenerateRequest, Overloaded,
                               TokenEvent)
    from scheduler.engine import Engine
    from scheduler.protocol import SamplingParams

    t_start = time.perf_counter()
    preset = "tiny" if smoke else "llama3-8b"
    system, question, answer = ((40, (5, 30), 8) if smoke else (2000, (100, 1000), 200))
    concurrency = min(concurrency, 4) if smoke else concurrency
    seconds = min(seconds, 5.0) if smoke else seconds
    mc = get_preset(preset)
    params = init_random_params(mc, seed=0, dtype="bfloat16")
    decode = (4,) if smoke else (16, concurrency)
    runner = ModelRunner(mc, params, page_size=16,
                         kv_cache_bytes=(32 << 20) if smoke else (40 << 30),
                         max_context=512 if smoke else 4096, decode_buckets=decode,
                         prefill_buckets=(64,) if smoke else (512,),
                         mixed_decode_buckets=(max(decode),), dtype="bfloat16",
                         time_all_shapes=True, **(runner_opts or {}))
    del params
    t = time.perf_counter()
    runner.warmup()
    out: dict = {"model": preset, "tp": 1, "concurrency": concurrency,
                 "system_prompt_tokens": system, "answer_tokens": answer,
                 "compile_s": round(time.perf_counter() - t, 1)}
    sched = SchedulerConfig(max_running=max(decode), max_waiting=4 * concurrency,
                            max_step_tokens=max(decode) + (64 if smoke else 512),
                            ttft_target_s=0.0, queue_deadline_s=600.0)
    engine = Engine(runner, _Detokenizer(), sched, name="h200/0")
    rng = random.Random(0)
    shared = [rng.randrange(10, mc.vocab_size) for _ in range(system)]
    ttft: list[float] = []
    itl: list[float] = []
    tokens = [0]
    measuring = [False]

    async def client(i: int) -> None:
        crng = random.Random(i)
        while True:
            prompt = shared + [crng.randrange(10, mc.vocab_size)
                               for _ in range(crng.randint(*question))]
            req = GenerateRequest(prompt_ids=prompt, max_tokens=answer, ignore_eos=True,
                                  sampling=SamplingParams(temperature=0.0))
            try:
                handle = engine.submit(req)
            except Overloaded as e:
                await trio.sleep(max(0.01, e.retry_after_s))
                continue
            sent, last = time.perf_counter(), None
            async for ev in handle.events:
                now = time.perf_counter()
                if isinstance(ev, TokenEvent) and ev.token_ids:
                    if measuring[0]:
                        if last is None:
                            ttft.append(now - sent)
                        else:
                            itl.append((now - last) / len(ev.token_ids))
                        tokens[0] += len(ev.token_ids)
                    last = now
                elif isinstance(ev, (FinishEvent, ErrorEvent)):
                    break

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            for i in range(concurrency):
                nursery.start_soon(client, i)
            await trio.sleep(min(10.0, seconds / 3))  # the batch fills up first
            before, t0 = engine.stats(), time.perf_counter()
            measuring[0] = True
            await trio.sleep(seconds)
            measuring[0] = False
            after, wall = engine.stats(), time.perf_counter() - t0
            out["window_s"] = round(wall, 1)
            out["busy"] = round((after.busy_s - before.busy_s) / wall, 3)
            out["steps"] = after.steps - before.steps
            nursery.cancel_scope.cancel()

    trio.run(main)
    out["output_tok_s"] = round(tokens[0] / out["window_s"], 1)
    out["ttft_s"] = {"n": len(ttft), "p50": _pct(ttft, 0.5), "p95": _pct(ttft, 0.95)}
    out["itl_s"] = {"n": len(itl), "p50": _pct(itl, 0.5), "p95": _pct(itl, 0.95),
                    "mean": round(statistics.fmean(itl), 4) if itl else None}
    out["slo"] = dict(SLO)
    out["slo_met"] = bool(
        out["ttft_s"]["p95"] is not None and out["ttft_s"]["p95"] <= SLO["ttft_p95_s"]
        and out["itl_s"]["p95"] is not None and out["itl_s"]["p95"] < SLO["itl_p95_s"]
        and out["busy"] > SLO["busy_min"])
    out["total_s"] = round(time.perf_counter() - t_start, 1)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on the CPU: checks it runs")
    p.add_argument("--out")
    args = p.parse_args(argv)
    result = bench_serving(smoke=args.cpu_smoke, concurrency=args.concurrency,
                           seconds=args.seconds)
    if args.out:
        Path(args.out).write_text(json.dumps(result))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
