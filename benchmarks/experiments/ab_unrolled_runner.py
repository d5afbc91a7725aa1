"""This tree's runner against the unrolled runner of commit 4d3075e, interleaved in one process.

The machines here drift 10-40% over minutes, so two versions of the code run in separate
processes cannot be compared. This loads the baseline's `model/` and `pallas_kernels/`
under other names (copied to a temporary folder, `pallas_kernels` renamed inside them),
builds both runners on the same random weights of the embedded model's shapes (f32),
and alternates their steps: the steps of `cpu_step_ab.py` (a decode step of 16 sequences
sharing a 2,000-token system prompt, a mixed step of 15 decodes and a 70-token question,
a long mixed step) plus a one-sequence decode step, and a cold 2,000-token prefill in
196-token chunks. Prints one JSON line: median milliseconds per step, the warm-up time
of each, and the largest logit difference between them.

    git worktree add /tmp/unrolled 4d3075e
    .venv/bin/python benchmarks/experiments/ab_unrolled_runner.py --baseline /tmp/unrolled [--reps 16]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.runner import ModelRunner, enable_compilation_cache  # noqa: E402
from model.weights import load_model  # noqa: E402
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan  # noqa: E402
from cpu_step_ab import LONG_AT, LONG_CHUNK, QUESTION, SEQS, SYSTEM  # noqa: E402
from cpu_step_ab import workload  # noqa: E402  (a script beside this one: the same steps)

PS = 16
RUNNER = dict(page_size=PS, kv_cache_bytes=1 << 30, decode_buckets=[1, 4, SEQS],
              prefill_buckets=(80, 256), dtype="float32")


def baseline_runner(tree: Path, loaded):
    """The baseline's ModelRunner, its packages imported as old_model/old_pallas_kernels."""
    tmp = Path(tempfile.mkdtemp())
    for name in ("model", "pallas_kernels"):
        shutil.copytree(tree / name, tmp / f"old_{name}")
    for py in tmp.rglob("*.py"):
        py.write_text(py.read_text().replace("pallas_kernels", "old_pallas_kernels"))
    sys.path.insert(0, str(tmp))
    from old_model.runner import ModelRunner as OldRunner

    r = OldRunner(loaded.config, loaded.params, **RUNNER)
    for b in r.buckets():
        if b.dec_seqs in (0, 1, 4, SEQS):
            r._warm_forward(b)
    for key in r._sampler_keys():
        r._warm_sampler(key)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout of 4d3075e")
    ap.add_argument("--reps", type=int, default=16)
    args = ap.parse_args(argv)
    enable_compilation_cache()
    loaded = load_model("random:smollm2-135m", progress=False)
    warm = {}
    t = time.perf_counter()
    old = baseline_runner(args.baseline, loaded)
    warm["unrolled"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    new = ModelRunner(loaded.config, loaded.params, **RUNNER)
    new.warmup()
    warm["scan"] = round(time.perf_counter() - t, 1)
    runners = {"unrolled": old, "scan": new}

    own, tables, long_table, cold = workload(args.reps, PS)
    greedy = SamplingParams(temperature=0.0)

    def chunk(i, toks, start, table=None, sample=True):
        return SeqChunk(i, toks, start, table or tables[i], sample, greedy)

    def decodes(n, k):
        return [chunk(i, [5], SYSTEM + int(own[i]) + k) for i in range(n)]

    steps = {
        "decode16": lambda k: StepPlan(decodes(SEQS, k)),
        "decode1": lambda k: StepPlan(decodes(1, k)),
        "mixed": lambda k: StepPlan(decodes(SEQS - 1, k) + [chunk(SEQS - 1, [7] * QUESTION,
                                                                    SYSTEM)]),
        "long_mixed": lambda k: StepPlan(decodes(4, k) + [
            chunk(98, [9] * LONG_CHUNK, LONG_AT, long_table, sample=False),
            chunk(SEQS - 1, [7] * QUESTION, SYSTEM)]),
    }
    for r in runners.values():  # the KV the steps read: written once, same in both pools
        r.step(steps["decode16"](0))
    logits = [r.step(steps["mixed"](1), return_logits=True).logits for r in runners.values()]
    diff = max(float(np.abs(logits[0][s] - logits[1][s]).max()) for s in logits[0])

    def prefill(r):
        for a in range(0, SYSTEM, 196):
            r.step(StepPlan([chunk(99, [9] * min(196, SYSTEM - a), a, cold)]))

    times = {n: {k: [] for k in [*steps, "prefill"]} for n in runners}
    for rep in range(args.reps):
        for kind, plan in steps.items():
            for name, r in runners.items():
                t = time.perf_counter()
                r.step(plan(2 + rep))
                times[name][kind].append(time.perf_counter() - t)
        if rep % 5 == 0:
            for name, r in runners.items():
                t = time.perf_counter()
                prefill(r)
                times[name]["prefill"].append(time.perf_counter() - t)
    print(json.dumps({"reps": args.reps, "max_logit_diff": diff, "warmup_s": warm,
                      "median_ms": {n: {k: round(1e3 * statistics.median(v), 1)
                                        for k, v in t.items()} for n, t in times.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
