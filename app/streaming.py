"""From an admitted request's engine events to bytes: SSE chunks or one JSON response.

Streaming writes coalesce: after each token event the reader takes whatever else is
already waiting in the request's channel, so a slow client gets fewer, bigger writes
(one write costs ~100 us of CPU in hypercorn/h11 whatever its size) and the engine never
waits on it. The first chunk carries the role; the last carries `finish_reason`; with
`stream_options.include_usage` a usage chunk follows (with `continuous_usage_stats`, every
chunk carries the usage so far, as vLLM does); ``data: [DONE]`` ends every stream,
errors included (an error mid-stream is a ``data: {"error": ...}`` event, which the
official clients raise).

The SSE body is an async generator that the server iterates in the connection's task.
A client disconnect arrives in it as `trio.Cancelled` (parked at an await) or
`GeneratorExit` (parked at a yield); either way `finally` calls the synchronous
`Flight.close`, which aborts the sequence. No cancel scope is held across a `yield`
(trio forbids it): draining wakes a parked reader through `Flight.receive_scope`, which
only ever wraps the `receive`.

(About 390 lines: the chat and completion writers, the per-choice gate, call and
reasoning split, and the streaming and collecting loops share one event model.)
"""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator

import msgspec
import trio

from scheduler.api import ErrorEvent, FinishEvent, TokenEvent

from . import reasoning, tools
from .completions import Admitted
from .errors import APIError, ErrorBody, ErrorDetail, rate_limited
from .guardrails import OutputGate
from .logprobs import chat_logprobs, completion_logprobs, mean_logprob
from .schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                      ChatCompletionChunk, Completion, CompletionChoice, Delta,
                      PromptTokensDetails, Usage)

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode
# Characters that JSON leaves raw but that line readers built on str.splitlines() (httpx's
# `iter_lines`, which our own chat CLI and many clients use) take for line ends, cutting
# an event in two: NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR. In UTF-8 these bytes occur
# only as those characters, and in JSON only inside strings, where the escape is the same
# text. (The control characters below U+0020 JSON escapes anyway.)
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"),
                (b"\xe2\x80\xa9", b"\\u2029"))


def sse_data(obj: object) -> bytes:
    """One SSE event of `obj` as JSON, on a single line whatever its text holds."""
    data = _encode(obj)
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


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
            if flight.stop_reason is not None:
                # The server ended it (drain) while an event was already on its way to
                # this reader, so the receive returned before the cancel could land.
                out[-1] = ErrorEvent(flight.stop_reason, kind="stopped", index=out[-1].index)
            else:
                out[-1] = ErrorEvent("the engine aborted the request", kind="aborted",
                                     index=out[-1].index)
        if self.adm.score_only:
            out = [_answerless(e) for e in out]
        self._observe(out)
        return out

    def _observe(self, events: list) -> None:
        if self.adm.flight.log is not None:
            self.adm.flight.log.observe(events)
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


def _answerless(ev):
    """`max_tokens: 0` with `echo`: the one token generated is not part of the answer."""
    if isinstance(ev, TokenEvent):
        return TokenEvent("", (), (), ev.index, ev.prompt_logprobs)
    if isinstance(ev, FinishEvent):
        return dataclasses.replace(ev, finish_reason="length", completion_tokens=0)
    return ev


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
    status = 503 if ev.kind in ("stopped", "engine_dead") else 500
    raise APIError(status, ev.message, type="server_error", code=ev.kind)


# -------------------------------------------------------------------------------- chunks
class ChunkWriter:
    """Renders SSE events for one stream (chat or completion) of `n` choices."""

    def __init__(self, adm: Admitted) -> None:
        self.adm = adm
        self.chat = adm.kind == "chat"
        self.offsets = [0] * adm.n  # completions' logprob text offsets, per choice
        # Completions' echo with logprobs goes out with the first tokens, which bring the
        # prompt's logprobs; without logprobs it goes first (`start`).
        self.echo_due = [bool(adm.echo) and adm.logprobs is not None] * adm.n

    def _event(self, obj: object) -> bytes:
        return sse_data(obj)

    def _chunk(self, text: str | None, finish: str | None, events: list[TokenEvent],
               role: bool = False, index: int = 0) -> bytes:
        prompt = not self.chat and self.echo_due[index]
        if prompt:
            text, self.echo_due[index] = self.adm.echo + (text or ""), False
        a = self.adm
        usage = None
        if a.continuous_usage:  # vLLM's continuous_usage_stats: the counts so far
            p, c = a.flight.prompt_tokens, a.flight.generated
            usage = Usage(p, c, p + c)
        if self.chat:
            delta = Delta(role="assistant" if role else None, content=text)
            choice = ChatChunkChoice(index, delta, finish, chat_logprobs(a, events))
            obj: object = ChatCompletionChunk(a.id, "chat.completion.chunk", a.created,
                                              a.model, [choice], usage)
        else:
            lps = completion_logprobs(a, events, self.offsets[index], prompt)
            self.offsets[index] += len(text or "")
            obj = Completion(a.id, "text_completion", a.created, a.model,
                             [CompletionChoice(index, text or "", finish, lps)], usage)
        return self._event(obj)

    def start(self) -> bytes:
        if self.chat:
            return b"".join(self._chunk("", None, [], role=True, index=i)
                            for i in range(self.adm.n))
        echo = self.adm.echo
        return b"".join(self._chunk(echo, None, [], index=i) for i in range(self.adm.n)
                        ) if echo and self.adm.logprobs is None else b""

    def tokens(self, text: str, events: list[TokenEvent], index: int = 0) -> bytes:
        if not text and not (self.adm.logprobs is not None and events) and not (
                self.echo_due[index]):
            return b""
        return self._chunk(text, None, events, index=index)

    def finish_choice(self, reason: str, index: int = 0) -> bytes:
        return self._chunk(None if self.chat else "", reason, [], index=index)

    def reasoning(self, text: str, index: int = 0) -> bytes:
        """A thinking chat choice's reasoning (app/reasoning.py), as it comes."""
        if not text:
            return b""
        a = self.adm
        choice = ChatChunkChoice(index, Delta(reasoning_content=text))
        return self._event(ChatCompletionChunk(a.id, "chat.completion.chunk", a.created,
                                               a.model, [choice]))

    def tool_calls(self, calls: list, index: int = 0) -> bytes:
        """A chat choice's calls, whole, in one chunk (app/tools.py)."""
        a = self.adm
        choice = ChatChunkChoice(index, Delta(tool_calls=calls))
        return self._event(ChatCompletionChunk(a.id, "chat.completion.chunk", a.created,
                                               a.model, [choice]))

    def end(self, usage: Usage | None) -> bytes:
        a = self.adm
        out = b""
        if usage is not None and a.include_usage:
            cls = ChatCompletionChunk if self.chat else Completion
            obj = cls(a.id, "chat.completion.chunk" if self.chat else "text_completion",
                      a.created, a.model, [], usage)
            out += self._event(obj)
        return out + DONE

    def error(self, ev: ErrorEvent) -> bytes:
        return self._event(error_body(ev)) + DONE


def runs(events: list) -> list[tuple[int, list[TokenEvent], FinishEvent | ErrorEvent | None]]:
    """A batch of events as (choice, its consecutive token events, its end or None)."""
    out: list = []
    for e in events:
        if out and out[-1][0] == e.index and out[-1][2] is None:
            if isinstance(e, TokenEvent):
                out[-1][1].append(e)
            else:
                out[-1][2] = e
        else:
            out.append([e.index, [e] if isinstance(e, TokenEvent) else [],
                        None if isinstance(e, TokenEvent) else e])
    return [tuple(r) for r in out]


class _Choice:
    """One choice's output gate and the token events whose text it still holds, and with
    tools in play the text a call may be in (`tools.CallStream`)."""

    def __init__(self, make_gate, adm: Admitted) -> None:
        self.gate: OutputGate | None = make_gate() if make_gate is not None else None
        self.calls = tools.CallStream() if adm.tools else None
        self.thought = reasoning.ReasoningStream(adm.thinks_inside) if adm.thinks else None
        self.held: list[TokenEvent] = []
        self.end: FinishEvent | None = None
        self.reason: str | None = None  # its finish_reason once ended


def usage_of_all(adm: Admitted, ends: list[FinishEvent | None]) -> Usage:
    """The request's usage: the prompt once, every choice's completion."""
    if len(ends) == 1:
        return usage_of(adm, ends[0])
    known = [usage_of(adm, e) for e in ends if e is not None]
    p = known[0].prompt_tokens if known else adm.flight.prompt_tokens
    cached = known[0].prompt_tokens_details.cached_tokens if known else 0
    c = sum(u.completion_tokens for u in known)
    return Usage(p, c, p + c, PromptTokensDetails(cached))


async def sse_body(adm: Admitted, make_gate, coalesce: bool,
                   flush_interval_s: float = 0.0, writer=None) -> AsyncIterator[bytes]:
    """The SSE stream for one admitted request (closes its flight however it ends).
    `make_gate`: a new output gate per choice (None: no output check); `writer`: what
    renders the events (None: chat or completion chunks, `ChunkWriter`; the Responses
    API's, app/responses.py)."""
    flight = adm.flight
    try:
        w = writer or ChunkWriter(adm)
        reader = Reader(adm, coalesce)
        choices = [_Choice(make_gate, adm) for _ in range(adm.n)]
        head = w.start()
        if head:
            yield head
        while True:
            events = await reader.batch()
            out = b""
            for index, tokens, end in runs(events):
                c = choices[index]
                if isinstance(end, ErrorEvent) and (c.reason is None or end.kind != "aborted"):
                    yield out + w.error(end)
                    return
                if c.reason is not None:
                    continue  # cut by its gate: the rest of it (and its abort) dropped
                text = "".join(e.text for e in tokens)
                if c.gate is not None:  # release token events only with their checked text
                    c.held += tokens
                    text = await c.gate.feed(text, final=end is not None)
                    tokens, c.held = (c.held, []) if text else ([], c.held)
                if c.thought is not None:
                    thought, text = c.thought.feed(text)
                    if end is not None:  # the rest held back for a tag that never came
                        more, rest = c.thought.finish()
                        thought, text = thought + more, text + rest
                    out += w.reasoning(thought, index)
                if c.calls is not None:
                    text = c.calls.feed(text)
                out += w.tokens(text, tokens, index)
                if c.gate is not None and c.gate.refused:
                    c.reason = "content_filter"
                    flight.abort_choice(index)
                elif end is not None:
                    c.end, c.reason = end, end.finish_reason
                if c.reason is not None:
                    if c.calls is not None and c.reason != "content_filter":
                        rest, calls = c.calls.finish()
                        out += w.tokens(rest, [], index)
                        if calls:
                            out += w.tool_calls(calls, index)
                            c.reason = "tool_calls" if c.reason == "stop" else c.reason
                    out += w.finish_choice(c.reason, index)
            if all(c.reason is not None for c in choices):
                out += w.end(usage_of_all(adm, [c.end for c in choices]))
                if (ended := getattr(w, "ended", None)) is not None:
                    await ended()  # (a stored response: kept before its client has it)
                yield out
                return
            if out:
                yield out
                if flush_interval_s:  # let more tokens pile up before the next write
                    await trio.sleep(flush_interval_s)
    finally:
        flight.close()


async def collect(adm: Admitted, make_gate) -> bytes:
    """The non-streaming response: read to the end, then one JSON body."""
    flight = adm.flight
    try:
        reader = Reader(adm)
        tokens: list[list[TokenEvent]] = [[] for _ in range(adm.sequences)]
        ends: list[FinishEvent | None] = [None] * adm.sequences
        while any(e is None for e in ends):
            for index, evs, end in runs(await reader.batch()):
                tokens[index] += evs
                if isinstance(end, ErrorEvent):
                    raise_for(end)
                if end is not None:
                    ends[index] = end
        picked = (sorted(range(adm.sequences), key=lambda i: -mean_logprob(tokens[i]))[:adm.n]
                  if adm.sequences > adm.n else range(adm.n))
        choices = []
        for index, (evs, end) in enumerate((tokens[i], ends[i]) for i in picked):
            text = "".join(e.text for e in evs)
            reason = end.finish_reason
            gate = make_gate() if make_gate is not None else None
            if gate is not None and not await gate.feed(text, final=True) and text:
                text, reason = "", "content_filter"
            if adm.kind == "chat":
                thought, content = (reasoning.split(text, adm.thinks_inside) if adm.thinks
                                    else (None, text))
                content, calls = tools.split_calls(content) if adm.tools else (content, [])
                if calls and reason == "stop":
                    reason = "tool_calls"
                message = AssistantMessage(content, tool_calls=calls or None,
                                           reasoning_content=thought)
                choices.append(ChatChoice(index, message, reason, chat_logprobs(adm, evs)))
            else:
                choices.append(CompletionChoice(index, adm.echo + text, reason, completion_logprobs(
                    adm, evs, 0, prompt=bool(adm.prompt_ids))))
        usage = usage_of_all(adm, ends)
        if adm.kind == "chat":
            return _encode(ChatCompletion(adm.id, "chat.completion", adm.created, adm.model,
                                          choices, usage))
        return _encode(Completion(adm.id, "text_completion", adm.created, adm.model,
                                  choices, usage))
    finally:
        flight.close()
