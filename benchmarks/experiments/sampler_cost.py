"""The on-device sampler alone, jitted: milliseconds per call for a batch of rows over the
embedded model's vocabulary, greedy (the `greedy` variant, and greedy rows in `full` as a
logit bias or a grammar mask puts them) and sampled (temperature 0.7, with and without
top-p 0.9). Prints one JSON line of medians.

    .venv/bin/python benchmarks/experiments/sampler_cost.py [--rows 16] [--reps 20]
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

from model import sampling  # noqa: E402
from scheduler.protocol import SamplingParams, SeqChunk  # noqa: E402

VOCAB = 49152  # SmolLM2's


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal(
        (args.rows, VOCAB)).astype(np.float32))

    def timed(fn, *a) -> float:
        np.asarray(fn(*a))
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter()
            np.asarray(fn(*a))
            ts.append(time.perf_counter() - t)
        return round(1e3 * statistics.median(ts), 2)

    full = jax.jit(sampling.sample_full)
    out = {"rows": args.rows, "vocab": VOCAB,
           "greedy_variant_ms": timed(jax.jit(sampling.sample_greedy), logits)}
    for name, sp in [("full_greedy_rows_ms", SamplingParams(temperature=0.0)),
                     ("full_temperature_ms", SamplingParams(temperature=0.7)),
                     ("full_top_p_ms", SamplingParams(temperature=0.7, top_p=0.9))]:
        rows = [SeqChunk(seq_id=i, token_ids=[1], start_pos=0, page_table=[1], sample=True,
                         sampling=sp) for i in range(args.rows)]
        sb = sampling.sampling_batch(rows, args.rows, 1, np.random.default_rng(0), VOCAB)
        out[name] = timed(full, logits, sb)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
