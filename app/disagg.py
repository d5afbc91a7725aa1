"""Prefill and decode apart: a decode pool's prompts computed by prefill servers.

A pool with `role = "decode"` (config/settings.py) sends each prompt it would have to
compute (at least `remote_prefill_min_tokens` tokens not cached in the replica) to a
prefill server, a Sluice process whose pool has `role = "prefill"`:

    decode server (the client's stream)             prefill server
    admit: door, KV room ----- POST /internal/prefill ---->  its door, one-token request
                                                         prompt computed, pages gathered
    inbox of the replica <---- the prompt's full pages ----  (msgpack, checked by CRC-32,
    submit: a tier hit, only the last partial page          model fingerprint, layout)
    is computed here; the answer streams from here

- What is sent: the prompt's full pages past those the decode replica already holds
  (its pool or KV tiers: a cached system prompt is never sent again), and not those
  another prompt's prefill is bringing: that prompt waits for them (`follow`). The last
  partial page and the first token are computed on the decode side (a few tokens,
  beside its decodes), as a prefix-cache hit on one replica computes them: the tokens
  are those one replica gives with the prompt's pages cached (with an f32 pool, cold
  too; docs/operations.md, "Prefill and decode apart").
- Transport: HTTP (httpx to hypercorn), one message per prompt (app/kv_wire.py: msgpack,
  the model's fingerprint, the page layout, a CRC-32 of the pages' bytes); across hosts
  the same, behind whatever network the fleet has. A prefill pool of the same server
  (`"pool:NAME"`) is asked directly, and its pages go device to device: `jax.device_put`
  onto the decode replica's pool sharding, scattered into fresh pages of its pool by its
  next step and cached there (`Engine.import_pages`), so the prompt is a device hit.
- The decode side checks its room first (queue, TTFT of what is ahead, free pages for
  the prompt beside those being prefilled for it: `Engine.reserve_room`), so a prompt is
  never computed and then dropped for want of pages. The prefill server's own door may refuse (429): the client gets it.
- Faults: a prefill server that cannot be reached, fails or times out is skipped for
  `_DOWN_S` and the prompt goes to the next one; when none is left, the decode replica
  computes it itself (counted). The client's disconnect cancels the HTTP call, which
  the prefill server sees as a disconnect and aborts (its pages freed). Pages received
  and never admitted (the request cancelled, refused) are dropped at the flight's end.
- Which prefill server: the one with the fewest prompts ahead of a new one (sent from
  here and unanswered, plus what it last reported waiting), then the youngest queue and
  the most free KV pages (its answers' headers); one that failed lately last. The decode
  replica: the least busy, then the one with the most free pages.

(About 370 lines: the decode side's ask, its choices and faults, and the prefill side's
answer are one exchange, read together.)
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import msgspec
import trio

from scheduler.api import (EngineDead, ErrorEvent, FinishEvent, GenerateRequest, Overloaded,
                           SamplingParams)

from .errors import bad_request, not_found, rate_limited, unavailable
from .kv_wire import (COPY_S, FREE_PAGES, OLDEST, PATH, PREFILL_S, WAITING,
                      PrefillAsk, WireError, ask_decoder, ask_encoder, decode, encode)

log = logging.getLogger("sluice.disagg")

_DOWN_S = 5.0  # a prefill server that failed is tried last for this long


class RemotePrefill:
    """A decode pool's prefill servers and the calls to them."""

    def __init__(self, pool, metrics, pools: dict | None = None) -> None:
        cfg = pool.config
        self.pool = pool
        self.metrics = metrics
        self.urls = [u.rstrip("/") for u in cfg.prefill_urls]
        # Each prefill server: a base URL, or a prefill pool of this server ("pool:NAME").
        self.targets = [(pools or {}).get(u[5:], u) if u.startswith("pool:") else u
                        for u in self.urls]
        self.min_tokens = cfg.remote_prefill_min_tokens
        self.in_flight = [0] * len(self.urls)
        self.down_until = [0.0] * len(self.urls)
        # What each last said of its load: (waiting, oldest waiting age s, free pages).
        self.load = [(0, 0.0, 0)] * len(self.urls)
        # Pages on their way to a replica: (id(engine), page key) -> set when they are in.
        self._transit: dict[tuple[int, int], trio.Event] = {}
        # Server to server: no proxy from the environment in between.
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(
            cfg.remote_prefill_timeout_s, connect=5.0), trust_env=False)

    def first_page(self, engine, greq: GenerateRequest) -> int | None:
        """The first page to ask a prefill server for, or None: computed here (short, or
        cached here, an adapter's, or a prompt scored whole)."""
        if (greq.adapter is not None or greq.prompt_logprobs is not None
                or not self.urls):
            return None
        held = engine.held_prompt_pages(greq)
        ps = engine.runner.page_size
        if len(greq.prompt_ids) - held * ps < max(self.min_tokens, 2 * ps):
            return None
        return held

    async def follow(self, greq: GenerateRequest) -> int | None:
        """A prompt whose next missing page another prompt's prefill is bringing to a
        replica (a burst sharing a new system prompt): wait for those pages there and
        return that replica (then only what is still missing is asked for). None: no
        such prefill in flight. Waits again if the next pages are on their way too."""
        engines = self.pool.engines
        keys = engines[0].prompt_page_keys(greq)
        followed = None
        while True:
            for i, engine in enumerate(engines):
                held = engine.held_prompt_pages(greq)
                event = (self._transit.get((id(engine), keys[held]))
                         if held < len(keys) else None)
                if event is not None:
                    break
            else:
                return followed
            followed = i
            await event.wait()

    def _order(self) -> list[int]:
        """Prefill servers, best first: up before down, then by what is ahead of a new
        prompt there (sent from here and not answered, and what it last said was
        waiting), its oldest waiting request's age, and its free KV pages. (A pool of
        this server says it as it is now.)"""
        now = time.monotonic()
        for i, t in enumerate(self.targets):
            if not isinstance(t, str):
                self._note_load(i, load_headers(t))
        return sorted(range(len(self.urls)), key=lambda i: (
            self.down_until[i] > now, self.in_flight[i] + self.load[i][0],
            self.load[i][1], -self.load[i][2]))

    def _note_load(self, i: int, headers) -> None:
        try:
            self.load[i] = (int(headers[WAITING]), float(headers[OLDEST]),
                            int(headers[FREE_PAGES]))
        except (KeyError, ValueError):
            pass

    async def prefill(self, engine, greq: GenerateRequest, first: int,
                      authorization: str | None) -> list[int]:
        """Have a prefill server compute `greq`'s prompt and put its pages in `engine`'s
        inbox; returns their keys. [] when no prefill server could (computed here then).
        Raises an APIError for a refusal the client should see (429: the prefill tier
        is full)."""
        # Prompts after the same pages wait for these (`follow`) rather than ask again.
        event = trio.Event()
        transit = [(id(engine), key) for key in engine.prompt_page_keys(greq)[first:]]
        for k in transit:
            self._transit.setdefault(k, event)
        try:
            return await self._prefill(engine, greq, first, authorization)
        finally:
            for k in transit:
                if self._transit.get(k) is event:
                    del self._transit[k]
            event.set()

    async def _prefill(self, engine, greq: GenerateRequest, first: int,
                       authorization: str | None) -> list[int]:
        ask = ask_encoder.encode(PrefillAsk(self.pool.model_name, list(greq.prompt_ids),
                                             first, greq.priority))
        headers = {"Content-Type": "application/msgpack"}
        if authorization:
            headers["Authorization"] = authorization
        runner = engine.runner
        name, model = self.pool.name, self.pool.model_name
        for attempt, i in enumerate(self._order()[:2]):
            outcome = "ok" if attempt == 0 else "retried"
            if not isinstance(self.targets[i], str):
                keys = await self._in_process(i, engine, greq, first, outcome)
                if keys is not None:
                    return keys
                continue
            self.in_flight[i] += 1
            t0 = time.monotonic()
            try:
                r = await self._http.post(self.urls[i] + PATH, content=ask, headers=headers)
            except httpx.HTTPError as e:
                self._down(i, f"{type(e).__name__}: {e}")
                self.metrics.remote_prefill(model, name, "unreachable")
                continue
            finally:
                self.in_flight[i] -= 1
            self._note_load(i, r.headers)
            if r.status_code == 429:
                self.metrics.remote_prefill(model, name, "refused")
                retry = float(r.headers.get("Retry-After", "1") or 1)
                raise rate_limited("The prefill servers are overloaded; retry later.",
                                   retry, code="prefill_busy")
            if r.status_code != 200:
                self._down(i, f"HTTP {r.status_code}: {r.text[:200]}")
                self.metrics.remote_prefill(model, name, "failed")
                continue
            try:
                got, pages = await trio.to_thread.run_sync(lambda: decode(
                    r.content, fingerprint=runner.kv_fingerprint,
                    page_shape=runner.page_shape, dtype=runner.kv_storage))
                if got != first:
                    raise WireError(f"pages from page {got} sent, {first} asked for")
            except WireError as e:
                self._down(i, str(e))
                self.metrics.remote_prefill(model, name, "failed")
                continue
            keys = engine.receive_pages(greq, first, pages)
            total = time.monotonic() - t0
            try:  # the transfer: all but the prefill's own compute
                moved = total - float(r.headers[PREFILL_S])
            except (KeyError, ValueError):
                moved = total
            self.metrics.kv_transfer(model, name, "received", len(r.content), moved)
            self.metrics.remote_prefill(model, name, outcome, total)
            return keys
        self.metrics.remote_prefill(model, name, "local")
        return []

    async def _in_process(self, i: int, engine, greq: GenerateRequest, first: int,
                          outcome: str) -> list[int] | None:
        """The prompt computed by prefill pool `targets[i]` of this server: its pages
        put onto `engine`'s devices and into its pool by its next step (`import_pages`),
        or, when the pool has no room for them now, read out to the host and into its
        inbox; the inbox keys ([] for an import), or None: it failed. Raises an APIError
        when that pool refuses (429)."""
        target = self.targets[i]
        name, model = self.pool.name, self.pool.model_name
        self.in_flight[i] += 1
        t0 = time.monotonic()
        try:
            _, kv = await compute(target, prefill_request(
                greq.prompt_ids, first, tenant=greq.tenant, priority=greq.priority,
                cache_salt=greq.cache_salt))
        except Overloaded as e:
            self.metrics.remote_prefill(model, name, "refused")
            raise rate_limited(f"The prefill pool is overloaded ({e.reason}); retry later.",
                               e.retry_after_s, code="prefill_busy") from None
        except (EngineDead, PrefillFailed, ValueError) as e:
            self._down(i, f"{type(e).__name__}: {e}")
            self.metrics.remote_prefill(model, name, "failed")
            return None
        finally:
            self.in_flight[i] -= 1
        t1 = time.monotonic()
        keys: list[int] = []
        if not engine.import_pages(greq, first, kv):  # device to device, into its pool
            pages = await trio.to_thread.run_sync(kv.to_host)  # no room there: the inbox
            keys = engine.receive_pages(greq, first, pages)
        now = time.monotonic()
        self.metrics.kv_transfer(model, name, "received", kv.nbytes, now - t1)
        self.metrics.remote_prefill(model, name, outcome, now - t0)
        return keys

    def _down(self, i: int, why: str) -> None:
        log.warning("prefill server %s failed (%s): tried last for %.0f s", self.urls[i], why,
                    _DOWN_S)
        self.down_until[i] = time.monotonic() + _DOWN_S

    async def aclose(self) -> None:
        await self._http.aclose()


# -- the prefill server's side ----------------------------------------------------------------
async def serve_prefill(state, body: bytes, authorization: str | None
                        ) -> tuple[bytes, dict[str, str]]:
    """POST /internal/prefill on a server with a `role = "prefill"` pool: compute the
    prompt (a one-token request through its door and queue) and answer its pages, with
    headers saying how long the prefill and the copy out took and how loaded the pool
    is (`load_headers`; a 429 carries those too)."""
    tenant = state.tenants.authenticate(authorization)
    try:
        ask = ask_decoder.decode(body)
    except msgspec.DecodeError as e:
        raise bad_request(f"not a prefill request: {e}") from None
    assert state.router is not None
    pools = [p for p in state.router.pools
             if p.config.role == "prefill" and ask.model in p.config.served_model_names]
    if not pools:
        raise not_found(f"no prefill pool serves {ask.model!r} here", param="model",
                        code="model_not_found")
    pool = pools[0]
    n = len(ask.prompt_ids)
    if not n or n + 1 > pool.max_context or ask.first_page < 0:
        raise bad_request(f"a prompt of {n} tokens cannot be prefilled here (context "
                          f"{pool.max_context})", param="prompt_ids")
    if any(not 0 <= t < pool.vocab_size for t in ask.prompt_ids):
        raise bad_request("prompt_ids must be token ids of the model", param="prompt_ids")
    greq = prefill_request(ask.prompt_ids, ask.first_page, tenant=tenant.name,
                           priority=tenant.priority_for(ask.priority),
                           cache_salt=tenant.cache_salt)
    t0 = time.monotonic()
    try:
        replica, kv = await compute(pool, greq)
    except Overloaded as e:
        err = rate_limited(f"The prefill server is overloaded ({e.reason}).",
                           e.retry_after_s, code=e.reason)
        err.headers.update(load_headers(pool))
        raise err from None
    except EngineDead as e:
        raise unavailable(f"The engine has stopped: {e}", "engine_dead") from None
    except ValueError as e:
        raise bad_request(f"{e}.", param="prompt_ids") from None
    except PrefillFailed as e:
        raise unavailable(f"prefill failed: {e}", "prefill_failed") from None
    t1 = time.monotonic()
    runner = pool.engines[replica].runner
    out = await trio.to_thread.run_sync(lambda: encode(
        kv.to_host(), fingerprint=runner.kv_fingerprint, first_page=ask.first_page))
    copy_s = time.monotonic() - t1
    state.metrics.kv_transfer(pool.model_name, pool.name, "sent", len(out), copy_s)
    return out, {PREFILL_S: f"{t1 - t0:.6f}", COPY_S: f"{copy_s:.6f}", **load_headers(pool)}


def prefill_request(prompt_ids, first_page: int, **kw) -> GenerateRequest:
    """The one-token request that computes a prompt for a decode pool and exports its
    full pages from `first_page` on."""
    return GenerateRequest(prompt_ids=prompt_ids, max_tokens=1,
                           sampling=SamplingParams(temperature=0.0), ignore_eos=True,
                           export_pages_from=first_page, **kw)


class PrefillFailed(RuntimeError):
    """The prefill pool took the prompt and could not compute or export it."""


async def compute(pool, greq: GenerateRequest) -> tuple[int, Any]:
    """Run a `prefill_request` in a prefill pool: (replica, its `ExportedPages`).
    Raises what `Pool.submit` raises, or `PrefillFailed`. Cancelled (the asker gone), it
    aborts the request: its pages go back at once."""
    replica, handle = pool.submit(greq)
    try:
        final = None
        async for event in handle.events:
            if isinstance(event, (FinishEvent, ErrorEvent)):
                final = event
    finally:
        pool.finish(replica, handle.request_id)
    if isinstance(final, ErrorEvent) or final is None:
        raise PrefillFailed(getattr(final, "message", "no result"))
    if final.kv is None:
        raise PrefillFailed("its pages could not be copied out")
    return replica, final.kv


def load_headers(pool) -> dict[str, str]:
    """How loaded a prefill pool is, for the decode servers' choice: requests waiting,
    the oldest one's age, free KV pages (all replicas)."""
    stats = pool.stats()
    return {WAITING: str(sum(s.waiting for s in stats)),
            OLDEST: f"{max((s.oldest_waiting_age_s for s in stats), default=0.0):.3f}",
            FREE_PAGES: str(sum(s.kv_pages_total - s.kv_pages_in_use for s in stats))}


def check_roles(pools) -> None:
    """A prefill or decode pool needs what transfers need, and a decode pool's prefill
    pools in this server the same model and page layout (else a ValueError naming it)."""
    by_name = {p.name: p for p in pools}
    for pool in pools:
        if pool.config.role == "both":
            continue
        for engine in pool.engines:
            runner = engine.runner
            if getattr(runner, "kv_fingerprint", None) is None or not hasattr(
                    runner, "export_pages"):
                raise ValueError(f"pools[{pool.name}].role = {pool.config.role!r}: this "
                                 "runner cannot move KV pages (multi-host replica?)")
        mine = pool.engines[0].runner
        for u in pool.config.prefill_urls:
            other = by_name.get(u[5:]) if u.startswith("pool:") else None
            if other is None:
                continue
            theirs = other.engines[0].runner
            if (theirs.kv_fingerprint, theirs.page_shape) != (mine.kv_fingerprint,
                                                              mine.page_shape):
                raise ValueError(f"pools[{pool.name}].prefill_urls: {u} runs another model "
                                 "or KV layout (weights, quantization, KV dtype, page size "
                                 "must match)")
