"""`sluice bench-engine`: the model runtime's own numbers, printed as one JSON line.

Measures, on whatever JAX backend is present:
- start-up, in fresh processes, of a replica of the default preset's pool as `sluice
  serve` builds it: `start_s` (process start to ready to serve: model read, essential
  shapes compiled) with an empty compile cache (`cold`) and with it filled (`warm`),
  `all_shapes_s` (until the background compile is done), and `rss_gb`: resident memory
  when ready, when idle with every shape compiled, and the peak;
- this machine's memory read bandwidth (a jitted reduction over a buffer far larger than
  the caches), load time from GGUF and from an orbax checkpoint, prefill tokens/s at
  several prompt lengths (chunked as the engine does), decode tokens/s at several batch
  sizes with a 512-token context, and batch-1 decode as a fraction of the bandwidth
  floor (bytes a step must read / read bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_T0 = time.perf_counter()  # a start-up child measures from here (imports included)

import jax
import jax.numpy as jnp
import numpy as np


def median_time(fn, repeats: int = 7) -> float:
    """Median seconds of `fn()` over `repeats` calls after one untimed call (`fn` must
    block until its result is ready). benchmarks/ time their parts with it too."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 7) -> float:
    """GB/s for a jitted full read of a float32 buffer (median of `repeats`)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    seconds = median_time(lambda: f(x).block_until_ready(), repeats)
    x.delete()  # 1 GB
    return nbytes / seconds / 1e9


def _plan(chunks):
    from scheduler.protocol import StepPlan

    return StepPlan(chunks=chunks)


def window_table(runner, seq: int, start: int, end: int) -> list[int]:
    """Sequence `seq`'s sliding page table for a chunk of positions ``[start, end)`` in a
    plan built by hand (here, benchmarks/, tests), where the runner gives its sliding
    layers pages of their own (`ModelRunner.window_pool`; empty where it does not). With
    no scheduler to keep one (scheduler/window_pages.py), each sequence takes a ring of
    the window pool's pages, enough for a window and the largest prefill bucket: a
    position's page is its turn of the ring, and pages before the window of the chunk's
    first query are 0, as the scheduler leaves released pages."""
    if not runner.window_pool:
        return []
    ps = runner.page_size
    ring = (runner.pool.window + runner.prefill_buckets[-1]) // ps + 3
    if (seq + 1) * ring >= runner.window_pool:
        raise ValueError(f"seq {seq}: the window pool ({runner.window_pool} pages) holds "
                         f"no ring of {ring} pages for it")
    first = max(0, start - runner.pool.window + 1) // ps
    return [0 if i < first else 1 + seq * ring + i % ring for i in range(-(-end // ps))]


def _chunk(runner, seq_id, tokens, start, pages):
    from scheduler.protocol import SamplingParams, SeqChunk

    return SeqChunk(seq_id=seq_id, token_ids=tokens, start_pos=start, page_table=pages,
                    sample=True, sampling=SamplingParams(temperature=0.0),
                    window_table=window_table(runner, seq_id, start, start + len(tokens)))


def bench_prefill(runner, n_tokens: int, chunk: int, rng) -> float:
    ps = runner.page_size
    pages = list(range(1, 1 + -(-n_tokens // ps) + 1))
    toks = rng.integers(10, runner.config.vocab_size, n_tokens).tolist()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for s in range(0, n_tokens, chunk):
            runner.step(_plan([_chunk(runner, 0, toks[s:s + chunk], s, pages)]))
        times.append(time.perf_counter() - t)
    return n_tokens / statistics.median(times)


def bench_decode(runner, batch: int, context: int, steps: int, rng) -> float:
    ps = runner.page_size
    per_seq = -(-(context + steps + 1) // ps)
    if 1 + batch * per_seq > runner.num_pages:
        raise ValueError(f"KV pool too small for {batch=} x {context=}")
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    last = rng.integers(10, runner.config.vocab_size, batch).tolist()

    def one(pos):
        return runner.step(_plan([_chunk(runner, i, [last[i]], pos, tables[i])
                                  for i in range(batch)]))

    for w in range(2):
        one(context + w)
    times = []
    for k in range(steps):
        t = time.perf_counter()
        one(context + 2 + k)
        times.append(time.perf_counter() - t)
    return batch / statistics.median(times)


def start_child(model: str | None) -> dict:
    """In a fresh process: build the default preset's first pool's replica as `sluice
    serve` does (its model unless `model`), and time it."""
    from config.settings import load_settings

    from . import host_memory
    from .runner import ModelRunner, enable_compilation_cache
    from .weights import load_model

    host_memory.limit_arenas()
    enable_compilation_cache()
    pool = load_settings().pools[0]
    loaded = load_model(model or pool.model, progress=False)
    runner = ModelRunner.for_pool(loaded.config, loaded.params, pool)
    del loaded
    runner.warm_essential()
    out = {"ready_s": time.perf_counter() - _T0, "rss_ready": host_memory.rss_bytes(),
           "shapes": len(runner.programs.all)}
    runner.warm_in_background()
    runner.programs.wait()
    out["all_shapes_s"] = time.perf_counter() - _T0
    time.sleep(1.0)
    out["rss_idle"] = host_memory.rss_bytes()
    out["rss_peak"] = host_memory.peak_rss_bytes()
    return out


def measure_start(model: str | None) -> dict:
    """Cold then warm start-up, each in a fresh process sharing one new compile cache."""
    runs = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "SLUICE_JAX_CACHE": cache}
        for kind in ("cold", "warm"):
            cmd = [sys.executable, "-m", "model.bench", "--start-child"]
            if model:
                cmd += ["--model", model]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    gb = lambda n: round(n / 1e9, 3)  # noqa: E731
    warm = runs["warm"]
    return {
        "start_s": {k: round(r["ready_s"], 1) for k, r in runs.items()},
        "all_shapes_s": {k: round(r["all_shapes_s"], 1) for k, r in runs.items()},
        "shapes": warm["shapes"],
        "rss_gb": {"ready": gb(warm["rss_ready"]), "idle": gb(warm["rss_idle"]),
                   "peak": gb(max(r["rss_peak"] for r in runs.values()))},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sluice bench-engine", description=__doc__)
    ap.add_argument("--model", default="embedded", help="model source (default: embedded)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto",
                    choices=("auto", "none", "int8", "q4_1"),
                    help="int8: the projections and lm_head as int8 weights, multiplied by "
                         "the CPU's native kernel; q4_1: the projections in Q4_1 blocks "
                         "times int8 activations; auto (the server's default): int8 on "
                         "the CPU, none elsewhere; none: the f32 weights")
    ap.add_argument("--decode-steps", type=int, default=12)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--skip-orbax", action="store_true")
    ap.add_argument("--skip-start", action="store_true",
                    help="skip the start-up measurement (two fresh processes)")
    ap.add_argument("--start-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.start_child:
        print(json.dumps(start_child(None if args.model == "embedded" else args.model)))
        return 0
    start = {} if args.skip_start else measure_start(
        None if args.model == "embedded" else args.model)

    from model.runner import ModelRunner, enable_compilation_cache
    from model.weights import load_model

    enable_compilation_cache()
    rng = np.random.default_rng(0)
    out: dict = {"backend": jax.default_backend(), "model": args.model, **start}
    out["read_bandwidth_gbps"] = round(measure_read_bandwidth(), 2)

    t = time.perf_counter()
    loaded = load_model(args.model, progress=False)
    load = {"gguf" if args.model == "embedded" or args.model.endswith(".gguf")
            else "source": round(time.perf_counter() - t, 2)}
    if not args.skip_orbax:
        from model.loaders.orbax_ckpt import save_orbax

        with tempfile.TemporaryDirectory() as d:
            save_orbax(loaded, f"{d}/ckpt")
            t = time.perf_counter()
            load_model(f"{d}/ckpt", progress=False)
            load["orbax"] = round(time.perf_counter() - t, 2)
    out["load_s"] = load

    batches = (1, 4, 16, 64)
    runner = ModelRunner(loaded.config, loaded.params, page_size=16,
                         kv_cache_bytes=3 << 30, max_context=4096, decode_buckets=batches,
                         prefill_buckets=(128, 512), mixed_decode_buckets=(0,),
                         dtype=args.dtype, quantization=args.quantization)
    t = time.perf_counter()
    runner.warmup()
    out["compile_s"] = round(time.perf_counter() - t, 1)
    out["runner"] = runner.describe()

    out["prefill_tok_s"] = {str(n): round(bench_prefill(runner, n, min(n, 512), rng), 1)
                            for n in (128, 512, 2048)}
    out["decode_tok_s"] = {str(b): round(bench_decode(runner, b, args.context,
                                                       args.decode_steps, rng), 1)
                           for b in batches}
    cfg = loaded.config
    weight_bytes = cfg.num_params() * jnp.dtype(runner.dtype).itemsize
    int8_bytes = runner.describe()["int8_weight_bytes"]
    if int8_bytes:  # projections and lm_head in int8: what a step reads (the norms and
        weight_bytes = int8_bytes  # the few embedding rows it looks up are KBs)
    kv_bytes = (args.context + 1) * runner.kv_bytes_per_token
    step_bytes = weight_bytes + kv_bytes
    floor_s = step_bytes / (out["read_bandwidth_gbps"] * 1e9)
    b1_step_s = 1.0 / out["decode_tok_s"]["1"]
    out["b1_step_ms"] = round(b1_step_s * 1e3, 2)
    out["b1_floor_ms"] = round(floor_s * 1e3, 2)
    out["b1_bytes_per_step"] = int(step_bytes)
    out["b1_roofline_fraction"] = round(floor_s / b1_step_s, 3)
    out["decode_16_over_1"] = round(out["decode_tok_s"]["16"] / out["decode_tok_s"]["1"], 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
