"""The CPU's lane attention kernels alone (cpu_kernels/csrc/lane_attention.cc): one
layer of the embedded model's shape (3 KV heads x 3 query heads, d 64, pages of 16,
random keys in scrambled pages), median of 20 calls, reported for 30 layers (one layer's
pool stays in cache: this is the kernels' compute, not the memory a step reads). Prefill
blocks of 16 / 64 / 256 queries at the end of 2,016 / 2,064 / 6,000 keys; a 2,000-token
prefix shared by 2 / 4 / 16 decode rows, and four such prefixes of 4 rows each (four
adapters' copies of one system prompt). Over each pool: f32, bf16 walked in vectors, and
bf16 on the AMX tile unit (where the CPU has it; `sluice_lane_amx` switches). Prints one
JSON line.

    .venv/bin/python benchmarks/experiments/lane_attention.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from cpu_kernels import native  # noqa: E402

P, PS, KVH, G, D, W = 1200, 16, 3, 3, 64, 400


def timed(f, *args, n: int = 20) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cases(k, v, rng) -> dict:
    out = {}
    tables = jnp.asarray(rng.permutation(np.arange(1, P))[:W][None].astype(np.int32))
    for nq, ctx in ((16, 2016), (64, 2064), (256, 6000)):
        q = jnp.asarray(rng.standard_normal((1, nq, KVH, G, D)).astype(np.float32) * D ** -0.5)
        f = jax.jit(lambda q, tb, ctx=ctx, nq=nq: native.prefill_attention(
            q, k, v, 0, tb, jnp.array([ctx]), jnp.array([nq])))
        s = timed(f, q, tables)
        mac = nq * KVH * G * D * 2 * (ctx - nq / 2)
        out[f"prefill_{nq}_at_{ctx}"] = {"ms_30_layers": round(s * 30e3, 1),
                                         "gmac_per_s": round(mac / s / 1e9, 1)}
    pages = jnp.asarray(np.arange(1, 4 * 125 + 1).reshape(4, 125).astype(np.int32))
    for rows, prefixes in ((2, 1), (4, 1), (16, 1), (16, 4)):
        q = jnp.asarray(rng.standard_normal((rows, KVH, G, D)).astype(np.float32) * D ** -0.5)
        length = jnp.array([2000] * prefixes + [0] * (4 - prefixes))
        of = jnp.asarray(np.arange(rows) % prefixes + 1, jnp.int32)
        f = jax.jit(lambda q, pg, length=length, of=of: native.prefix_attention(
            q, k, v, 0, pg, length, of))
        name = f"prefix_2000_rows_{rows}" + (f"_over_{prefixes}" if prefixes > 1 else "")
        out[name] = {"ms_30_layers": round(timed(f, q, pages) * 30e3, 1)}
    return out


def main() -> int:
    rng = np.random.default_rng(0)
    lib = native.load()
    k = rng.standard_normal((P, PS, KVH, D)).astype(np.float32)
    v = rng.standard_normal((P, PS, KVH, D)).astype(np.float32)
    kb, vb = (jnp.asarray(a, jnp.bfloat16).view(jnp.uint16) for a in (k, v))
    out = {"f32": cases(jnp.asarray(k), jnp.asarray(v), rng)}
    lib.sluice_lane_amx(0)
    out["bf16_vectors"] = cases(kb, vb, rng)
    if lib.sluice_lane_amx(1):
        out["bf16_amx"] = cases(kb, vb, rng)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
