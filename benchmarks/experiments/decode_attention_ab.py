"""Decode attention over rows' own pages: the native walk against the jnp row groups
(issue 20, point 3), through the CPU backend as the step calls it, 30 layers per call.

Cases: rows of one length (16 x 512, 16 x 2,000) and ragged ones (one row of 6,000
tokens beside 4 or 15 of 200: the long-interference workload's decode step). SmolLM2's
attention shapes (3 KV heads, 3 query heads each, head_dim 64), pages of 16 tokens
scattered over the pool, no shared prefix. Median of 7, ms. Prints one JSON line.

    .venv/bin/python benchmarks/experiments/decode_attention_ab.py
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from model.bench import median_time
from pallas_kernels import GroupLayout, PoolLayout, make_backend
from cpu_kernels.native import available

LAYERS, PAGES, PS, KVH, D, G = 30, 900, 16, 3, 64, 3
CASES = {"16x512": [512] * 16, "16x2000": [2000] * 16, "6000+4x200": [6000] + [200] * 4,
         "6000+15x200": [6000] + [200] * 15}


def main() -> int:
    ok, what = available()
    if not ok:
        print(json.dumps({"error": what}))
        return 1
    rng = np.random.default_rng(0)
    width = 6000 // PS + 8
    pool = PoolLayout(LAYERS, PAGES, PS, KVH, D, np.float32, width)
    k = jnp.asarray(rng.standard_normal(pool.shape).astype(np.float32))
    v = jnp.asarray(rng.standard_normal(pool.shape).astype(np.float32))
    out = {}
    for name, lens in CASES.items():
        rows = len(lens)
        tables = np.zeros((rows, width), np.int32)
        for r, n in enumerate(lens):
            tables[r, :-(-n // PS)] = rng.choice(np.arange(1, PAGES), -(-n // PS), replace=False)
        group = GroupLayout(tables, np.asarray(lens, np.int32), np.ones(rows, np.int32))
        q = jnp.asarray(rng.standard_normal((rows, 1, KVH * G, D)).astype(np.float32))
        res = {}
        for native in (True, False):
            be = make_backend("cpu", pool, native=native, prefix_copy_tokens=0)
            meta = be.prepare((k, v), (group, GroupLayout.empty(0, width)),
                              np.zeros(1, np.int32), [])[0]

            def body(c, i, be=be, meta=meta):
                return c + be.attend(q, k, v, i, meta, be.state)[0, 0, 0, 0], None
            f = jax.jit(lambda body=body: jax.lax.scan(body, jnp.float32(0),
                                                       jnp.arange(LAYERS))[0])
            res["native" if native else "jnp_groups"] = round(
                median_time(lambda f=f: f().block_until_ready()) * 1e3, 1)
        out[name] = res
    print(json.dumps({"unit": "ms per 30 layers", "cases": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
