"""A `StepPlan` packed into the fixed-shape arrays of a compiled bucket (pure numpy).

A step's shape is its `Bucket`: decode rows (one token each) and prefill tokens (blocks of
`block_q` queries, each block one sequence's). Packing decides which chunks decode and
which prefill, sorts each group longest context first (backends that walk rows in groups
rely on it: short rows then stop early), lays out the flat token arrays, and describes
each attention group generically (`GroupLayout`); the attention backend turns those into
its own metadata. Nothing here compiles or touches a device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pallas_kernels import GroupLayout
from scheduler.protocol import SeqChunk, StepPlan


class Bucket(NamedTuple):
    dec_rows: int  # decode sequences
    pf_tokens: int  # prefill tokens, a multiple of block_q

    def covers(self, need: "Bucket") -> bool:
        return self.dec_rows >= need.dec_rows and self.pf_tokens >= need.pf_tokens


@dataclass
class StepLayout:
    bucket: Bucket
    tokens: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    slots: np.ndarray  # [T] int32: page * page_size + offset; padding writes slot 0
    lora_slots: np.ndarray  # [T] int32: the adapter slot of each token's sequence (-1: none)
    sample_idx: np.ndarray  # [sample_rows] int32: flat token whose logits each row takes (-1: none)
    prev_src: np.ndarray  # [T] int32: a pending token's row in the step before's samples; -1
    decode: GroupLayout
    prefill: GroupLayout
    samples: list[SeqChunk]  # the chunks that sample, in sample-row order
    real_tokens: int
    # Chunks whose prompt tokens are scored (`SeqChunk.score_targets`), with the flat
    # token row each starts at.
    scored: list[tuple[SeqChunk, int]] = field(default_factory=list)
    # [T] int32: the sliding layers' slots where their pages are numbered apart
    # (`SeqChunk.window_table`); None: `slots` serve every layer.
    window_slots: np.ndarray | None = None


def sample_rows(bucket: Bucket, block_q: int, max_prefill_seqs: int) -> int:
    """Logit rows a bucket computes: one per decode row and per prefill chunk, rounded up
    to a power of two so that buckets share sampler programs."""
    n = bucket.dec_rows + min(bucket.pf_tokens // block_q, max_prefill_seqs)
    return 1 << max(0, n - 1).bit_length()


def split(plan: StepPlan, max_decode_rows: int, block_q: int
          ) -> tuple[list[SeqChunk], list[SeqChunk], Bucket]:
    """(decode chunks, prefill chunks, the smallest bucket they fit), each group sorted
    longest context first. A speculative verify's positions are decode rows
    (`draft_rows`); one-token chunks decode while there is room."""
    dec: list[SeqChunk] = [row for c in plan.chunks if c.draft for row in draft_rows(c)]
    if len(dec) > max_decode_rows:
        raise ValueError(f"{len(dec)} verify rows > {max_decode_rows} decode rows")
    pf: list[SeqChunk] = []
    for c in plan.chunks:
        if not c.draft:
            (dec if len(c.token_ids) == 1 and len(dec) < max_decode_rows else pf).append(c)
    dec.sort(key=lambda c: c.start_pos, reverse=True)
    pf.sort(key=lambda c: c.start_pos + len(c.token_ids), reverse=True)
    pf_tokens = sum(-(-len(c.token_ids) // block_q) * block_q for c in pf)
    return dec, pf, Bucket(len(dec), pf_tokens)


def draft_rows(c: SeqChunk) -> list[SeqChunk]:
    """A verify chunk (`SeqChunk.draft` k) as k + 1 one-token rows, one per position, each
    sampled as if the proposals before it were the sequence's: its key's step, the
    tokens penalties count, the grammar's state (`constraint.after`). The rows write
    their keys and values before any reads them (every layer writes the step's tokens,
    then attends), so row i sees the proposals before it."""
    toks = list(c.token_ids)
    rows = []
    for i, t in enumerate(toks):
        before = toks[1:1 + i]
        rows.append(dataclasses.replace(
            c, token_ids=[t], start_pos=c.start_pos + i, sample=True,
            num_generated=c.num_generated + i, draft=0, score_targets=(),
            penalty_token_ids=([*c.penalty_token_ids, *before]
                               if before and c.sampling.needs_penalties
                               else c.penalty_token_ids),
            constraint=(c.constraint.after(before) if before and c.constraint is not None
                        else c.constraint)))
    return rows


def pack(dec: list[SeqChunk], pf: list[SeqChunk], bucket: Bucket, *, page_size: int,
         block_q: int, pages_per_seq: int, n_samples: int,
         prev_rows: dict[int, int] | None = None, windowed: bool = False) -> StepLayout:
    """Lay `dec` and `pf` (from `split`) out in `bucket`'s arrays. `prev_rows`: each
    sequence's sample row in the step launched before, where a `pending` chunk's token
    is. `windowed`: the sliding layers' pages are numbered apart (each chunk's
    `window_table`): their tables and slots too."""
    ps, bq = page_size, block_q
    nd, blocks = bucket.dec_rows, bucket.pf_tokens // bq
    t = nd + bucket.pf_tokens
    tokens = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    slots = np.zeros(t, np.int32)
    lora_slots = np.full(t, -1, np.int32)
    prev_src = np.full(t, -1, np.int32)
    decode = GroupLayout.empty(nd, pages_per_seq, windowed)
    prefill = GroupLayout.empty(blocks, pages_per_seq, windowed)
    wslots = np.zeros(t, np.int32) if windowed else None
    sample_idx = np.full(n_samples, -1, np.int32)  # (unused rows: zero logits inputs)
    samples: list[SeqChunk] = []
    scored: list[tuple[SeqChunk, int]] = []

    if windowed and (bad := [c.seq_id for c in (*dec, *pf) if not c.window_table]):
        raise ValueError(f"seqs {bad}: no window_table, and the sliding layers' pages are "
                         "their own (scheduler/window_pages.py)")
    for i, c in enumerate(dec):
        pos = c.start_pos
        pt = c.page_table
        if c.pending:
            prev_src[i] = _prev_row(c, prev_rows)
        else:
            tokens[i] = c.token_ids[0]
        positions[i] = pos
        slots[i] = pt[pos // ps] * ps + pos % ps
        lora_slots[i] = c.adapter_slot
        decode.page_tables[i, :len(pt)] = pt
        if windowed:
            wt = c.window_table
            wslots[i] = wt[pos // ps] * ps + pos % ps
            decode.window_tables[i, :len(wt)] = wt
        decode.context_lens[i] = pos + 1
        decode.query_lens[i] = 1
        if c.score_targets:
            scored.append((c, i))
        if c.sample:
            sample_idx[len(samples)] = i
            samples.append(c)
    flat, blk = nd, 0
    for c in pf:
        n = len(c.token_ids)
        pt = np.asarray(c.page_table, np.int32)
        pos = np.arange(c.start_pos, c.start_pos + n, dtype=np.int32)
        if c.pending:
            prev_src[flat] = _prev_row(c, prev_rows)
        else:
            tokens[flat:flat + n] = c.token_ids
        positions[flat:flat + n] = pos
        slots[flat:flat + n] = pt[pos // ps] * ps + pos % ps
        lora_slots[flat:flat + n] = c.adapter_slot
        if windowed:
            wt = np.asarray(c.window_table, np.int32)
            wslots[flat:flat + n] = wt[pos // ps] * ps + pos % ps
        for j in range(-(-n // bq)):
            q = min(bq, n - j * bq)
            prefill.page_tables[blk, :len(pt)] = pt
            if windowed:
                prefill.window_tables[blk, :len(wt)] = wt
            prefill.context_lens[blk] = c.start_pos + j * bq + q
            prefill.query_lens[blk] = q
            blk += 1
        if c.score_targets:
            scored.append((c, flat))
        if c.sample:
            sample_idx[len(samples)] = flat + n - 1
            samples.append(c)
        flat += -(-n // bq) * bq
    real = sum(len(c.token_ids) for c in (*dec, *pf))
    return StepLayout(bucket, tokens, positions, slots, lora_slots, sample_idx, prev_src,
                      decode, prefill, samples, real, scored, wslots)


def _prev_row(c: SeqChunk, prev_rows: dict[int, int] | None) -> int:
    row = (prev_rows or {}).get(c.seq_id)
    if row is None:
        raise ValueError(f"seq {c.seq_id}: a pending token the step before did not sample")
    return row


def dummy_layout(bucket: Bucket, *, block_q: int, pages_per_seq: int, n_samples: int,
                 context: int, windowed: bool = False) -> StepLayout:
    """A layout of `bucket` that reads and writes only the null page (page 0, where padding
    writes go anyway), with every row at `context` tokens so that attention's loops run:
    for compiling and for the first run of a fresh executable."""
    nd, blocks = bucket.dec_rows, bucket.pf_tokens // block_q
    t = nd + bucket.pf_tokens
    zeros = np.zeros(t, np.int32)

    def group(rows: int, queries: int) -> GroupLayout:
        g = GroupLayout.empty(rows, pages_per_seq, windowed)
        g.context_lens[:] = context
        g.query_lens[:] = queries
        return g

    return StepLayout(bucket, zeros, zeros.copy(), zeros.copy(), np.full(t, -1, np.int32),
                      np.zeros(n_samples, np.int32), np.full(t, -1, np.int32), group(nd, 1),
                      group(blocks, block_q), [], 0,
                      window_slots=zeros.copy() if windowed else None)
