"""What tensor parallelism costs on this CPU: step times of SmolLM2's shapes (random
weights, f32) at TP = 1, 2, 4 on forced host devices, which share the same cores, so TP
can only be slower here (the collectives and the per-device programs on the same
threads); the point of TP on this machine is correctness (tests/model/test_tp.py).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        .venv/bin/python benchmarks/experiments/tp_step.py [--degrees 1,2,4] [--attention cpu]

    .venv/bin/python benchmarks/experiments/tp_step.py --processes 2

Prints one JSON line: per degree, the median time of a 16-row decode step at a 512-token
context and of one 256-token prefill step. `--processes N`: one TP=N replica over N
processes of one device each instead (model/multihost.py: jax.distributed with gloo,
every device call mirrored from process 0, which this script starts the others beside).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

ROWS, CONTEXT, PREFILL = 16, 512, 256


def runner_for(n_devices: int, attention: str, devices):
    from model.presets import PRESETS
    from model.runner import ModelRunner
    from model.weights import init_random_params

    cfg = PRESETS["smollm2-135m"]
    return ModelRunner(cfg, init_random_params(cfg, seed=0), page_size=16,
                       num_pages=ROWS * CONTEXT // 16 + 64, max_context=CONTEXT + 64,
                       decode_buckets=(ROWS,), prefill_buckets=(PREFILL,),
                       mixed_decode_buckets=(0,), max_prefill_seqs=1, dtype="float32",
                       quantization="none", attention=attention, devices=devices)


def measure(r) -> dict:
    from model.bench import median_time
    from scheduler.protocol import SamplingParams, SeqChunk, StepPlan

    greedy = SamplingParams(temperature=0.0)
    per = CONTEXT // 16
    decode = StepPlan([SeqChunk(i, [5], CONTEXT - 1, list(range(1 + i * per, 1 + (i + 1) * per)),
                                True, greedy) for i in range(ROWS)])
    prefill = StepPlan([SeqChunk(0, list(range(3, 3 + PREFILL)), 0,
                                 list(range(1, 1 + PREFILL // 16)), True, greedy)])
    return {"decode_step_ms": round(1000 * median_time(lambda: r.step(decode)), 1),
            "prefill_step_ms": round(1000 * median_time(lambda: r.step(prefill)), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degrees", default="1,2,4")
    ap.add_argument("--attention", default="cpu")
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--coordinator", default="127.0.0.1:12731")
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.processes > 1:
        return multi_process(args)
    import jax

    out = {"devices": len(jax.devices()), "attention": args.attention, "decode_rows": ROWS,
           "context": CONTEXT, "prefill_tokens": PREFILL, "degrees": {}}
    for n in (int(d) for d in args.degrees.split(",")):
        r = runner_for(n, args.attention, jax.devices()[:n])
        r.warmup()
        out["degrees"][n] = measure(r)
    print(json.dumps(out))


def multi_process(args) -> None:
    from model import multihost

    others = []
    if args.process_id == 0:
        others = [subprocess.Popen([sys.executable, *sys.argv, "--process-id", str(i)])
                  for i in range(1, args.processes)]
    multihost.initialize(args.coordinator, args.processes, args.process_id)
    import jax

    r = runner_for(args.processes, args.attention, jax.devices())
    if args.process_id:
        sys.exit(multihost.Follower().serve(r))
    r.mirror = multihost.Leader()
    r.warmup()
    out = {"processes": args.processes, "devices": len(jax.devices()),
           "attention": args.attention, "decode_rows": ROWS, "context": CONTEXT,
           "prefill_tokens": PREFILL, "degrees": {args.processes: measure(r)}}
    r.close()
    for p in others:
        p.wait()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
