"""From a sampled token to the client, and the one way a request ends.

`_take` turns a token into output (text, stops, grammar, max_tokens / context), and
`_deliver` sends it on the request's bounded channel without ever blocking the loop: when
it is full the tokens stay in the request's `OutputStream` and go out coalesced once the
client has read (`_deliver_pending`); a receiver that is gone is an abort.

Ending: every request ends exactly once, in `_end_request`: its pages go back to the
pool, its final FinishEvent or ErrorEvent is queued and delivery is tried. The other
ways out only decide when and why, and delegate: finishing (stop, length) after a step,
`_abort_request` (at once, or right after the step in flight if the sequence is in it:
`_end_deferred_aborts`), `_shed_expired`, a failed step, and `_fail_all` when the engine
stops. `_close_stream` is not an ending: it stops delivery to a client that is gone.

`Delivery` is a mixin of `Engine` (scheduler/engine.py), on the trio thread only: it uses
the engine's scheduler, admission, runner, clock and its books of live sequences
(`_seqs`, `_free_ids`, `_undelivered`, `_pending_aborts`, `_step_ends_at`).
"""

from __future__ import annotations

import dataclasses
import logging

import trio

from .api import ErrorEvent
from .request import Phase, Sequence

log = logging.getLogger("sluice.engine")


class Delivery:
    """Output and endings of an engine's requests."""

    # -- ending requests ---------------------------------------------------------------
    def _take(self, seq: Sequence, tok, now: float, unseen: int = 0) -> None:
        """One sampled token into a sequence's output: text, stops, grammar, ending.
        `unseen`: tokens of the same verify appended after it (scheduler/speculative.py),
        taken back if this one ends the sequence."""
        out = seq.output
        if seq.first_token_at is None:
            seq.first_token_at = now
            if seq.num_preemptions == 0 and not seq.batch:  # (a recompute: no one's error)
                self.admission.first_token(now - seq.arrived_at, seq.predicted_ttft)
                if self.scheduler.itl_target:
                    self.scheduler.note_ttft(now - seq.arrived_at)
            if seq.prompt_logprobs is not None:
                out.prompt_logprobs = tuple(seq.prompt_scores)
        grammar = seq.constraint
        if grammar is not None and not grammar.accept(tok.token_id):
            _take_back(seq, unseen)
            self._end_request(seq, "error", ErrorEvent(
                message=f"structured output failed: {grammar.error}"))
            return
        reason = "stop" if out.append(tok) else None
        if reason is None and grammar is not None and grammar.finished:
            reason = "stop"  # the grammar is complete: nothing more may follow
        if reason is None and (seq.num_generated - unseen >= seq.max_tokens
                               or seq.num_tokens - unseen >= self.runner.max_context):
            reason = "length"
        if reason is not None:
            _take_back(seq, unseen)
            self._end_request(seq, reason)
        elif out.has_text:
            self._deliver(seq)

    def _output_failed(self, seq: Sequence, exc: Exception) -> None:
        """Turning this sequence's tokens into output raised: it ends with an error (its
        pages freed, if `_end_request` had not got that far), the others go on."""
        error = ErrorEvent(message=f"output processing failed: {type(exc).__name__}: {exc}")
        if seq.phase is not Phase.DONE:
            self._end_request(seq, "error", error)
            return
        seq.output.final = error  # it raised inside `_end_request`, after the pages went
        seq.output.sent()  # drop text that may be what failed
        self._deliver(seq)

    def _end_request(self, seq: Sequence, reason: str, error: ErrorEvent | None = None) -> None:
        """The one way a request ends (finished, aborted, shed, failed): pages back to the
        pool now, final event queued and delivery tried. A second call is a no-op."""
        if seq.phase is Phase.DONE:
            return
        kv = None  # a disaggregated prefill's pages, copied before they are freed
        if error is None and reason in ("stop", "length") and seq.export_pages_from is not None:
            kv = self._export_pages(seq)
        if (unused := self.scheduler.finish(seq)) is not None:
            self.runner.drop_adapter(unused)  # unloaded, and its last sequence is gone
        now = self.clock()
        seq.finished_at = now
        seq.finish_reason = reason
        self._seqs.pop(seq.request_id, None)
        self._free_ids.append(seq.seq_id)
        out = seq.output
        if error is None:
            # At "length" the text held back for a possible stop string goes out after
            # all (unless the decoder's last bytes complete one: then it is a stop).
            if reason == "length" and out.close():
                reason = seq.finish_reason = "stop"
            if reason in ("stop", "length"):
                self.admission.completed(now, seq.num_generated)
            out.final = seq.finish_event()
            if kv is not None:
                out.final = dataclasses.replace(out.final, kv=kv)
        else:
            out.final = error if not seq.index else dataclasses.replace(error, index=seq.index)
        if seq.aborted:
            # Nobody is listening (or will be soon): say goodbye once, never hold state.
            self._deliver(seq)
            if seq.output.final is not None:
                self._close_stream(seq)
        else:
            self._deliver(seq)

    def _export_pages(self, seq: Sequence) -> object:
        """The prompt's full pages from `export_pages_from` on, queued for copying out
        (`Runner.export_pages`); the copy is read by whoever gets the FinishEvent. The
        pages' contents are final: later steps write positions past the prompt."""
        full = seq.num_prompt_tokens // self.runner.page_size
        try:
            return self.runner.export_pages(seq.kv_pages[seq.export_pages_from:full])
        except Exception:  # noqa: BLE001 - the caller sees no pages and says so
            log.exception("engine %s: exporting %s's KV pages failed", self.name,
                          seq.request_id)
            return None

    def _abort_request(self, seq: Sequence) -> None:
        """Mark it aborted and end it: at once, or, while the runner may still be reading
        its page table (it is in the step in flight), right after that step."""
        seq.aborted = True
        if self._step_ends_at is not None and seq.is_running:
            self._pending_aborts.append(seq)
        else:
            self._end_request(seq, "abort")

    def _end_deferred_aborts(self) -> None:
        if self._pending_aborts:
            pending, self._pending_aborts = self._pending_aborts, []
            for seq in pending:
                self._end_request(seq, "abort")

    def _shed_expired(self) -> None:
        for seq in self.scheduler.expired(self.clock()):
            self.admission.count("shed")
            waited = self.clock() - seq.arrived_at
            self._end_request(seq, "shed", ErrorEvent(
                message=f"request waited {waited:.1f}s in the queue, past its deadline",
                kind="shed", retry_after_s=self.admission.retry_after()))

    def _fail_all(self, message: str) -> None:
        for seq in list(self._seqs.values()):
            self._end_request(seq, "error", ErrorEvent(message=message, kind="engine_dead"))
        for seq in list(self._undelivered.values()):
            self._close_stream(seq)  # the loop that would retry is gone

    # -- delivery ----------------------------------------------------------------------
    def _deliver(self, seq: Sequence) -> None:
        """Send what is pending without blocking; leftovers wait in the OutputStream."""
        out = seq.output
        ch = out.channel
        try:
            if out.has_tokens:
                ch.send_nowait(out.token_event())
                out.sent()
            if out.final is not None:
                ch.send_nowait(out.final)
                out.final = None
                ch.close()
        except trio.WouldBlock:
            self._undelivered[id(seq)] = seq
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The receiver is gone: the client left without (yet) calling abort.
            self._close_stream(seq)
            if seq.phase is not Phase.DONE:
                self._abort_request(seq)
            return
        self._undelivered.pop(id(seq), None)

    def _deliver_pending(self) -> None:
        for seq in list(self._undelivered.values()):
            if seq.aborted and seq.phase is Phase.DONE:
                self._close_stream(seq)
            else:
                self._deliver(seq)

    def _close_stream(self, seq: Sequence) -> None:
        """Stop delivering to this request's client: pending output is dropped and the
        channel closed. Not an ending by itself (see `_end_request`)."""
        self._undelivered.pop(id(seq), None)
        out = seq.output
        out.sent()
        out.final = None
        out.channel.close()


def _take_back(seq: Sequence, n: int) -> None:
    """Drop the last `n` tokens appended (a verify's, after the one that ended it)."""
    if n:
        del seq.token_ids[-n:]
        del seq.output_ids[-n:]
