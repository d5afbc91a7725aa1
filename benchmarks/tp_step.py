"""What tensor parallelism costs on this CPU: step times of SmolLM2's shapes (random
weights, f32) at TP = 1, 2, 4 on forced host devices, which share the same cores, so TP
can only be slower here (the collectives and the per-device programs on the same
threads); the point of TP on this machine is correctness (tests/model/test_tp.py).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        .venv/bin/python benchmarks/tp_step.py [--degrees 1,2,4] [--attention cpu]

Prints one JSON line: per degree, the median time of a 16-row decode step at a 512-token
context and of one 256-token prefill step.
"""

from __future__ import annotations

import argparse
import json

import jax

from model.bench import median_time
from model.presets import PRESETS
from model.runner import ModelRunner
from model.weights import init_random_params
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan

ROWS, CONTEXT, PREFILL = 16, 512, 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degrees", default="1,2,4")
    ap.add_argument("--attention", default="cpu")
    args = ap.parse_args()
    cfg = PRESETS["smollm2-135m"]
    params = init_random_params(cfg, seed=0)
    greedy = SamplingParams(temperature=0.0)
    out = {"devices": len(jax.devices()), "attention": args.attention, "decode_rows": ROWS,
           "context": CONTEXT, "prefill_tokens": PREFILL, "degrees": {}}
    for n in (int(d) for d in args.degrees.split(",")):
        r = ModelRunner(cfg, params, page_size=16, num_pages=ROWS * CONTEXT // 16 + 64,
                        max_context=CONTEXT + 64, decode_buckets=(ROWS,),
                        prefill_buckets=(PREFILL,), mixed_decode_buckets=(0,),
                        max_prefill_seqs=1, dtype="float32", quantization="none",
                        attention=args.attention, devices=jax.devices()[:n])
        r.warmup()
        per = CONTEXT // 16
        decode = StepPlan([SeqChunk(i, [5], CONTEXT - 1, list(range(1 + i * per,
                                                                    1 + (i + 1) * per)),
                                    True, greedy) for i in range(ROWS)])
        prefill = StepPlan([SeqChunk(0, list(range(3, 3 + PREFILL)), 0,
                                     list(range(1, 1 + PREFILL // 16)), True, greedy)])
        out["degrees"][n] = {
            "decode_step_ms": round(1000 * median_time(lambda: r.step(decode)), 1),
            "prefill_step_ms": round(1000 * median_time(lambda: r.step(prefill)), 1),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
