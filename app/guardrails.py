"""Optional guardrail sidecars: an input check before the engine, output checks on the text.

A sidecar is any HTTP service that takes ``POST {"kind": "input"|"output", "model",
"tenant", "text", "window"}`` and answers ``{"allowed": bool, "reason": str}``. Each check
has a latency budget: past it (or on any error) the check counts as passed when the
config says fail-open and as refused when it says fail-closed, so a slow sidecar costs
at most its budget, never a stuck request.

Output checks run on the streamed text in windows of `output_window_chars`: the text of a
window is held back until its check answers (at most the budget), then released. So a
client never sees unchecked text, and the stream is never held longer than one budget
per window. The engine keeps generating meanwhile; what piled up is coalesced into the
next write.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import httpx
import msgspec
import trio

from config.settings import GuardrailConfig

from .errors import APIError, bad_request


class Verdict(msgspec.Struct):
    allowed: bool
    reason: str = ""


@dataclass(frozen=True)
class Outcome:
    allowed: bool
    reason: str  # the sidecar's reason, or "timeout"/"error: ..." when it did not answer
    answered: bool


class Guardrails:
    def __init__(self, config: GuardrailConfig, client: httpx.AsyncClient | None = None):
        self.config = config
        self._client = client
        self.counts: dict[str, int] = {}  # "input:allowed", "output:timeout", ... for tests/logs

    @property
    def checks_output(self) -> bool:
        return self.config.output_url is not None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:  # made lazily: it must be created inside the trio run
            self._client = httpx.AsyncClient(timeout=None)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def check_input(self, *, text: str, tenant: str, model: str) -> None:
        """Raise 400 (refused) or 503 (fail-closed and the sidecar did not answer)."""
        c = self.config
        if c.input_url is None:
            return
        out = await self._check("input", c.input_url, c.input_budget_ms, c.input_fail_open,
                                text=text, window=text, tenant=tenant, model=model)
        if out.allowed:
            return
        if not out.answered:
            raise APIError(503, f"The input check did not answer ({out.reason}).",
                           type="server_error", code="guardrail_unavailable")
        raise bad_request(f"The input was refused by the content check: {out.reason}",
                          param="messages", code="content_filter")

    async def check_output(self, *, text: str, window: str, tenant: str, model: str) -> bool:
        c = self.config
        assert c.output_url is not None
        out = await self._check("output", c.output_url, c.output_budget_ms,
                                c.output_fail_open, text=text, window=window, tenant=tenant,
                                model=model)
        return out.allowed

    async def _check(self, kind: str, url: str, budget_ms: float, fail_open: bool,
                     **payload: str) -> Outcome:
        body = msgspec.json.encode({"kind": kind, **payload})
        reason = "timeout"
        with trio.move_on_after(budget_ms / 1000):
            try:
                r = await self._http().post(url, content=body,
                                            headers={"content-type": "application/json"})
                r.raise_for_status()
                v = msgspec.json.decode(r.content, type=Verdict)
            except (httpx.HTTPError, msgspec.DecodeError) as e:
                reason = f"error: {type(e).__name__}"
            else:
                self._count(kind, "allowed" if v.allowed else "refused")
                return Outcome(v.allowed, v.reason, answered=True)
        self._count(kind, reason.split(":")[0])
        return Outcome(fail_open, reason, answered=False)

    def _count(self, kind: str, what: str) -> None:
        key = f"{kind}:{what}"
        self.counts[key] = self.counts.get(key, 0) + 1


class OutputGate:
    """Holds one stream's text back until each window has passed the output check."""

    def __init__(self, guard: Guardrails, *, tenant: str, model: str) -> None:
        self.guard = guard
        self.tenant = tenant
        self.model = model
        self.window = guard.config.output_window_chars
        self.released = ""
        self.pending = ""
        self.refused = False

    async def feed(self, text: str, *, final: bool = False) -> str:
        """Add streamed text; return what may be shown now ("" while held or refused)."""
        self.pending += text
        if self.refused or not self.pending or (len(self.pending) < self.window and not final):
            return ""
        # Check whole windows; at the end, the remainder too.
        cut = len(self.pending) if final else self.window * math.floor(
            len(self.pending) / self.window)
        window, self.pending = self.pending[:cut], self.pending[cut:]
        ok = await self.guard.check_output(text=self.released + window, window=window,
                                           tenant=self.tenant, model=self.model)
        if not ok:
            self.refused = True
            return ""
        self.released += window
        return window
