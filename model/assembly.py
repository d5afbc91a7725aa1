"""Step assembly: a `StepPlan`'s chunks as a compiled bucket's inputs. The runner's
limits and shapes (what the scheduler may plan), the host layout of a step
(`model/packing.py`: tokens, positions, KV slots, sampled rows), the attention backend's
metadata for it, the sampler's arguments, the page copies' pool rows, and the dummy
inputs warm-up and compiles use.

`StepAssembly` is a mixin of `ModelRunner` (model/runner.py): host work only, no device
call; the runner launches what it assembles.
"""

from __future__ import annotations

import numpy as np

from scheduler.protocol import SeqChunk, StepLimits, StepPlan

from . import sampling
from .compiling import COPY_BUCKET
from .llama import StepBatch
from .packing import Bucket, StepLayout, dummy_layout, pack, sample_rows, split


class StepAssembly:
    """Plans into device inputs, for the runner's buckets."""

    def _set_shapes(self, decode_buckets, prefill_buckets, mixed_decode_buckets,
                    max_prefill_seqs: int) -> None:
        """The buckets' sizes, checked against `block_q` (set before)."""
        self.decode_buckets = sorted(set(decode_buckets))
        self.prefill_buckets = sorted(set(prefill_buckets))
        for b in self.prefill_buckets:
            if b % self.block_q:
                raise ValueError(
                    f"prefill bucket {b} must be a multiple of block_q={self.block_q}")
        self.max_prefill_seqs = max_prefill_seqs
        if self.prefill_buckets and (
                self.prefill_buckets[-1] <= max_prefill_seqs * (self.block_q - 1)):
            # Each of `max_prefill_seqs` chunks may pad up to block_q - 1 tokens: the
            # largest bucket must hold that padding and at least one real token more.
            raise ValueError(
                f"the largest prefill bucket ({self.prefill_buckets[-1]}) leaves no room for "
                f"prompt tokens beside {max_prefill_seqs} chunks' padding (max_prefill_seqs x "
                f"(block_q - 1) = {max_prefill_seqs * (self.block_q - 1)}): raise "
                "prefill_buckets or lower max_prefill_seqs")
        # Decode sizes compiled beside each prefill bucket (0: prompt-only steps); None:
        # all of them. A step with prompt tokens uses the smallest that holds its decodes.
        mixed = ([0, *self.decode_buckets] if mixed_decode_buckets is None
                 else mixed_decode_buckets)
        self.mixed_decode_buckets = sorted(set(mixed))

    def _assemble(self, plan: StepPlan) -> tuple[Bucket, int, StepLayout, StepBatch]:
        """A plan's chunks as the device inputs of the smallest ready bucket that holds
        them: (bucket, sampled rows, host layout, device batch). Its `pending` chunks read
        their token from the rows the step launched before sampled (`_prev_rows`)."""
        dec, pf, need = split(plan, self.limits.max_decode_seqs, self.block_q)
        if len(pf) > self.max_prefill_seqs:
            raise ValueError(f"{len(pf)} prefill chunks > {self.max_prefill_seqs=}")
        bucket = self.programs.pick(need)
        if bucket is None:
            raise RuntimeError(f"no compiled step holds {need} (decode rows, prefill "
                               f"tokens); ready: {self.programs.ready}")
        rows = self._sample_rows(bucket)
        layout = pack(dec, pf, bucket, page_size=self.page_size, block_q=self.block_q,
                      pages_per_seq=self.pool.pages_per_seq, n_samples=rows,
                      prev_rows=self._prev_rows, windowed=bool(self.pool.window_pool))
        # Pages copied up from the host tier were written before the step, as copies are.
        written = plan.copies + [(0, page) for _, page in plan.swap_in]
        return bucket, rows, layout, self._batch(layout, written)

    @property
    def limits(self) -> StepLimits:
        return self._step_limits(
            shapes=tuple((b.dec_rows, b.pf_tokens) for b in self.programs.all),
            window=self.pool.window if self.pool.window_pool else 0,
            window_pool=self.pool.window_pool)

    def _step_limits(self, **more) -> StepLimits:
        """`limits` from the buckets alone (`more`: the fields the programs and the pool
        add; the pool is sized from these before either exists)."""
        max_pf = self.prefill_buckets[-1] if self.prefill_buckets else 0
        # Each chunk pads up to a multiple of block_q; keep the worst case inside the bucket.
        budget = max(0, max_pf - self.max_prefill_seqs * (self.block_q - 1))
        return StepLimits(
            max_decode_seqs=self.decode_buckets[-1] if self.decode_buckets else 0,
            max_prefill_seqs=self.max_prefill_seqs if max_pf else 0,
            max_prefill_chunk=budget, max_prefill_tokens=budget, block_q=self.block_q, **more)

    def buckets(self) -> list[Bucket]:
        """Decode-only steps of each decode bucket, and each prefill bucket with each
        mixed decode size."""
        return ([Bucket(d, 0) for d in self.decode_buckets]
                + [Bucket(d, p) for d in self.mixed_decode_buckets for p in self.prefill_buckets])

    def _sample_rows(self, b: Bucket) -> int:
        return sample_rows(b, self.block_q, self.max_prefill_seqs)

    def _dummy(self, b: Bucket) -> StepLayout:
        return dummy_layout(b, block_q=self.block_q, pages_per_seq=self.pool.pages_per_seq,
                            n_samples=self._sample_rows(b),
                            context=min(2048, self.max_context - 1),
                            windowed=bool(self.pool.window_pool))

    def _batch(self, layout: StepLayout, copies: list[tuple[int, int]]) -> StepBatch:
        dec, pf = self.attention.prepare_step(self.kv, (layout.decode, layout.prefill),
                                         layout.slots, copies)
        return StepBatch(tokens=layout.tokens, positions=layout.positions, slots=layout.slots,
                         sample_idx=layout.sample_idx, decode=dec, prefill=pf,
                         prev_src=layout.prev_src, window_slots=layout.window_slots,
                         lora_slots=None if self.lora is None else layout.lora_slots)

    def _sampling_args(self, kind: str, rows: int, samples: list[SeqChunk],
                       top: bool = False) -> tuple:
        top = np.bool_(top or sampling.wants_top(samples))
        if kind == "greedy":
            return (top,)
        hist = self.max_context if kind == "penalties" else 1
        return (sampling.sampling_batch(samples, rows, hist, self._rng,
                                        self.config.vocab_size), top)

    def _copy_rows(self, copies: list[tuple[int, int]], window: bool = False):
        """The page copies (src page, dst page) as the copy program's pool rows, every
        layer's, `COPY_BUCKET` pages per call: (src rows, dst rows) per call. Where the
        sliding layers have pages of their own (`PoolLayout.window_pool`), copies of the
        global layers' pages, or with `window` of the sliding layers' (the other layers
        copy their null page onto itself, in the same program)."""
        pool = self.pool
        layers = np.asarray(pool.offsets, np.int32)[:, None]
        mine = np.ones((pool.layers, 1), bool)
        if pool.window_pool:
            mine[:, 0] = np.asarray(pool.sliding) == window
        for i in range(0, len(copies), COPY_BUCKET):
            part = np.zeros((2, COPY_BUCKET), np.int32)  # unused entries: page 0 onto 0
            part[:, :len(copies[i:i + COPY_BUCKET])] = np.asarray(
                copies[i:i + COPY_BUCKET], np.int32).T
            src, dst = ((layers + np.where(mine, p[None, :], 0)).reshape(-1) for p in part)
            yield src, dst
