"""Where a CPU step's time goes (issue 20's first point): the embedded model in the
default preset's runner, decode steps of 1/4/16 rows at 0.1k/2k/6k tokens of context
(each row its own pages, and, from 2k, rows sharing a 2,000-token prefix as one customer's
system prompt does, and from 8 rows, rows over four copies of it, as four adapters' are), and the mixed step (16 decodes beside a 256-token prompt chunk).

Each part is timed alone, compiled the way the step compiles it, on the same arrays:
- `matmul_<projection>`: the 30 layers' fused q/k/v, attention output, gate/up and down
  projections for the step's rows (per-layer weights as the runner holds them);
- `lm_head` (the sampled rows only) and `sample_greedy` / `sample_full` (the samplers);
- `attention`: the backend's attention over the 30 layers for the step's layout (page
  gathers, the prefix-shared part and each row's own pages, softmax merges: one cascade);
- `host`: packing the plan and the backend's metadata (prefix groups, prefix copy);
- `step`: the runner's whole step (`ModelRunner.step`, greedy), and `rest` what the parts
  above do not cover (norms, rope, the KV writes, residual adds, dispatch).
Medians of `--repeats` runs. Prints one JSON line: {"cases": [...]}.

    .venv/bin/python benchmarks/profile_step.py [--repeats 5] [--quick] [--quantization int8]
        [--rows 1,16] [--contexts 100,2000] [--no-mixed]

With `--quantization int8` (or `q4_1`) the runner holds int8 (Q4_1) weights
(model/quant.py) and the projections and the lm_head are timed through the native
kernels, as every shape runs them.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from config.settings import PoolConfig
from model.bench import median_time, window_table
from model.llama import _per_layer, head_logits
from model.packing import pack, split
from model.quant import Int8Matrix, BlockMatrix, linear
from model.runner import ModelRunner
from model.weights import load_model
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan

PROJECTIONS = (("attn", "wqkv"), ("attn", "wo"), ("mlp", "w_gate_up"), ("mlp", "w_down"))


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` (which must block until its result is ready)."""
    return median_time(fn, repeats)


class Profiler:
    def __init__(self, repeats: int, max_context: int, quantization: str = "none",
                 model: str = "embedded") -> None:
        m = load_model(model, progress=False)
        self.cfg = m.config
        pool = PoolConfig(kv_cache_bytes=(max_context + 4096 + 3 * 2000) * 46080,
                          mixed_decode_buckets=[16], prefill_buckets=[256],
                          quantization=quantization)
        self.runner = r = ModelRunner.for_pool(m.config, m.params, pool)
        r.warmup()
        self.repeats = repeats
        self.fm = r.feature_major
        self._matmul = {}
        self._attn = {}

    # -- plans --------------------------------------------------------------------------
    def decode_plan(self, rows: int, context: int, shared: bool,
                    prefixes: int = 1) -> StepPlan:
        """`rows` decode rows at `context` tokens. Own pages: every row walks the same
        physical pages in a rotated order (no two tables share a first page, so the
        backend sees no common prefix; the bytes read are a distinct row's). Shared: the
        first 2,000 tokens' pages in common, the rest rotated; with `prefixes` > 1 the
        rows are dealt round-robin to that many copies of those pages (distinct pages, as
        several adapters' or customers' system prompts are)."""
        ps = self.runner.page_size
        n = -(-(context + 1) // ps)
        pages = np.arange(1, n + 1)
        common = (2000 // ps) if shared else 0
        own = pages[common:]
        chunks = []
        for i in range(rows):
            copy = i % prefixes
            head = pages[:common] if copy == 0 else n + (copy - 1) * common + pages[:common]
            table = list(head) + list(np.roll(own, i * max(1, len(own) // rows)))
            chunks.append(SeqChunk(seq_id=i, token_ids=[5], start_pos=context,
                                   page_table=table, sample=True,
                                   sampling=SamplingParams(temperature=0.0),
                                   window_table=window_table(self.runner, i, context,
                                                             context + 1)))
        return StepPlan(chunks)

    def mixed_plan(self, rows: int, context: int) -> StepPlan:
        plan = self.decode_plan(rows, context, shared=True)
        ps = self.runner.page_size
        n = -(-(2000 + 256) // ps)
        table = list(range(1, 2000 // ps + 1)) + list(range(2000 // ps + 1, n + 1))
        plan.chunks.append(SeqChunk(seq_id=99, token_ids=[7] * 256, start_pos=2000,
                                    page_table=table, sample=True,
                                    sampling=SamplingParams(temperature=0.0),
                                    window_table=window_table(self.runner, rows, 2000, 2256)))
        return plan

    # -- parts --------------------------------------------------------------------------
    def matmul(self, group: str, name: str, rows: int) -> float:
        r, cfg = self.runner, self.cfg
        params = r.params
        weights = r.params["layers"][group]
        first = weights[0] if isinstance(weights, tuple) else weights
        w = first[name]
        if isinstance(w, Int8Matrix):  # stacked (layers, out, in)
            n_in = w.q.shape[2]
        elif isinstance(w, BlockMatrix):  # (layers, out / 8, in / 32, 160)
            n_in = w.q.shape[2] * 32
        else:
            w = w if isinstance(weights, tuple) else w[0]
            n_in = w.shape[1] if self.fm else w.shape[0]
        key = (group, name, rows)
        if key not in self._matmul:
            fm = self.fm

            def body(params, x):
                def layer(acc, i):
                    y = _per_layer(params["layers"][group], i,
                                   lambda lp, x: linear(x, lp[name], feature_major=fm), x)
                    return acc + y.sum(), None
                return jax.lax.scan(layer, jnp.float32(0),
                                    jnp.arange(cfg.num_layers, dtype=jnp.int32))[0]
            self._matmul[key] = jax.jit(body)
        x = jnp.ones((n_in, rows) if self.fm else (rows, n_in), jnp.float32)
        f = self._matmul[key]
        return timed(lambda: f(params, x).block_until_ready(), self.repeats)

    def head(self, rows: int) -> dict:
        r = self.runner
        t = rows
        x = jnp.ones((self.cfg.hidden_size, t) if self.fm else (t, self.cfg.hidden_size))
        f = jax.jit(functools.partial(head_logits, cfg=self.cfg, feature_major=self.fm))
        out = {"lm_head": timed(lambda: f(r.params, x).block_until_ready(), self.repeats)}
        srows = 1 << max(0, rows - 1).bit_length()
        logits = jnp.asarray(np.random.default_rng(0).standard_normal(
            (srows, self.cfg.vocab_size)), jnp.float32)
        chunks = [SeqChunk(seq_id=i, token_ids=[1], start_pos=0, page_table=[1], sample=True,
                           sampling=SamplingParams(temperature=1.0, top_p=0.9))
                  for i in range(rows)]
        for kind in ("greedy", "full"):
            s = r._samplers[(kind, srows)]
            args = r._sampling_args(kind, srows, chunks)
            out[f"sample_{kind}"] = timed(lambda: jax.block_until_ready(s(logits, *args)), self.repeats)
        return out

    def attention_and_host(self, plan: StepPlan) -> dict:
        r = self.runner
        dec, pf, need = split(plan, r.limits.max_decode_seqs, r.block_q)
        bucket = r.programs.pick(need)

        def host():
            layout = pack(dec, pf, bucket, page_size=r.page_size, block_q=r.block_q,
                          pages_per_seq=r.pool.pages_per_seq,
                          n_samples=r._sample_rows(bucket), windowed=bool(r.window_pool))
            return layout, r._batch(layout, [])

        t_host = timed(host, self.repeats)
        layout, batch = host()
        cfg = self.cfg
        h, d = cfg.num_heads, cfg.head_dim
        att = r.attention
        windowed = jnp.asarray(cfg.windowed)  # sliding layers read their window only
        if bucket not in self._attn:
            def body(kv, b, state):
                def layer(acc, i):
                    total = acc
                    if bucket.dec_rows:
                        q = jnp.ones((bucket.dec_rows, 1, h, d), kv[0].dtype)
                        total = total + att.attend_layer(q, kv[0], kv[1], i, b.decode, state,
                                                         windowed[i]).sum()
                    if bucket.pf_tokens:
                        blocks = bucket.pf_tokens // r.block_q
                        q = jnp.ones((blocks, r.block_q, h, d), kv[0].dtype)
                        total = total + att.attend_layer(q, kv[0], kv[1], i, b.prefill, state,
                                                         windowed[i]).sum()
                    return total, None
                return jax.lax.scan(layer, jnp.float32(0),
                                    jnp.arange(cfg.num_layers, dtype=jnp.int32))[0]
            self._attn[bucket] = jax.jit(body)
        f = self._attn[bucket]
        t_attn = timed(lambda: f(r.kv, batch, att.state).block_until_ready(), self.repeats)
        t_step = timed(lambda: r.step(plan), self.repeats)
        return {"host": t_host, "attention": t_attn, "step": t_step,
                "shape": list(bucket)}

    def case(self, name: str, rows: int, context: int, plan: StepPlan,
             prefill_tokens: int = 0) -> dict:
        out = {"case": name, "rows": rows, "context": context}
        t = rows + prefill_tokens
        for group, proj in PROJECTIONS:
            out[f"matmul_{proj}"] = self.matmul(group, proj, t)
        out.update(self.head(rows + (1 if prefill_tokens else 0)))
        out.update(self.attention_and_host(plan))
        parts = (sum(out[f"matmul_{p}"] for _, p in PROJECTIONS) + out["lm_head"]
                 + out["sample_greedy"] + out["attention"] + out["host"])
        out["rest"] = out["step"] - parts
        return {k: (round(v * 1e3, 2) if isinstance(v, float) else v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="16 rows at 2k only")
    ap.add_argument("--model", default="embedded", help="model source (embedded:gemma3-270m)")
    ap.add_argument("--quantization", default="none", choices=("none", "int8", "q4_1"))
    ap.add_argument("--rows", default=None, help="row counts, e.g. 1,16 (default 1,4,16)")
    ap.add_argument("--contexts", default=None, help="e.g. 100,2000 (default 100,2000,6000)")
    ap.add_argument("--no-mixed", action="store_true", help="skip the mixed step")
    args = ap.parse_args(argv)
    contexts = (2000,) if args.quick else (100, 2000, 6000)
    if args.contexts:
        contexts = tuple(int(c) for c in args.contexts.split(","))
    row_counts = (16,) if args.quick else (1, 4, 16)
    if args.rows:
        row_counts = tuple(int(r) for r in args.rows.split(","))
    p = Profiler(args.repeats, max(contexts), args.quantization, args.model)
    cases = []
    for rows in row_counts:
        for ctx in contexts:
            cases.append(p.case("decode-own", rows, ctx, p.decode_plan(rows, ctx, False)))
            if ctx >= 2000:
                cases.append(p.case("decode-shared", rows, ctx,
                                    p.decode_plan(rows, ctx, True)))
                if rows >= 8:
                    cases.append(p.case("decode-4-prefixes", rows, ctx,
                                        p.decode_plan(rows, ctx, True, prefixes=4)))
            print(json.dumps(cases[-1]), file=sys.stderr)
    if not args.no_mixed:
        cases.append(p.case("mixed", 16, 2000, p.mixed_plan(16, 2000), prefill_tokens=256))
    print(json.dumps({"unit": "ms", "quantization": args.quantization, "cases": cases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
