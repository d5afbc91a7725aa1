"""The scheduler's books after a step is planned: `launched` (its chunks count as
computed, sampled tokens in flight, full pages offered to the prefix cache), `commit`
(the tokens appended once the result is back), `forget` (a launched step failed),
`observe` (its measured time into the cost model) and `finish` (a sequence out for
good, its pages back in the pool).

`StepBooks` is a mixin of `Scheduler` (scheduler/policy.py), on the engine's thread.
"""

from __future__ import annotations

from .batch import Batch
from .protocol import SampledToken, StepResult
from .request import Phase, Sequence

# The weight of each step in the mean token gap `_short_chunk` compares arrivals with.
_GAP_ALPHA = 0.1


class StepBooks:
    """What a launched, committed or failed step changes in the scheduler's state."""

    def observe(self, batch: Batch, seconds: float,
                shape: tuple[int, int] | None = None) -> None:
        """Feed the step's measured device time (and the compiled shape it ran in) to
        the cost model."""
        n = batch.decode_rows
        short = self.config.short_prefill_tokens
        prompts = batch.seqs[batch.num_decode:]
        questions = bool(prompts) and all(
            s.num_tokens - s.num_cached_tokens <= short for s in prompts)
        self.cost.observe(n, batch.plan.num_tokens - n, seconds, shape=shape, work=batch.work,
                          questions=questions)
        if n:  # the streams' token gap, as they have lately seen it
            gap = self._gap_s
            self._gap_s = seconds if gap is None else gap + _GAP_ALPHA * (seconds - gap)

    def launched(self, batch: Batch) -> None:
        """The step is on its way (its plan packed): its chunks count as computed, and a
        chunk that samples leaves its token in flight, so the next step can be planned
        before this one's result is back (overlapped scheduling; without overlap the
        engine commits right after)."""
        batch.epochs = [seq.num_preemptions for seq in batch.seqs]
        ps = self.pages.page_size
        for seq, chunk in zip(batch.seqs, batch.plan.chunks):
            if seq.aborted or not seq.is_running:
                continue
            start = chunk.start_pos
            # (a verify's proposals are not the sequence's until `commit` accepts them)
            end = start + len(chunk.token_ids) - chunk.draft
            if end > seq.num_computed_tokens:
                seq.num_computed_tokens = end
            # Its full pages join the prefix cache now (a step reading them runs after
            # this one), but not a page whose last token is still in flight: `commit`.
            if not chunk.pending and end // ps > start // ps:
                self._register(seq, start // ps, end // ps, batch)
            if chunk.sample:
                seq.inflight += 1
                seq.phase = Phase.DECODE

    def forget(self, batch: Batch) -> list[Sequence]:
        """A launched step failed: the pages it offered the cache hold nothing. Returns
        the running sequences outside it that had taken them as prefix hits."""
        tiers = self.pages.tiers
        if tiers is not None and batch.plan.swap_out:  # never copied down: nothing there
            tiers.forget(key for _, _, key, _ in batch.plan.swap_out)
            tiers.settled(slot for _, slot, _, _ in batch.plan.swap_out)
        lost, wlost = set(batch.registered), set(batch.window_registered)
        if not (lost or wlost):
            return []
        self.pages.forget(lost)
        if wlost:
            self.window.forget(wlost)
        inside = {id(s) for s in batch.seqs}
        return [s for s in self.running.values()
                if id(s) not in inside and not (lost.isdisjoint(s.kv_pages)
                                                and wlost.isdisjoint(s.window_pages))]

    def _register(self, seq: Sequence, first: int, end: int, batch: Batch | None = None) -> None:
        """Offer the sequence's full pages ``[first, end)`` to the prefix cache, the
        sliding layers' too; with `batch`, noted as its (`forget` if it fails)."""
        added = self.pages.register(seq, first, end)
        wadded = self.window.register(seq, first, end) if self.window is not None else []
        if batch is not None:
            batch.registered += added
            batch.window_registered += wadded

    def _free_pages(self, seq: Sequence) -> None:
        """All of the sequence's pages go back (finished, aborted or preempted)."""
        self.pages.free(seq)
        if self.window is not None:
            self.window.free(seq)

    def commit(self, batch: Batch, result: StepResult) -> list[tuple[Sequence, SampledToken]]:
        """Record what a `launched` step computed; returns the sequences that got a new
        token (the token already appended). Sequences aborted, finished or preempted
        since the launch are skipped (a token of theirs is dropped)."""
        if not batch.epochs and batch.seqs:
            self.launched(batch)  # a caller that steps synchronously (simulations)
        if batch.plan.swap_out:  # its copies down have landed in their host slots
            self.pages.tiers.settled(slot for _, slot, _, _ in batch.plan.swap_out)
        ps = self.pages.page_size
        out = []
        sampled = result.sampled
        for seq, chunk, epoch in zip(batch.seqs, batch.plan.chunks, batch.epochs):
            if seq.aborted or not seq.is_running or seq.num_preemptions != epoch:
                continue  # aborted while the step ran: the engine ends it next
            start = chunk.start_pos
            end = start + len(chunk.token_ids) - chunk.draft
            if chunk.pending and end // ps > start // ps:  # its token is known now
                self._register(seq, start // ps, end // ps)
            if chunk.score_targets:
                scores = result.prompt_logprobs.get(seq.seq_id)
                if scores is None:
                    raise RuntimeError(f"runner returned no prompt logprobs for seq {seq.seq_id}")
                seq.record_scores(chunk.start_pos, scores)
            if chunk.sample:
                tok = sampled.get(seq.seq_id)
                if tok is None:
                    raise RuntimeError(f"runner returned no token for seq {seq.seq_id}")
                seq.inflight = max(0, seq.inflight - 1)
                toks = [tok]
                if chunk.draft:  # a verify: the proposals accepted, then the next token
                    toks = self._verified(seq, chunk, result.drafted.get(seq.seq_id, toks))
                for tok in toks:
                    seq.token_ids.append(tok.token_id)
                    seq.output_ids.append(tok.token_id)
                    out.append((seq, tok))
                if seq.adapter is not None:
                    self.adapters.tokens[seq.adapter] += len(toks)
                if chunk.draft:
                    # Accepted proposals' keys and values are in the pool: computed, and
                    # their full pages offered to the cache now that they are known.
                    seq.num_computed_tokens = end + len(toks) - 1
                    if (end + len(toks) - 1) // ps > end // ps:
                        self._register(seq, end // ps, (end + len(toks) - 1) // ps)
                    self._trim_pages(seq)
        if any(c.draft for c in batch.plan.chunks):
            self.spec.steps += 1
        return out

    def finish(self, seq: Sequence) -> str | None:
        """Take a sequence out for good (finished, aborted, shed, failed): pages back now.
        Returns the name of an unloaded adapter that nothing needs any more: the caller
        drops its weights from the runner."""
        if seq.is_running:
            del self.running[seq.seq_id]
            self._free_pages(seq)
            self.waiting.stopped(seq)
            self._release_adapter(seq)
            self.spec_forget(seq)
        elif seq.phase is Phase.QUEUED:
            self.waiting.remove(seq)
        seq.phase = Phase.DONE
        if self._promised:
            promised = self._promised
            for key in seq.page_keys[:seq.num_prompt_tokens // self.pages.page_size]:
                n = promised.get(key, 0) - 1
                if n > 0:
                    promised[key] = n
                else:
                    promised.pop(key, None)
        if seq.num_generated and not seq.aborted:
            self.answer_tokens += 0.1 * (seq.num_generated - self.answer_tokens)
        if seq.adapter is not None and self.adapters.ended(seq.adapter):
            return seq.adapter
        return None
