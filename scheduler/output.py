"""Per-request output: incremental text, stop conditions, and what still waits to be sent.

Text is only ever released once it is final:

- the detokenizer holds back incomplete UTF-8 (its `push` returns only whole characters);
- this stream holds back the longest tail of the text that could still be the beginning
  of a stop string, because the next token may complete it and the stop string must never
  reach the client. A stop string may span any number of tokens.

Tokens and text that could not be delivered yet (the client's channel is full) pile up
here and go out as one event later: the engine never blocks on a slow client. This
module does not know about trio; the engine does the sending.
"""

from __future__ import annotations

from typing import Any, Sequence

from .api import TokenEvent
from .protocol import IncrementalDecoder, SampledToken


class OutputStream:
    __slots__ = ("decoder", "stop_ids", "stops", "_stop_chars", "held", "channel",
                 "want_logprobs", "_text", "_ids", "_logprobs", "final", "stopped", "index",
                 "prompt_logprobs")

    def __init__(
        self,
        decoder: IncrementalDecoder,
        *,
        stop_ids: frozenset[int],
        stops: Sequence[str],
        channel: Any,
        want_logprobs: bool = False,
        index: int = 0,
    ) -> None:
        self.decoder = decoder
        self.stop_ids = stop_ids
        self.stops = tuple(s for s in stops if s)
        self._stop_chars = frozenset("".join(self.stops))
        self.held = ""  # text that may be the start of a stop string
        self.channel = channel  # the request's send channel (the engine's business)
        self.want_logprobs = want_logprobs
        self._text: list[str] = []  # released, not yet delivered
        self._ids: list[int] = []
        self._logprobs: list[SampledToken] = []
        self.final: Any = None  # FinishEvent / ErrorEvent waiting to be delivered
        self.stopped = False  # a stop string or stop token was seen: ignore the rest
        self.index = index  # the request's choice this stream is (its events say so)
        self.prompt_logprobs: tuple = ()  # the prompt's logprobs, not yet delivered

    def append(self, tok: SampledToken) -> bool:
        """Take one sampled token. True when it ends the stream ("stop").

        A stop token (eos, `stop_token_ids`) is counted but not shown: it is not in the
        events' token ids and adds no text. Tokens whose text is cut by a stop string
        are reported (they were generated) without that text."""
        tid = tok.token_id
        if tid in self.stop_ids:
            self._feed(self.decoder.flush())
            self.stopped = True
            return True
        self._ids.append(tid)
        if self.want_logprobs:
            self._logprobs.append(tok)
        return self._feed(self.decoder.push(tid))

    def close(self) -> bool:
        """End of stream for any other reason (length, abort): release what was held back.
        True if the decoder's last bytes completed a stop string after all."""
        if self.stopped:
            return False
        found = self._feed(self.decoder.flush())
        if not found and self.held:
            self._text.append(self.held)
            self.held = ""
        return found

    def _feed(self, text: str) -> bool:
        if self.stopped:
            return True
        if not self.stops:
            if text:
                self._text.append(text)
            return False
        if not text:
            return False
        buf = self.held + text
        # Only `buf` can hold a stop string that is not yet reported: everything released
        # earlier was released precisely because no stop string could start in it.
        cut = -1
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            if cut:
                self._text.append(buf[:cut])
            self.held = ""
            self.stopped = True
            return True
        keep = self._partial_stop_len(buf)
        if keep < len(buf):
            self._text.append(buf[:len(buf) - keep])
        self.held = buf[len(buf) - keep:] if keep else ""
        return False

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        if buf[-1] not in self._stop_chars:
            return 0
        best = 0
        for s in self.stops:
            for k in range(min(len(buf), len(s) - 1), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best

    # -- delivery ------------------------------------------------------------------------
    @property
    def has_tokens(self) -> bool:
        return bool(self._text or self._ids or self.prompt_logprobs)

    @property
    def has_text(self) -> bool:
        return bool(self._text)

    def token_event(self) -> TokenEvent:
        """Everything pending, as one event (not yet cleared: see `sent`)."""
        return TokenEvent(text="".join(self._text), token_ids=tuple(self._ids),
                          logprobs=tuple(self._logprobs), index=self.index,
                          prompt_logprobs=self.prompt_logprobs)

    def sent(self) -> None:
        self._text.clear()
        self._ids.clear()
        self._logprobs.clear()
        self.prompt_logprobs = ()
