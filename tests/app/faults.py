"""Fault injection for the reliability tests (issue 17): wrappers a test puts around a live
engine's runner and detokenizer. Test-only by construction: nothing in app/, scheduler/
or model/ imports this module, so no HTTP request can reach it.

`FaultyRunner` runs the real runner's steps, except that it can
- raise instead of stepping (`fail_next`: the next N steps; `fail_always`);
- poison a sequence before a step: write NaN into every KV page that sequence's chunk
  reads, so the real model computes NaN logits for that row alone (what a numerically
  broken page, or a bad kernel, does in production). Runs in the step's worker thread,
  under the same serialisation as the step, so it never races the donated KV pool.

`BreakingDetokenizer` gives sequences whose prompt contains a marker a decoder that
raises (`boom`), or one whose text breaks the stop-string check (`bad_text`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np


class InjectedFault(RuntimeError):
    pass


class FaultyRunner:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.fail_next = 0
        self.fail_always = False
        self.poison: set[int] = set()  # seq_ids to poison before their next step
        self.steps = 0  # steps attempted through this wrapper
        self.failed_steps = 0

    def __getattr__(self, name: str) -> Any:  # everything else: the real runner's
        return getattr(self.inner, name)

    def step(self, plan):
        self._before(plan)
        return self.inner.step(plan)

    def launch(self, plan):  # overlapped scheduling's half of a step (the engine's)
        self._before(plan)
        return self.inner.launch(plan)

    def collect(self, handle):
        return self.inner.collect(handle)

    def _before(self, plan) -> None:
        self.steps += 1
        if self.fail_always or self.fail_next > 0:
            self.fail_next = max(0, self.fail_next - 1)
            self.failed_steps += 1
            raise InjectedFault("injected step failure")
        for chunk in plan.chunks:
            if chunk.seq_id in self.poison:
                self.poison.discard(chunk.seq_id)
                self._poison_pages(chunk.page_table)

    def _poison_pages(self, pages: Sequence[int]) -> None:
        r = self.inner
        pages = np.asarray([p for p in pages if p > 0], np.int32)
        layers = np.arange(r.config.num_layers, dtype=np.int32)[:, None] * r.num_pages
        rows = jnp.asarray((layers + pages[None, :]).reshape(-1))  # kv row = layer, page
        with r._lock:
            r.kv = tuple(a.at[rows].set(jnp.nan) for a in r.kv)


class _Decoder:
    def __init__(self, inner: Any, mode: str) -> None:
        self.inner, self.mode = inner, mode

    def push(self, token_id: int) -> str:
        self.inner.push(token_id)  # the real decoder keeps its state
        if self.mode == "boom":
            raise InjectedFault("injected detokenizer failure")
        return 12345  # type: ignore[return-value]  # not text: the stop check raises

    def flush(self) -> str:
        return self.inner.flush()


class BreakingDetokenizer:
    def __init__(self, inner: Any, markers: dict[tuple[int, ...], str]) -> None:
        self.inner = inner
        self.markers = markers  # token ids in the prompt -> "boom" | "bad_text"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def incremental(self, prompt_ids: Sequence[int]):
        decoder = self.inner.incremental(prompt_ids)
        ids = list(prompt_ids)
        for marker, mode in self.markers.items():
            n = len(marker)
            if any(tuple(ids[i:i + n]) == marker for i in range(len(ids) - n + 1)):
                return _Decoder(decoder, mode)
        return decoder
