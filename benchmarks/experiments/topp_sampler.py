"""The full sampler (top-p 0.9, temperature 1) on 16 rows of Gemma 3's 262,144-entry
vocabulary: peaked rows (a few likely tokens well above the rest, as a language model's)
and flat ones. `model/sampling.py keep_mask` narrows its search to the vocabulary's
blocks above its bound after its first steps where it can.

    .venv/bin/python benchmarks/experiments/topp_sampler.py

Prints one JSON line: the median milliseconds of 7 calls for each kind of row. Run it
from two checkouts (PYTHONPATH) for an A/B.
"""

import json
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from model.sampling import sample_full, sampling_batch
from scheduler.protocol import SamplingParams

V, R = 262144, 16
rng = np.random.default_rng(0)
out = {}
for dist in ("peaked", "flat"):
    logits = rng.standard_normal((R, V)).astype(np.float32) * 2
    if dist == "peaked":
        for r in range(R):
            logits[r, rng.integers(0, V, 8)] += rng.uniform(12, 20, 8)
    chunk = SimpleNamespace(sampling=SamplingParams(temperature=1.0, top_p=0.9),
                            num_generated=0, constraint=None, penalty_token_ids=[],
                            prompt_token_ids=[])
    sb = sampling_batch([chunk] * R, R, 1, np.random.default_rng(1), V)
    f = jax.jit(sample_full)
    x = jnp.asarray(logits)
    f(x, sb).block_until_ready()
    ts = []
    for _ in range(7):
        t = time.perf_counter(); f(x, sb).block_until_ready(); ts.append(time.perf_counter() - t)
    out[dist] = round(1000 * float(np.median(ts)), 1)
print(json.dumps(out))
