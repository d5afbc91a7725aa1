"""The model runner: turns a `StepPlan` into device arrays, runs a precompiled step, and
returns one sampled token per sequence with a single device-to-host copy.

Shapes are fixed by buckets: a step is (decode sequences, prefill tokens). Every bucket
pair is compiled ahead of time by `warmup()` and the executables are kept in a dict; a
step whose shape has no executable is a bug, never a silent compile. The KV pool is
allocated once at construction (page 0 is the null page that padding writes to) and
donated into every step so XLA updates it in place.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from scheduler.protocol import StepLimits, StepPlan, StepResult

from . import sampling
from .config import ModelConfig
from .llama import StepBatch, forward, prepare_params, rope_inv_freq

_COPY_BUCKET = 16
_SHARED_BLOCK_PAGES = 64  # = reference.paged_attention_reference's default


def enable_compilation_cache(path: str | None = None) -> str:
    """Persist compiled executables across processes (restarts, test runs)."""
    path = path or os.environ.get("SLUICE_JAX_CACHE") or os.path.join(
        os.environ.get("SLUICE_CACHE", os.path.expanduser("~/.cache/sluice")), "jax")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def resolve_dtype(dtype: str):
    if dtype in ("auto", None):
        return jnp.bfloat16 if jax.default_backend() in ("gpu", "tpu") else jnp.float32
    return {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16,
            "bf16": jnp.bfloat16, "float16": jnp.float16}[dtype]


@dataclass(frozen=True)
class Bucket:
    dec_seqs: int
    pf_tokens: int


class ModelRunner:
    """Implements `scheduler.protocol.Runner` for the Llama family in JAX."""

    def __init__(
        self,
        config: ModelConfig,
        params: dict,
        *,
        eos_token_ids: Iterable[int] = (),
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_bytes: int = 1 << 30,
        max_context: int | None = None,
        decode_buckets: Iterable[int] = (1, 2, 4, 8, 16, 32, 64),
        prefill_buckets: Iterable[int] = (64, 256, 512),
        block_q: int = 16,
        max_prefill_seqs: int = 4,
        dtype: str = "auto",
        attention_impl: str | None = None,
        pages_per_block: int = 8,
        decode_rows_per_group: int | None = 8,
        group_prefill_blocks: bool = True,
        prefix_buffer_tokens: int = 4096,
        feature_major: bool | None = None,
    ) -> None:
        self.config = cfg = config
        self.dtype = resolve_dtype(dtype)
        self.page_size = page_size
        self.block_q = block_q
        self.max_context = min(max_context or cfg.max_position, cfg.max_position)
        self.eos_token_ids = frozenset(eos_token_ids or cfg.eos_token_ids)
        self.decode_buckets = sorted(set(decode_buckets))
        self.prefill_buckets = sorted(set(prefill_buckets))
        for b in self.prefill_buckets:
            if b % block_q:
                raise ValueError(f"prefill bucket {b} must be a multiple of {block_q=}")
        self.max_prefill_seqs = max_prefill_seqs
        self.pages_per_block = pages_per_block
        # Attention walks each group of this many decode rows (sorted longest first) only
        # as far as the group's longest sequence; None: all rows as far as the longest.
        self.decode_rows_per_group = decode_rows_per_group
        # Prefill blocks, sorted by context (longest first), walk in groups of halving size
        # (8, 4, 2, 1, 1 of 16 blocks): a short prompt's blocks beside a chunk of a long
        # one then stop at their own length instead of walking the long prompt's keys.
        self.group_prefill_blocks = group_prefill_blocks
        # Page-table width: a multiple of the attention's block sizes (the reference walks
        # shared prefixes 64 pages at a time).
        pages_per_seq = math.ceil(self.max_context / page_size)
        align = math.lcm(pages_per_block, _SHARED_BLOCK_PAGES)
        self.pages_per_seq = math.ceil(pages_per_seq / align) * align
        # The reference attention's shared block (`shared_pages_per_block`), in pages.
        self._shared_block_pages = min(_SHARED_BLOCK_PAGES, self.pages_per_seq)
        from pallas_kernels import default_impl

        self.attention_impl = attention_impl or default_impl()

        itemsize = jnp.dtype(self.dtype).itemsize
        self.kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
        page_bytes = self.kv_bytes_per_token * page_size
        if num_pages is None:
            num_pages = max(2, kv_cache_bytes // page_bytes)
        self.num_pages = int(num_pages)
        self.kv_bytes = self.num_pages * page_bytes

        # Feature-major residual stream (weights (out, in), multiplied from the left): faster
        # on XLA:CPU at few rows (model/llama.py, forward); not measured on a GPU yet.
        self.feature_major = (jax.default_backend() == "cpu" if feature_major is None
                              else feature_major)
        self.params = prepare_params(params, cfg, self.dtype, feature_major=self.feature_major)
        shape = (self.num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv = tuple((jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
                        for _ in range(cfg.num_layers))
        # The CPU attention reads a shared prefix (the system prompt) from a contiguous
        # copy instead of gathering its pages every step; the GPU kernels read pages.
        self.prefix: PrefixBuffer | None = None
        if self.attention_impl == "reference" and prefix_buffer_tokens > 0:
            self.prefix = PrefixBuffer(cfg, self.dtype, page_size, prefix_buffer_tokens,
                                       block_pages=self._shared_block_pages)
        self._inv_freq = rope_inv_freq(cfg)
        self._fwd: dict[Bucket, Callable] = {}
        self._samplers: dict[tuple[str, int, int], Callable] = {}
        self._copy = None
        self._lock = threading.Lock()
        self._rng = np.random.default_rng()
        self.compile_seconds = 0.0

    # ----------------------------------------------------------------- limits and buckets
    @property
    def limits(self) -> StepLimits:
        max_pf = self.prefill_buckets[-1] if self.prefill_buckets else 0
        # Each chunk pads up to a multiple of block_q; keep the worst case inside the bucket.
        budget = max(0, max_pf - self.max_prefill_seqs * (self.block_q - 1))
        return StepLimits(
            max_decode_seqs=self.decode_buckets[-1] if self.decode_buckets else 0,
            max_prefill_seqs=self.max_prefill_seqs if max_pf else 0,
            max_prefill_chunk=budget,
            max_prefill_tokens=budget,
        )

    def buckets(self) -> list[Bucket]:
        out = []
        for d in [0, *self.decode_buckets]:
            for p in [0, *self.prefill_buckets]:
                if d or p:
                    out.append(Bucket(d, p))
        return out

    def _sample_rows(self, bucket: Bucket) -> int:
        return bucket.dec_seqs + min(bucket.pf_tokens // self.block_q, self.max_prefill_seqs)

    def describe(self) -> dict:
        return {
            "model": self.config.name,
            "dtype": jnp.dtype(self.dtype).name,
            "attention": self.attention_impl,
            "page_size": self.page_size,
            "num_pages": self.num_pages,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_cache_bytes": self.kv_bytes,
            "kv_capacity_tokens": (self.num_pages - 1) * self.page_size,
            "max_context": self.max_context,
            "buckets": len(self.buckets()),
            "prefix_buffer_tokens": self.prefix.tokens if self.prefix else 0,
            "feature_major": self.feature_major,
        }

    # ------------------------------------------------------------------------ compiling
    def _batch_shapes(self, b: Bucket) -> StepBatch:
        blocks = b.pf_tokens // self.block_q
        t = b.dec_seqs + b.pf_tokens
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
        return StepBatch(
            tokens=i32(t), positions=i32(t), slots=i32(t),
            dec_page_tables=i32(b.dec_seqs, self.pages_per_seq),
            dec_context_lens=i32(b.dec_seqs),
            dec_shared_pages=i32(self.pages_per_seq), dec_shared_len=i32(),
            dec_buffered_len=i32(),
            pf_page_tables=i32(blocks, self.pages_per_seq),
            pf_context_lens=i32(blocks), pf_query_lens=i32(blocks),
            pf_shared_pages=i32(self.pages_per_seq), pf_shared_len=i32(),
            pf_buffered_len=i32(),
            sample_idx=i32(self._sample_rows(b)),
        )

    def _compile_forward(self, b: Bucket) -> Callable:
        fn = functools.partial(
            forward, cfg=self.config, inv_freq=self._inv_freq, dec_seqs=b.dec_seqs,
            pf_blocks=b.pf_tokens // self.block_q, block_q=self.block_q,
            page_size=self.page_size, attention_impl=self.attention_impl,
            pages_per_block=self.pages_per_block,
            dec_rows_per_group=self.decode_rows_per_group,
            pf_rows_per_group=(halving_groups(b.pf_tokens // self.block_q)
                               if self.group_prefill_blocks else None),
            feature_major=self.feature_major)
        return jax.jit(fn, donate_argnums=(1,)).lower(
            self.params, self.kv, self._batch_shapes(b),
            None if self.prefix is None else self.prefix.arrays).compile()

    def _sampling_shapes(self, rows: int, history: int) -> sampling.SamplingBatch:
        f32 = jax.ShapeDtypeStruct((rows,), jnp.float32)
        i32 = jax.ShapeDtypeStruct((rows,), jnp.int32)
        hist = jax.ShapeDtypeStruct((rows, history), jnp.int32)
        return sampling.SamplingBatch(
            temperature=f32, top_p=f32, top_k=i32, min_p=f32,
            seed=jax.ShapeDtypeStruct((rows,), jnp.uint32), step=i32,
            presence=f32, frequency=f32, repetition=f32,
            generated_ids=hist, prompt_ids=hist)

    def _compile_sampler(self, kind: str, rows: int, history: int) -> Callable:
        logits = jax.ShapeDtypeStruct((rows, self.config.vocab_size), jnp.float32)
        if kind == "greedy":
            return jax.jit(sampling.sample_greedy).lower(logits).compile()
        return jax.jit(sampling.sample_full).lower(
            logits, self._sampling_shapes(rows, history)).compile()

    def _sampler_keys(self) -> list[tuple[str, int, int]]:
        rows = sorted({self._sample_rows(b) for b in self.buckets()})
        keys = []
        for r in rows:
            keys += [("greedy", r, 0), ("full", r, 1), ("full", r, self.max_context)]
        return keys

    def warmup(self, progress: Callable[[str, int, int], None] | None = None) -> None:
        """Compile (and run once) every bucket's step, every sampler variant and the page
        copy."""
        jobs: list[tuple[str, Callable[[], None]]] = []
        for b in self.buckets():
            jobs.append((f"step decode={b.dec_seqs} prefill={b.pf_tokens}",
                         functools.partial(self._warm_forward, b)))
        for key in self._sampler_keys():
            jobs.append((f"sampler {key[0]} rows={key[1]}",
                         functools.partial(self._warm_sampler, key)))
        jobs.append(("page copy", self._warm_copy))
        if self.prefix is not None:
            jobs.append(("prefix buffer", lambda: self.prefix.compile(self.kv)))
        t0 = time.perf_counter()
        for i, (name, job) in enumerate(jobs):
            if progress:
                progress(name, i, len(jobs))
            job()
        if progress:
            progress("done", len(jobs), len(jobs))
        self.compile_seconds = time.perf_counter() - t0

    # XLA:CPU's first execution of a freshly compiled (or cache-loaded) executable costs
    # 0.1-0.4 s more than later ones (measured here: a decode step of 4 133 vs 51 ms, a
    # step of 16 decodes and 128 prompt tokens 433 vs 221 ms). Served, that landed in the
    # TTFT of whichever request first needed the bucket (mixed steps of 1-1.5 s while the
    # streams ramped up), so warm-up runs each step and sampler once on dummy inputs.

    def _warm_forward(self, b: Bucket) -> None:
        if b not in self._fwd:
            self._fwd[b] = self._compile_forward(b)
            with self._lock:
                self.kv, logits = self._fwd[b](self.params, self.kv, self._dummy_batch(b),
                                               None if self.prefix is None
                                               else self.prefix.arrays)
                logits.block_until_ready()

    def _dummy_batch(self, b: Bucket) -> StepBatch:
        """A batch of bucket `b` that touches only the null page (page 0, where padding
        writes go anyway): every token writes slot 0, and each attention group reads one
        shared block from the prefix copy, one gathered from pages and one own block, so
        that every loop body runs once."""
        shapes = self._batch_shapes(b)
        block = self._shared_block_pages * self.page_size
        shared = 2 * block if 2 * block < self.max_context else 0
        buffered = block if shared and self.prefix is not None else 0
        fill = {"dec_context_lens": shared + 1, "dec_shared_len": shared,
                "dec_buffered_len": buffered,
                "pf_context_lens": shared + self.block_q, "pf_query_lens": self.block_q,
                "pf_shared_len": shared, "pf_buffered_len": buffered}
        return StepBatch(**{name: np.full(sd.shape, fill.get(name, 0), np.int32)
                            for name, sd in vars(shapes).items()})

    def _warm_sampler(self, key) -> None:
        if key not in self._samplers:
            self._samplers[key] = fn = self._compile_sampler(*key)
            kind, rows, history = key
            logits = np.zeros((rows, self.config.vocab_size), np.float32)
            if kind == "greedy":
                np.asarray(fn(logits))
            else:
                dummy = jax.tree.map(lambda sd: np.zeros(sd.shape, sd.dtype),
                                     self._sampling_shapes(rows, history))
                np.asarray(fn(logits, dummy))

    def _warm_copy(self) -> None:
        if self._copy is None:
            def copy(kv, src, dst):
                return tuple((k.at[dst].set(k[src]), v.at[dst].set(v[src])) for k, v in kv)
            idx = jax.ShapeDtypeStruct((_COPY_BUCKET,), jnp.int32)
            self._copy = jax.jit(copy, donate_argnums=(0,)).lower(self.kv, idx, idx).compile()
            null = np.zeros(_COPY_BUCKET, np.int32)  # first run: the null page onto itself
            with self._lock:
                self.kv = self._copy(self.kv, null, null)
                jax.block_until_ready(self.kv)

    # --------------------------------------------------------------------------- a step
    def step(self, plan: StepPlan, *, return_logits: bool = False) -> StepResult:
        with self._lock:
            t0 = time.perf_counter()
            if plan.copies:
                self._run_copies(plan.copies)
            if not plan.chunks:
                return StepResult(sampled={}, device_seconds=time.perf_counter() - t0)
            batch, bucket, rows, real = self._pack(plan)
            fwd = self._fwd.get(bucket)
            if fwd is None:
                raise RuntimeError(f"no compiled step for {bucket}; call warmup() first")
            prefix = None
            if self.prefix is not None:
                batch = self.prefix.prepare(self.kv, batch, plan.copies)
                prefix = self.prefix.arrays
            self.kv, logits = fwd(self.params, self.kv, batch, prefix)
            sampled = self._sample(plan, logits, rows, self._sample_rows(bucket))
            if not rows:
                # Nothing sampled, so nothing waited for the step: wait here. Otherwise
                # the engine would dispatch a long prompt's chunks back to back without
                # them having run, a request arriving meanwhile would queue behind all of
                # them instead of joining the next step, and the step times that the cost
                # model learns from would be dispatch times.
                jax.block_until_ready(logits)
            padded = bucket.dec_seqs + bucket.pf_tokens
            result = StepResult(sampled=sampled, padded_tokens=padded, real_tokens=real,
                                device_seconds=time.perf_counter() - t0)
            if return_logits:
                host = np.asarray(logits)
                result.logits = {c.seq_id: host[r] for r, c in enumerate(rows)}
            return result

    def _run_copies(self, copies: list[tuple[int, int]]) -> None:
        if self._copy is None:
            self._warm_copy()
        for i in range(0, len(copies), _COPY_BUCKET):
            part = copies[i:i + _COPY_BUCKET]
            src = np.zeros(_COPY_BUCKET, np.int32)
            dst = np.zeros(_COPY_BUCKET, np.int32)
            src[:len(part)] = [s for s, _ in part]
            dst[:len(part)] = [d for _, d in part]
            self.kv = self._copy(self.kv, src, dst)

    def _pick(self, buckets: list[int], n: int, what: str) -> int:
        if n == 0:
            return 0
        for b in buckets:
            if b >= n:
                return b
        raise ValueError(f"step has {n} {what}, more than the largest bucket {buckets[-1:]}")

    def _pack(self, plan: StepPlan):
        ps, bq, pps = self.page_size, self.block_q, self.pages_per_seq
        dec_cap = self.decode_buckets[-1] if self.decode_buckets else 0
        dec, pf = [], []
        for c in plan.chunks:
            (dec if len(c.token_ids) == 1 and len(dec) < dec_cap else pf).append(c)
        # Longest context first: attention walks each group of decode rows only as far as
        # the group's longest (model/llama.py), so rows of similar length go together.
        dec.sort(key=lambda c: c.start_pos, reverse=True)
        # Prefill chunks likewise, by the context their last block reaches (the blocks
        # walk in groups, `halving_groups`).
        pf.sort(key=lambda c: c.start_pos + len(c.token_ids), reverse=True)
        pf_tokens = sum(-(-len(c.token_ids) // bq) * bq for c in pf)
        bucket = Bucket(self._pick(self.decode_buckets, len(dec), "decode sequences"),
                        self._pick(self.prefill_buckets, pf_tokens, "prefill tokens"))
        if len(pf) > self.max_prefill_seqs:
            raise ValueError(f"{len(pf)} prefill chunks > {self.max_prefill_seqs=}")
        nd, blocks = bucket.dec_seqs, bucket.pf_tokens // bq
        t = nd + bucket.pf_tokens
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        slots = np.zeros(t, np.int32)
        dec_pt = np.zeros((nd, pps), np.int32)
        dec_ctx = np.zeros(nd, np.int32)
        pf_pt = np.zeros((blocks, pps), np.int32)
        pf_ctx = np.zeros(blocks, np.int32)
        pf_ql = np.zeros(blocks, np.int32)
        n_rows = self._sample_rows(bucket)
        sample_idx = np.zeros(n_rows, np.int32)
        rows: list = []  # (row, chunk) for chunks that sample

        for i, c in enumerate(dec):
            pos = c.start_pos
            pt = c.page_table
            tokens[i] = c.token_ids[0]
            positions[i] = pos
            slots[i] = pt[pos // ps] * ps + pos % ps
            dec_pt[i, :len(pt)] = pt
            dec_ctx[i] = pos + 1
            if c.sample:
                sample_idx[len(rows)] = i
                rows.append(c)
        flat = nd
        blk = 0
        for c in pf:
            n = len(c.token_ids)
            pt = np.asarray(c.page_table, np.int32)
            pos = np.arange(c.start_pos, c.start_pos + n, dtype=np.int32)
            tokens[flat:flat + n] = c.token_ids
            positions[flat:flat + n] = pos
            slots[flat:flat + n] = pt[pos // ps] * ps + pos % ps
            nb = -(-n // bq)
            for j in range(nb):
                q = min(bq, n - j * bq)
                pf_pt[blk, :len(pt)] = pt
                pf_ctx[blk] = c.start_pos + j * bq + q
                pf_ql[blk] = q
                blk += 1
            if c.sample:
                sample_idx[len(rows)] = flat + n - 1
                rows.append(c)
            flat += nb * bq
        dec_shared, dec_shared_len = self._shared_prefix(dec_pt[:len(dec)],
                                                         dec_ctx[:len(dec)] - 1)
        pf_shared, pf_shared_len = self._shared_prefix(pf_pt[:blk], (pf_ctx - pf_ql)[:blk])
        batch = StepBatch(tokens=tokens, positions=positions, slots=slots,
                          dec_page_tables=dec_pt, dec_context_lens=dec_ctx,
                          dec_shared_pages=dec_shared, dec_shared_len=dec_shared_len,
                          dec_buffered_len=np.int32(0),
                          pf_page_tables=pf_pt, pf_context_lens=pf_ctx,
                          pf_query_lens=pf_ql, pf_shared_pages=pf_shared,
                          pf_shared_len=pf_shared_len, pf_buffered_len=np.int32(0),
                          sample_idx=sample_idx)
        real = sum(len(c.token_ids) for c in plan.chunks)
        return batch, bucket, rows, real

    def _shared_prefix(self, tables: np.ndarray, first_pos: np.ndarray):
        """The page-table prefix every row shares, in whole pages before every row's first
        query: attention reads it once for the whole group (cascade attention)."""
        shared = np.zeros(self.pages_per_seq, np.int32)
        if len(tables) == 0:
            return shared, np.int32(0)
        limit = int(first_pos.min()) // self.page_size
        if len(tables) > 1 and limit:
            same = (tables[:, :limit] == tables[0, :limit]).all(axis=0)
            limit = limit if same.all() else int(np.argmin(same))
        shared[:limit] = tables[0, :limit]
        return shared, np.int32(limit * self.page_size)

    def _sample(self, plan: StepPlan, logits, rows: list, n_rows: int) -> dict:
        if not rows:
            return {}
        if all(c.sampling.is_greedy and not c.sampling.needs_penalties for c in rows):
            packed = self._samplers[("greedy", n_rows, 0)](logits)
        else:
            hist = self.max_context if any(c.sampling.needs_penalties for c in rows) else 1
            packed = self._samplers[("full", n_rows, hist)](
                logits, sampling.sampling_batch(rows, n_rows, hist, self._rng))
        # The one device-to-host copy of the step.
        return sampling.unpack(np.asarray(packed), rows)


class PrefixBuffer:
    """A contiguous copy of one shared prefix's keys and values, for the CPU attention.

    Cascade attention reads a prefix every row of a step shares (the system prompt) once
    for all rows; gathering its pages from the pool every step cost about as much as the
    attention matmuls themselves on XLA:CPU. This keeps the prefix gathered: per layer,
    keys transposed [kv_heads, head_dim, tokens] and values [kv_heads, tokens, head_dim]
    (`pallas_kernels.reference.gather_prefix`), refilled only when the steps' shared
    prefix changes.

    Sound because a page's contents change only by being written: every step's writes
    (its tokens' slots) and page copies are checked first, and the copy is cut back to
    before the first page written. A group's `buffered_len` is then what the copy covers
    of its shared prefix; the attention gathers the rest of that prefix from the pages.
    """

    MIN_GAIN_PAGES = 16  # refill only when it would cover this many more pages

    def __init__(self, cfg: ModelConfig, dtype, page_size: int, tokens: int, *,
                 block_pages: int) -> None:
        block = block_pages * page_size  # the attention's shared block: a multiple of it
        self.tokens = max(block, -(-tokens // block) * block)
        self.page_size = page_size
        self.capacity = self.tokens // page_size  # pages
        kvh, d = cfg.num_kv_heads, cfg.head_dim
        self.arrays = tuple((jnp.zeros((kvh, d, self.tokens), dtype),
                             jnp.zeros((kvh, self.tokens, d), dtype))
                            for _ in range(cfg.num_layers))
        self.pages = np.zeros(0, np.int32)  # pages whose contents the copy holds, in order
        self.fills = 0
        self._fill = None

    def compile(self, kv) -> None:
        if self._fill is None:
            from pallas_kernels.reference import gather_prefix

            def fill(kv, old, pages):
                del old  # donated: its memory holds the new copy
                return tuple(gather_prefix(k, v, pages, tokens=self.tokens) for k, v in kv)

            pages = jax.ShapeDtypeStruct((self.capacity,), jnp.int32)
            self._fill = jax.jit(fill, donate_argnums=(1,)).lower(
                kv, self.arrays, pages).compile()
            # First run (see ModelRunner._warm_forward): the copy then holds null pages
            # and claims none.
            self.arrays = self._fill(kv, self.arrays, np.zeros(self.capacity, np.int32))
            jax.block_until_ready(self.arrays)
            self.pages = np.zeros(0, np.int32)

    def covered(self, shared: np.ndarray) -> int:
        """How many leading pages of `shared` the copy holds."""
        return _common_prefix(self.pages, shared)

    def prepare(self, kv, batch: StepBatch, copies) -> StepBatch:
        """Bring the copy up to date for `batch` and point its groups at it.

        The copy holds one prefix; the two groups may share different ones (the decode
        rows' system prompt; a long prompt's earlier chunks for the prefill group). It
        holds whichever saves the step the most pages of gathering (both groups counted:
        the prefill group's prefix often extends the decode rows'), and is refilled only
        when another would save `MIN_GAIN_PAGES` more than what it holds now, so two
        prefixes of similar length do not take turns every step. The group it does not
        serve gathers its prefix from the pages (`buffered_len` 0)."""
        ps = self.page_size
        if len(self.pages):
            written = [batch.slots // ps]
            if copies:
                written.append(np.asarray([dst for _, dst in copies], np.int32))
            hit = np.isin(self.pages, np.concatenate(written))
            if hit.any():
                self.pages = self.pages[:int(np.argmax(hit))]
        dec = batch.dec_shared_pages[:int(batch.dec_shared_len) // ps]
        pf = batch.pf_shared_pages[:int(batch.pf_shared_len) // ps]

        def saved(pages: np.ndarray) -> int:
            return _common_prefix(pages, dec) + _common_prefix(pages, pf)

        held = saved(self.pages)
        best = max((w[:self.capacity] for w in (dec, pf) if len(w)), key=saved, default=None)
        if best is not None and saved(best) - held >= min(self.MIN_GAIN_PAGES, len(best)):
            if self._fill is None:
                self.compile(kv)
            pages = np.zeros(self.capacity, np.int32)
            pages[:len(best)] = best
            self.arrays = self._fill(kv, self.arrays, pages)
            self.pages = best.copy()
            self.fills += 1
        return batch.replace(dec_buffered_len=np.int32(self.covered(dec) * ps),
                             pf_buffered_len=np.int32(self.covered(pf) * ps))


def halving_groups(n: int) -> tuple[int, ...] | None:
    """Sizes of groups of `n` rows sorted longest first, each half the rows left: the
    first group holds the longest rows, the last ones single rows. A few long rows then
    leave the rest short walks, at log2(n) loops rather than one (n=16: 8, 4, 2, 1, 1)."""
    sizes = []
    while n > 1:
        sizes.append(-(-n // 2))
        n -= sizes[-1]
    return (*sizes, 1) if sizes else None


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading entries `a` and `b` have in common."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    same = a[:n] == b[:n]
    return n if same.all() else int(np.argmin(same))
