"""`sluice bench-engine`: the model runtime's own numbers, printed as one JSON line.

Measures, on whatever JAX backend is present: this machine's memory read bandwidth (a
jitted reduction over a buffer far larger than the caches), load time from GGUF and from
an orbax checkpoint, prefill tokens/s at several prompt lengths (chunked as the engine
does), decode tokens/s at several batch sizes with a 512-token context, and batch-1
decode as a fraction of the bandwidth floor (bytes a step must read / read bandwidth).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np


def measure_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 7) -> float:
    """GB/s for a jitted full read of a float32 buffer (median of `repeats`)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    f(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    del x
    return nbytes / statistics.median(times) / 1e9


def _plan(chunks):
    from scheduler.protocol import StepPlan

    return StepPlan(chunks=chunks)


def _chunk(seq_id, tokens, start, pages):
    from scheduler.protocol import SamplingParams, SeqChunk

    return SeqChunk(seq_id=seq_id, token_ids=tokens, start_pos=start, page_table=pages,
                    sample=True, sampling=SamplingParams(temperature=0.0))


def bench_prefill(runner, n_tokens: int, chunk: int, rng) -> float:
    ps = runner.page_size
    pages = list(range(1, 1 + -(-n_tokens // ps) + 1))
    toks = rng.integers(10, runner.config.vocab_size, n_tokens).tolist()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for s in range(0, n_tokens, chunk):
            runner.step(_plan([_chunk(0, toks[s:s + chunk], s, pages)]))
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
        return runner.step(_plan([_chunk(i, [last[i]], pos, tables[i]) for i in range(batch)]))

    for w in range(2):
        one(context + w)
    times = []
    for k in range(steps):
        t = time.perf_counter()
        one(context + 2 + k)
        times.append(time.perf_counter() - t)
    return batch / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sluice bench-engine", description=__doc__)
    ap.add_argument("--model", default="embedded", help="model source (default: embedded)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--decode-steps", type=int, default=12)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--skip-orbax", action="store_true")
    args = ap.parse_args(argv)

    from model.runner import ModelRunner, enable_compilation_cache
    from model.weights import load_model

    enable_compilation_cache()
    rng = np.random.default_rng(0)
    out: dict = {"backend": jax.default_backend(), "model": args.model}
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
                         prefill_buckets=(128, 512), dtype=args.dtype)
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
