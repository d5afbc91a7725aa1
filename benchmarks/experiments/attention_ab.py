"""The CPU backend's attention settings, A/B in one process, on whole steps of the
embedded model's runner (default preset's int8 weights): steps of d decode rows sharing a
2,000-token system prompt (200 tokens of their own each), with or without a p-token
question chunk after the same prompt, a 256-token chunk of a 6,000-token prompt of its
own ("long"), that prompt's row decoding beside them ("longdec"), and the d decode rows
over four copies of the system prompt, d/4 rows each ("4p": four adapters' prefixes) or
6, 5, 3 and 2 of 16 ("4q": as a random pick of adapters spreads them),
once per variant (each runner its own, steps alternating between them).
A variant is `label=JSON` of `attention_options` (pallas_kernels/cpu.py), e.g.
`jnp={"native": false}` or `min8={"min_prefix_rows": 8}`; `min_prefix_rows` 1000 means
never (every row walks its whole context); `"kv_cache_dtype": "bfloat16"` (or "int8")
among them sets the runner's KV pool instead, and `"amx": false` keeps a bf16 pool's lane attention off
the AMX tile unit (the AVX-512 path) for that variant's steps, `"int8_dots": false`
scores an int8 pool's keys in f32 instead of int8 dots (VNNI builds), and
`"values_bf16": false` has the int8-dot walk add the values in f32 (BF16 builds). Median of 5 (`--reps`), ms. Prints one JSON line.

    .venv/bin/python benchmarks/experiments/attention_ab.py [--variants 'native={}' 'jnp={"native": false}']
        [--cases 16+0 4+longdec]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.runner import ModelRunner  # noqa: E402
from cpu_kernels import native  # noqa: E402
from model.weights import load_model  # noqa: E402
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan  # noqa: E402

PS, SYSTEM, OWN = 16, 2000 // 16 * 16, 200
LONG, LONG_CHUNK = 6000 // 16 * 16, 256
CASES = [(1, 0), (2, 0), (4, 0), (8, 0), (12, 0), (16, 0), (0, 16), (4, 16), (16, 16),
         (0, 64), (4, "long"), (4, "longdec"), (16, "4p"), (16, "4q")]


def plan(decodes: int, chunk) -> StepPlan:
    greedy = SamplingParams(temperature=0.0)
    if chunk in ("long", "longdec"):  # its last 256 tokens, after 5,744 of its own, or
        # its next token after all 6,000, beside d decodes
        plan = globals()["plan"](decodes, 0)
        start = SYSTEM + (decodes + 1) * (OWN // PS + 1) * PS
        pages = list(range(start // PS + 1, (start + LONG) // PS + 1))
        n = LONG_CHUNK if chunk == "long" else 1
        chunk = SeqChunk(seq_id=98, token_ids=[9] * n, start_pos=LONG - n,
                         page_table=pages, sample=True, sampling=greedy)
        return StepPlan([*plan.chunks, chunk])
    copies = 4 if chunk in ("4p", "4q") else 1  # the system prompt in this many copies
    uneven = [0] * 6 + [1] * 5 + [2] * 3 + [3] * 2
    prefixes = [list(range(1 + c * (SYSTEM // PS), 1 + (c + 1) * (SYSTEM // PS)))
                for c in range(copies)]
    nxt, chunks = copies * (SYSTEM // PS) + 1, []
    for i in range(decodes):
        shared = prefixes[uneven[i] if chunk == "4q" else i * copies // max(decodes, 1)]
        own = list(range(nxt, nxt + OWN // PS + 1))
        nxt += len(own)
        chunks.append(SeqChunk(seq_id=i, token_ids=[5], start_pos=SYSTEM + OWN - 1,
                               page_table=shared + own, sample=True, sampling=greedy))
    if chunk and chunk not in ("4p", "4q"):
        own = list(range(nxt, nxt + chunk // PS + 1))
        chunks.append(SeqChunk(seq_id=99, token_ids=[7] * chunk, start_pos=SYSTEM,
                               page_table=prefixes[0] + own, sample=True, sampling=greedy))
    return StepPlan(chunks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["native={}", 'jnp={"native": false}'])
    ap.add_argument("--cases", nargs="+", help="only these cases (e.g. 16+0 4+longdec)")
    ap.add_argument("--reps", type=int, default=5, help="steps per variant and case")
    args = ap.parse_args(argv)
    loaded = load_model("embedded", progress=False)
    lib = native.load()
    runners, amx, dots, vbf16 = {}, {}, {}, {}

    def switch(label: str) -> None:  # the native walks' switches for this variant
        lib.sluice_lane_amx(int(amx[label]))
        lib.sluice_lane_int8_dots(int(dots[label]))
        lib.sluice_lane_values_bf16(int(vbf16[label]))

    for variant in args.variants:
        label, _, options = variant.partition("=")
        options = json.loads(options or "{}")
        kv = options.pop("kv_cache_dtype", "auto")  # the runner's, not the backend's
        amx[label] = options.pop("amx", True)
        dots[label] = options.pop("int8_dots", True)
        vbf16[label] = options.pop("values_bf16", True)
        r = ModelRunner(loaded.config, loaded.params, quantization="auto", page_size=PS,
                        kv_cache_bytes=1 << 30, max_context=8192,
                        decode_buckets=(1, 2, 4, 8, 16), prefill_buckets=(16, 64, 256),
                        mixed_decode_buckets=(4, 16), max_prefill_seqs=1,
                        kv_cache_dtype=kv, attention_options=options)
        switch(label)
        r.warmup()
        runners[label] = r
    out = {}
    for decodes, chunk in CASES:
        if args.cases and f"{decodes}+{chunk}" not in args.cases:
            continue
        p = plan(decodes, chunk)
        for label, r in runners.items():
            switch(label)
            r.step(p)
            r.step(p)
        times: dict[str, list[float]] = {label: [] for label in runners}
        for _ in range(args.reps):
            for label, r in runners.items():
                switch(label)
                t = time.perf_counter()
                r.step(p)
                times[label].append(time.perf_counter() - t)
        out[f"{decodes}+{chunk}"] = {label: round(statistics.median(v) * 1000, 1)
                                     for label, v in times.items()}
    print(json.dumps({"ms": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
