"""The CPU's LoRA kernel alone against XLA's stacked-mask matmuls (issue 13).

For each token count: the four fused groups of SmolLM2-135M's shapes (q/k/v, o, gate/up,
down), 30 layers each in a `fori_loop`, 4 slots of rank 16 with the tokens spread over
them round-robin; the native kernel (`cpu_kernels/csrc/lora_delta.cc`) with bf16
slots, as beside int8 weights, and the stacked form (`model/llama.py`, `_lora_delta`)
in f32, as the step ran it before. Variants interleaved rep by rep; prints one JSON line
of the median and fastest milliseconds for the 30 layers of all four groups.

    .venv/bin/python benchmarks/experiments/lora_kernel.py [--reps 10] [--tokens 16,96]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.llama import _lora_delta  # noqa: E402
from cpu_kernels import native  # noqa: E402

LAYERS, SLOTS, RANK = 30, 4, 16
GROUPS = {"qkv": (576, (576, 192, 192)), "o": (576, (576,)),
          "gate_up": (576, (1536, 1536)), "down": (1536, (576,))}


def programs(t: int, rng):
    """(native, stacked) callables, each running the 30 layers of every group once."""
    slots = jnp.asarray(np.arange(t) % SLOTS, jnp.int32)
    mask = (slots[None, :] == jnp.arange(SLOTS)[:, None]).astype(jnp.float32)
    nat, stk = [], []
    for k, outs in GROUPS.values():
        n = sum(outs)
        bounds = np.concatenate([[0], np.cumsum(outs)]).astype(np.int32)
        x = jnp.asarray(rng.standard_normal((k, t)), jnp.float32)
        y = jnp.zeros((n, t), jnp.float32)
        a = rng.standard_normal((LAYERS, len(outs), SLOTS, RANK, k)).astype(np.float32)
        bs = [rng.standard_normal((LAYERS, SLOTS, RANK, o)).astype(np.float32) for o in outs]
        a_bf, b_bf = (jnp.asarray(v, jnp.bfloat16) for v in (a, native.pack_lora_b(bs)))
        a_st = jnp.asarray(a)
        b_st = [jnp.asarray(np.ascontiguousarray(b.transpose(0, 3, 1, 2))) for b in bs]

        @jax.jit
        def run_native(y, x, a, b, bounds=bounds):
            return jax.lax.fori_loop(0, LAYERS, lambda i, y: native.lora_delta(
                y, x, a, b, slots, i, bounds, feature_major=True), y)

        @jax.jit
        def run_stacked(y, x, a, bs, k=k):
            return jax.lax.fori_loop(0, LAYERS, lambda i, y: y + _lora_delta(
                x, a[i].reshape(-1, k), [b[i].reshape(b.shape[1], -1) for b in bs],
                mask, True), y)

        nat.append(lambda f=run_native, args=(y, x, a_bf, b_bf): f(*args))
        stk.append(lambda f=run_stacked, args=(y, x, a_st, b_st): f(*args))
    return ({"native_bf16": lambda fs=nat: [f().block_until_ready() for f in fs],
             "stacked_f32": lambda fs=stk: [f().block_until_ready() for f in fs]})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tokens", default="16,96")
    args = ap.parse_args(argv)
    ok, why = native.available()
    if not ok:
        print(json.dumps({"error": why}))
        return 1
    rng = np.random.default_rng(0)
    out = {"layers": LAYERS, "slots": SLOTS, "rank": RANK, "reps": args.reps, "tokens": {}}
    for t in (int(v) for v in args.tokens.split(",")):
        variants = programs(t, rng)
        for fn in variants.values():
            fn()  # compile
        times = {name: [] for name in variants}
        for _ in range(args.reps):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        out["tokens"][t] = {name: {"median_ms": round(1e3 * statistics.median(v), 2),
                                   "min_ms": round(1e3 * min(v), 2)}
                            for name, v in times.items()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
