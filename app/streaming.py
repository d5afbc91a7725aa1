"""From an admitted request's engine events to bytes: SSE chunks or one JSON response.

Streaming writes coalesce: after each token event the reader takes whatever else is
already waiting in the request's channel, so a slow client gets fewer, bigger writes
(one write costs ~100 us of CPU in hypercorn/h11 whatever its size) and the engine never
waits on it. The first chunk carries the role; the last carries `finish_reason`; with
`stream_options.include_usage` a usage chunk follows; ``data: [DONE]`` ends every stream,
errors included (an error mid-stream is a ``data: {"error": ...}`` event, which the
official clients raise).

The SSE body is an async generator that the server iterates in the connection's task.
A client disconnect arrives in it as `trio.Cancelled` (parked at an await) or
`GeneratorExit` (parked at a yield); either way `finally` calls the synchronous
`Flight.close`, which aborts the sequence. No cancel scope is held across a `yield`
(trio forbids it): draining wakes a parked reader through `Flight.receive_scope`, which
only ever wraps the `receive`.
"""

from __future__ import annotations

from typing import AsyncIterator

import msgspec
import trio

from scheduler.api import ErrorEvent, FinishEvent, TokenEvent

from .completions import Admitted
from .errors import APIError, ErrorBody, ErrorDetail, rate_limited
from .guardrails import OutputGate
from .schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                      ChatCompletionChunk, ChatLogprobs, ChatTokenLogprob, Completion,
                      CompletionChoice, CompletionLogprobs, Delta, PromptTokensDetails,
                      TopLogprob, Usage)

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


class Reader:
    """Reads one flight's events in batches and keeps its timings for the metrics."""

    def __init__(self, adm: Admitted, coalesce: bool = True) -> None:
        self.adm = adm
        self.coalesce = coalesce
        self.events = adm.flight.handle.events
        self.last_token_at: float | None = None
        labels = (adm.flight.pool.model_name, adm.flight.pool.name)  # adapters: their base
        m = adm.flight.state.metrics
        self.ttft, self.itl = m.latencies(*labels)
        self.e2e, self.queue = m.e2e.labels(*labels), m.queue.labels(*labels)

    async def batch(self) -> list[TokenEvent | FinishEvent | ErrorEvent]:
        """Wait for the next event, then take every one already waiting.

        Ends with an ErrorEvent when the server stops the request (drain) or the engine
        closes the channel without a final event.
        """
        flight = self.adm.flight
        with trio.CancelScope() as scope:
            flight.receive_scope = scope
            if flight.stop_reason is not None:
                scope.cancel()
            try:
                out = [await self.events.receive()]
            except trio.EndOfChannel:
                out = [ErrorEvent("the engine ended the request without finishing it")]
        flight.receive_scope = None
        if scope.cancelled_caught:
            return [ErrorEvent(flight.stop_reason or "stopped", kind="stopped")]
        while self.coalesce and isinstance(out[-1], TokenEvent):
            try:
                out.append(self.events.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        if isinstance(out[-1], FinishEvent) and out[-1].finish_reason == "abort":
            out[-1] = ErrorEvent("the engine aborted the request", kind="aborted")
        self._observe(out)
        return out

    def _observe(self, events: list) -> None:
        now = trio.current_time()
        tokens = sum(len(e.token_ids) for e in events if isinstance(e, TokenEvent))
        if tokens:
            self.adm.flight.generated += tokens
            if self.last_token_at is None:
                self.ttft.observe(now - self.adm.arrival)
            else:
                self.itl.observe(now - self.last_token_at)
            self.last_token_at = now
        end = events[-1]
        if isinstance(end, FinishEvent):
            self.e2e.observe(now - self.adm.arrival)
            if end.queue_s is not None:
                self.queue.observe(end.queue_s)


def usage_of(adm: Admitted, fin: FinishEvent | None) -> Usage:
    if fin is None:  # refused by the output check: count what was generated
        p, c, cached = adm.flight.prompt_tokens, adm.flight.generated, 0
    else:
        p, c, cached = fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens
    return Usage(p, c, p + c, PromptTokensDetails(cached))


def error_body(ev: ErrorEvent) -> ErrorBody:
    kind = "rate_limit_error" if ev.kind in ("shed", "overloaded") else "server_error"
    return ErrorBody(ErrorDetail(ev.message, kind, None, ev.kind))


def raise_for(ev: ErrorEvent) -> None:
    if ev.kind in ("shed", "overloaded"):
        raise rate_limited(f"The server is overloaded: {ev.message}", ev.retry_after_s or 1.0,
                           code=ev.kind)
    status = 503 if ev.kind == "stopped" else 500
    raise APIError(status, ev.message, type="server_error", code=ev.kind)


# ------------------------------------------------------------------------ token logprobs
def _token_text(adm: Admitted, token_id: int) -> str:
    return adm.flight.pool.tokenizer.decode([token_id])


def _token_bytes(adm: Admitted, token_id: int) -> list[int]:
    """A token's own bytes (may be half a UTF-8 character, which its text cannot show)."""
    tok = adm.flight.pool.tokenizer
    raw = tok.token_bytes(token_id) if hasattr(tok, "token_bytes") else None
    return list(raw if raw is not None else _token_text(adm, token_id).encode())


def chat_logprobs(adm: Admitted, events: list[TokenEvent]) -> ChatLogprobs | None:
    if adm.logprobs is None:
        return None
    out = []
    for ev in events:
        for lp in ev.logprobs:
            tops = [TopLogprob(_token_text(adm, a.token_id), a.logprob,
                               _token_bytes(adm, a.token_id)) for a in lp.top_logprobs or ()]
            out.append(ChatTokenLogprob(_token_text(adm, lp.token_id), lp.logprob,
                                        _token_bytes(adm, lp.token_id), tops))
    return ChatLogprobs(out)


def completion_logprobs(adm: Admitted, events: list[TokenEvent], offset: int
                        ) -> CompletionLogprobs | None:
    if adm.logprobs is None:
        return None
    lp_out = CompletionLogprobs([], [], [], [])
    for ev in events:
        for lp in ev.logprobs:
            tok = _token_text(adm, lp.token_id)
            lp_out.tokens.append(tok)
            lp_out.token_logprobs.append(lp.logprob)
            lp_out.top_logprobs.append(
                {_token_text(adm, a.token_id): a.logprob for a in lp.top_logprobs or ()})
            lp_out.text_offset.append(offset)
            offset += len(tok)
    return lp_out


# -------------------------------------------------------------------------------- chunks
class ChunkWriter:
    """Renders SSE events for one stream (chat or completion)."""

    def __init__(self, adm: Admitted) -> None:
        self.adm = adm
        self.chat = adm.kind == "chat"
        self.offset = 0

    def _event(self, obj: object) -> bytes:
        return b"data: " + _encode(obj) + b"\n\n"

    def _chunk(self, text: str | None, finish: str | None, events: list[TokenEvent],
               role: bool = False) -> bytes:
        a = self.adm
        if self.chat:
            delta = Delta(role="assistant" if role else None, content=text)
            choice = ChatChunkChoice(0, delta, finish, chat_logprobs(a, events))
            obj: object = ChatCompletionChunk(a.id, "chat.completion.chunk", a.created,
                                              a.model, [choice])
        else:
            lps = completion_logprobs(a, events, self.offset)
            self.offset += len(text or "")
            obj = Completion(a.id, "text_completion", a.created, a.model,
                             [CompletionChoice(0, text or "", finish, lps)])
        return self._event(obj)

    def start(self) -> bytes:
        return self._chunk("", None, [], role=True) if self.chat else b""

    def tokens(self, text: str, events: list[TokenEvent]) -> bytes:
        if not text and not (self.adm.logprobs is not None and events):
            return b""
        return self._chunk(text, None, events)

    def finish(self, reason: str, usage: Usage | None) -> bytes:
        a = self.adm
        out = self._chunk(None if self.chat else "", reason, [])
        if usage is not None and a.include_usage:
            cls = ChatCompletionChunk if self.chat else Completion
            obj = cls(a.id, "chat.completion.chunk" if self.chat else "text_completion",
                      a.created, a.model, [], usage)
            out += self._event(obj)
        return out + DONE

    def error(self, ev: ErrorEvent) -> bytes:
        return self._event(error_body(ev)) + DONE


async def sse_body(adm: Admitted, gate: OutputGate | None, coalesce: bool,
                   flush_interval_s: float = 0.0) -> AsyncIterator[bytes]:
    """The SSE stream for one admitted request (closes its flight however it ends)."""
    flight = adm.flight
    try:
        w = ChunkWriter(adm)
        reader = Reader(adm, coalesce)
        head = w.start()
        if head:
            yield head
        held: list[TokenEvent] = []  # token events whose text the output gate still holds
        while True:
            events = await reader.batch()
            end = events[-1]
            tokens = [e for e in events if isinstance(e, TokenEvent)]
            text = "".join(e.text for e in tokens)
            out = b""
            if gate is not None:  # release token events only with their checked text
                held += tokens
                text = await gate.feed(text, final=not isinstance(end, TokenEvent))
                tokens, held = (held, []) if text else ([], held)
            out += w.tokens(text, tokens)
            if gate is not None and gate.refused:
                flight.close()
                yield out + w.finish("content_filter", usage_of(adm, None))
                return
            if isinstance(end, FinishEvent):
                yield out + w.finish(end.finish_reason, usage_of(adm, end))
                return
            if isinstance(end, ErrorEvent):
                yield out + w.error(end)
                return
            if out:
                yield out
                if flush_interval_s:  # let more tokens pile up before the next write
                    await trio.sleep(flush_interval_s)
    finally:
        flight.close()


async def collect(adm: Admitted, gate: OutputGate | None) -> bytes:
    """The non-streaming response: read to the end, then one JSON body."""
    flight = adm.flight
    try:
        reader = Reader(adm)
        tokens: list[TokenEvent] = []
        while True:
            events = await reader.batch()
            tokens += [e for e in events if isinstance(e, TokenEvent)]
            end = events[-1]
            if isinstance(end, ErrorEvent):
                raise_for(end)
            if isinstance(end, FinishEvent):
                break
        text = "".join(e.text for e in tokens)
        reason = end.finish_reason
        if gate is not None and not await gate.feed(text, final=True) and text:
            text, reason = "", "content_filter"
        usage = usage_of(adm, end)
        if adm.kind == "chat":
            choice = ChatChoice(0, AssistantMessage(text), reason, chat_logprobs(adm, tokens))
            return _encode(ChatCompletion(adm.id, "chat.completion", adm.created, adm.model,
                                          [choice], usage))
        choice = CompletionChoice(0, text, reason, completion_logprobs(adm, tokens, 0))
        return _encode(Completion(adm.id, "text_completion", adm.created, adm.model,
                                  [choice], usage))
    finally:
        flight.close()
