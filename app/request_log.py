"""One log line per finished request, on the "sluice.requests" logger (`server.log_requests`).

The line names the request (the id its client saw), tenant, model, outcome (each choice's
finish reason; ``error:<kind>`` when the engine or a drain ended it; ``cancelled`` when the
client went away first), prompt and completion tokens, latency from arrival to the end,
and the engine's time to first token beside what admission predicted for it (the door
calibrates itself on the two: scheduler/admission.py). No prompt or output text, unless
the operator asks: "hash" adds a SHA-256 prefix of each (enough to match a complaint to
a request without keeping what was said),
"truncate" their first 64 characters, JSON-quoted so a newline or control character in
them cannot forge a line. For `n` choices the output fields list one value per choice,
comma-separated.

A `RequestLog` rides on its `Flight` (app/state.py): the engine events feed it as they
are read (app/streaming.py `Reader`), and `Flight.close`, the one place every admitted
request ends, emits it. Requests refused before admission get no line (the 4xx is the
client's answer; /metrics counts refusals).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING, Literal

import trio

from scheduler.api import ErrorEvent, FinishEvent, TokenEvent

if TYPE_CHECKING:
    from .completions import Admitted

log = logging.getLogger("sluice.requests")
Mode = Literal["off", "metadata", "hash", "truncate"]
TRUNCATE_CHARS = 64
HASH_HEX_CHARS = 16  # 64 bits of the SHA-256: unique enough to match, not to brute-force


class RequestLog:
    """One request's log line, gathered as it runs; `emit` writes it (once)."""

    def __init__(self, mode: Mode, adm: Admitted, prompt: str) -> None:
        self.mode = mode
        self.id, self.tenant, self.model = adm.id, adm.tenant.name, adm.model
        self.arrival = adm.arrival
        self.prompt = self._text_field(prompt)
        self.outcomes: dict[int, str] = {}  # choice -> its finish reason or error
        self.hashes: dict[int, hashlib._Hash] = {}  # "hash": choice -> its output so far
        self.heads: dict[int, str] = {}  # "truncate": choice -> its output's first chars
        self.emitted = False
        # The first choice's time to first token in the engine, and admission's prediction.
        self.ttft: tuple[float | None, float | None] = (None, None)

    def observe(self, events: list) -> None:
        """A batch of the request's engine events (as `Reader.batch` returns them)."""
        for e in events:
            if isinstance(e, TokenEvent):
                if self.mode == "hash":
                    self.hashes.setdefault(e.index, hashlib.sha256()).update(_utf8(e.text))
                elif self.mode == "truncate":
                    head = self.heads.get(e.index, "")
                    if len(head) < TRUNCATE_CHARS:
                        self.heads[e.index] = (head + e.text)[:TRUNCATE_CHARS]
            elif isinstance(e, FinishEvent):
                self.outcomes.setdefault(e.index, e.finish_reason)
                if e.index == 0:
                    self.ttft = (e.ttft_s, e.predicted_ttft_s)
            elif isinstance(e, ErrorEvent):
                self.outcomes.setdefault(e.index, f"error:{e.kind}")

    def emit(self, prompt_tokens: int, completion_tokens: int) -> None:
        if self.emitted or not log.isEnabledFor(logging.INFO):
            return
        self.emitted = True
        ends = [self.outcomes[i] for i in sorted(self.outcomes)]
        errors = [o for o in ends if o.startswith("error:")]
        outcome = errors[0] if errors else ",".join(ends) if ends else "cancelled"
        line = (f"request id={self.id} tenant={self.tenant} model={self.model} "
                f"outcome={outcome} prompt_tokens={prompt_tokens} "
                f"completion_tokens={completion_tokens} "
                f"latency_s={trio.current_time() - self.arrival:.3f}")
        ttft, predicted = self.ttft
        if ttft is not None:
            line += f" ttft_s={ttft:.3f}"
        if predicted is not None:
            line += f" predicted_ttft_s={predicted:.3f}"
        if self.mode == "hash":
            out = ",".join(self.hashes[i].hexdigest()[:HASH_HEX_CHARS]
                           for i in sorted(self.hashes))
            line += f" prompt_sha256={self.prompt} output_sha256={out or '-'}"
        elif self.mode == "truncate":
            out = ",".join(json.dumps(self.heads[i]) for i in sorted(self.heads))
            line += f" prompt={self.prompt} output={out or json.dumps('')}"
        log.info("%s", line)

    def _text_field(self, text: str) -> str:
        if self.mode == "hash":
            return hashlib.sha256(_utf8(text)).hexdigest()[:HASH_HEX_CHARS]
        if self.mode == "truncate":
            return json.dumps(text[:TRUNCATE_CHARS])  # ASCII, quoted: one line whatever it holds
        return ""


def request_log(mode: Mode, adm: Admitted, prompt: str) -> RequestLog | None:
    """The log of an admitted request (None: `log_requests` is off)."""
    return None if mode == "off" else RequestLog(mode, adm, prompt)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")
