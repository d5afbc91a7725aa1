"""Admission: from an HTTP body to a `Flight` in an engine, or a clear refusal.

The order is cheapest refusal first, and nothing that waits comes before a bound:
phase (503) -> API key (401) -> body (400) -> model (404) -> tokenize -> context (400) ->
stream bound and tenant quota (429) -> input guardrail (bounded by its budget) ->
`pool.submit` (429 at once when the engine's queue is full).

(About 390 lines: the admission order above is one function's sequence, kept in one
place so a cheaper refusal can never move behind a costlier check.)
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import trio

from scheduler.api import EngineDead, GenerateRequest, Overloaded
from scheduler.protocol import SamplingParams

from . import reasoning, tools
from .adapters import check_tenant
from .errors import (DRAINING_RETRY_S, LOADING_RETRY_S, APIError, bad_request, rate_limited,
                     unavailable)
from .pools import Pool
from .prompts import chat_checks, completion_checks, tokenize
from .request_log import request_log
from .schemas import ChatCompletionRequest, CompletionRequest, decode_body
from .state import Choices, Flight, Phase, ServerState
from .structured import constraint_for, grammar_of, logit_bias_of
from .tenants import Tenant

# A batch job's request waits in an engine's queue for idle capacity, however long: its
# batch's window, not the queue deadline, bounds it (app/batches/worker.py).
BATCH_QUEUE_DEADLINE_S = 1e9
CHOICE_EVENT_BUFFER = 16  # events buffered per choice of an n > 1 request


@dataclass
class Admitted:
    """An admitted request and what the response needs to describe it."""

    flight: Flight
    kind: str  # "chat" | "completion"
    id: str
    created: int
    model: str
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage so far in every chunk (vLLM's continuous_usage_stats)
    logprobs: int | None  # None: off; else how many alternatives per token
    tenant: Tenant
    arrival: float  # trio.current_time() when the body arrived
    echo: str = ""  # completions' `echo`: the prompt's text, sent before the answer
    n: int = 1  # choices
    sequences: int = 1  # generated: n, or completions' `best_of` (the best n returned)
    # With `echo` and `logprobs`: the prompt's ids, whose logprobs come first.
    prompt_ids: Sequence[int] = ()
    score_only: bool = False  # completions' `max_tokens: 0` with `echo`: no answer
    tools: bool = False  # chat with tools in play: calls are read from the answer (tools.py)
    thinks: bool = False  # a thinking model's chat: its reasoning apart (reasoning.py)
    thinks_inside: bool = False  # ... the prompt opened the tag: the answer starts inside


def check_phase(state: ServerState) -> None:
    if state.phase is Phase.LOADING:
        raise unavailable("The model is still loading; retry shortly.", "model_loading",
                          LOADING_RETRY_S)
    if state.phase is Phase.DRAINING:
        raise unavailable("The server is shutting down.", "draining", DRAINING_RETRY_S)
    assert state.router is not None


async def admit(state: ServerState, kind: str, body: bytes, authorization: str | None) -> Admitted:
    arrival = trio.current_time()
    check_phase(state)
    tenant = state.tenants.authenticate(authorization)
    return await admit_parsed(state, kind, parse(kind, body), tenant, arrival,
                              authorization=authorization)


def parse(kind: str, body: bytes) -> Parsed:
    """Decode and check a completion body (400 naming the parameter)."""
    if kind == "chat":
        req = decode_body(body, ChatCompletionRequest)
        max_tokens = chat_checks(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        req = decode_body(body, CompletionRequest)
        max_tokens = completion_checks(req)
        logprobs = req.logprobs
    if req.stream_options is not None and not req.stream:
        raise bad_request("`stream_options` is only allowed when `stream` is true.",
                          param="stream_options")
    if req.store:
        raise bad_request("This server does not store completions; `store` must be false.",
                          param="store", code="unsupported_value")
    return Parsed(req, max_tokens, logprobs, grammar_of(req))


@dataclass
class Parsed:
    req: ChatCompletionRequest | CompletionRequest
    max_tokens: int | None
    logprobs: int | None
    grammar: tuple[str, str] | None = None  # structured output: (grammar, parameter)


@dataclass
class BatchRun:
    """How a batch job's request runs (app/batches/worker.py): in the background class,
    or raised into the interactive one at `priority` when its deadline is at risk."""

    background: bool = True
    priority: int | None = None


class _NoLease:
    """Batch requests are bounded by the batch quota, not the tenant's interactive one."""

    def release(self, used_tokens: int = 0) -> None:
        pass


async def resolve(state: ServerState, kind: str, p: Parsed, tenant: Tenant
                  ) -> tuple[Pool, list[int], str, int, str | None]:
    """Model (or adapter), tokens and pool of a parsed request: (pool, prompt ids, prompt
    text, max_tokens, adapter). 404/403/400 as for any request."""
    router = state.router
    assert router is not None
    req = p.req
    candidates = router.candidates(req.model)
    adapter = req.model if router.is_adapter(req.model) else None
    if adapter is not None:
        check_tenant(tenant, adapter)
    prompt_ids, text = await tokenize(candidates[0], req)
    pool = router.choose(candidates, len(prompt_ids), p.max_tokens)
    max_tokens = p.max_tokens
    if max_tokens is None:
        max_tokens = pool.max_context - len(prompt_ids)
        if pool.config.default_max_tokens is not None:
            max_tokens = min(max_tokens, pool.config.default_max_tokens)
    return pool, prompt_ids, text, max_tokens, adapter


async def admit_parsed(state: ServerState, kind: str, p: Parsed, tenant: Tenant,
                       arrival: float, *, batch: BatchRun | None = None,
                       authorization: str | None = None) -> Admitted:
    """From a parsed request to a `Flight` in an engine. A batch job's request skips the
    stream bound and the tenant's interactive quota (the batch quota bounds it) and is
    not one of the server's flights (a drain does not wait for it: it runs again after
    a restart). A decode pool's prompt is computed by a prefill server first
    (app/disagg.py; `authorization` goes with it)."""
    req = p.req
    n = req.n or 1
    sequences = getattr(req, "best_of", None) or n
    echo = isinstance(req, CompletionRequest) and bool(req.echo)
    candidates: list[Pool] = []
    if batch is None:  # a refusal needs no tokenizing or template rendering
        candidates = state.router.candidates(req.model)  # type: ignore[union-attr]
        precheck_pools(candidates, p.max_tokens)
    with _tokenizing(candidates):
        pool, prompt_ids, text, max_tokens, adapter = await resolve(state, kind, p, tenant)
        # best_of ranks its sequences by their tokens' logprobs: computed, shown only if asked.
        sampling = _sampling(req, pool, p.logprobs, rank=sequences > n)
        constraints = [await constraint_for(pool, p.grammar) for _ in range(sequences)]
    # `max_tokens: 0` with `echo` scores the prompt: one token is generated (the prompt's
    # last position is computed anyway) and dropped from the answer (app/streaming.py).
    # (Only then: a prompt that leaves no context for an answer is refused as before.)
    score_only = echo and max_tokens == 0
    if score_only:
        max_tokens = 1

    if batch is None:
        if len(state.flights) >= state.settings.server.max_streams:
            state.metrics.reject(pool.model_name, pool.name, "max_streams")
            raise rate_limited(
                f"The server is at its limit of {state.settings.server.max_streams} "
                "requests in flight.", 1.0, code="server_busy")
        try:
            lease = state.tenants.admit(tenant, len(prompt_ids) + sequences * max_tokens)
        except APIError as e:
            state.metrics.reject(pool.model_name, pool.name, e.detail.code or "tenant")
            raise
    else:
        lease = _NoLease()
    flight = Flight(state, pool, lease, len(prompt_ids))  # type: ignore[arg-type]
    if batch is None:
        state.add_flight(flight)
    try:
        await state.guard.check_input(text=text, tenant=tenant.name, model=pool.model_name)
        request_id = uuid.uuid4().hex
        priority = tenant.priority_for(req.priority)
        if batch is not None and batch.priority is not None:
            priority = max(priority, batch.priority)
        greqs = [GenerateRequest(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            # Seeded choices are distinct and reproducible: choice i draws from seed + i.
            sampling=sampling if sampling.seed is None or not i else dataclasses.replace(
                sampling, seed=sampling.seed + i),
            stop=_stops(req.stop),
            stop_token_ids=_stop_token_ids(req.stop_token_ids, pool),
            ignore_eos=req.ignore_eos,
            tenant=tenant.name,
            priority=priority,
            weight=tenant.config.weight,
            tenant_max_running=tenant.config.max_running,
            # Pages computed under an adapter serve only that load of it (the scheduler
            # adds the adapter's name; the generation tells two loads of one name apart).
            cache_salt=tenant.cache_salt if adapter is None else
            f"{tenant.cache_salt}\x00{_generation(pool, adapter)}",
            adapter=adapter,
            deadline_s=BATCH_QUEUE_DEADLINE_S if batch else tenant.config.queue_deadline_s,
            request_id=request_id if sequences == 1 else f"{request_id}-{i}",
            batch=batch is not None and batch.background,
            constraint=constraints[i],
            index=i,
            prompt_logprobs=p.logprobs if echo and p.logprobs is not None else None,
        ) for i in range(sequences)]
        replica = None
        if pool.remote is not None:
            replica = await _prefill_remotely(pool, greqs[0], flight, authorization)
        flight.submitted(*_submit_all(pool, greqs, replica))
        if flight.closed:
            raise unavailable("The server is shutting down.", "draining", DRAINING_RETRY_S)
    except BaseException:
        flight.close()
        raise
    thinks = kind == "chat" and reasoning.enabled(pool.tokenizer)
    adm = Admitted(
        flight=flight,
        kind=kind,
        id=("chatcmpl-" if kind == "chat" else "cmpl-") + request_id,
        created=int(time.time()),
        model=adapter or pool.model_name,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=bool(req.stream_options
                              and req.stream_options.continuous_usage_stats),
        logprobs=p.logprobs,
        tenant=tenant,
        arrival=arrival,
        echo=text if echo else "",
        n=n,
        sequences=sequences,
        prompt_ids=prompt_ids if echo and p.logprobs is not None else (),
        score_only=score_only,
        tools=isinstance(req, ChatCompletionRequest) and tools.active(req),
        thinks=thinks,
        thinks_inside=thinks and reasoning.opened(pool.tokenizer, prompt_ids),
    )
    flight.log = request_log(state.settings.server.log_requests, adm, text)
    return adm


def _stop_token_ids(ids: list[int] | None, pool: Pool) -> tuple[int, ...]:
    bad = [t for t in ids or () if t >= pool.vocab_size]
    if bad:
        raise bad_request(f"stop_token_ids must be token ids in [0, {pool.vocab_size}); got "
                          f"{bad[:5]}.", param="stop_token_ids", code="invalid_token_id")
    return tuple(ids or ())


@contextmanager
def _tokenizing(pools: list[Pool]) -> Iterator[None]:
    """While a request past the precheck is being tokenized, the next requests' precheck
    counts it as ahead; once tokenized (or failed), the engine's own queue counts it."""
    for p in pools:
        p.admitting += 1
    try:
        yield
    finally:
        for p in pools:
            p.admitting -= 1


def precheck_pools(pools: list[Pool], max_tokens: int | None) -> None:
    """429 at once when every pool that could serve the model would refuse any request
    asking for `max_tokens` (the body's; None: not given)."""
    refusal: Overloaded | None = None
    dead: list[str] = []
    for pool in pools:
        try:
            return pool.precheck(max_tokens)
        except EngineDead as e:
            dead.append(str(e))  # another pool may serve it
        except Overloaded as e:
            refusal = e if refusal is None or e.retry_after_s < refusal.retry_after_s else refusal
    if refusal is not None:
        raise _refused(refusal)
    if dead:  # every pool of the model is dead: 503 before tokenizing anything
        raise unavailable(f"The engine has stopped: {'; '.join(dead)}", "engine_dead")


def _refused(e: Overloaded) -> APIError:
    if e.reason == "draining":
        return unavailable("The server is shutting down.", "draining", DRAINING_RETRY_S)
    return rate_limited(f"The server is overloaded ({e.reason}); retry later.",
                        e.retry_after_s, code=e.reason)


async def _prefill_remotely(pool: Pool, greq: GenerateRequest, flight: Flight,
                            authorization: str | None) -> int | None:
    """A decode pool's prompt to a prefill server (app/disagg.py): the replica whose
    inbox holds its pages (submit there), or None when it is computed here. A prompt
    whose prefix another prompt's prefill is bringing waits for it and goes where it
    went."""
    followed = await pool.remote.follow(greq)
    replica = pool.least_busy() if followed is None else followed
    engine = pool.engines[replica]
    first = pool.remote.first_page(engine, greq)
    if first is None:
        return followed  # computed here (where the pages it waited for are, if any)
    try:
        reserved = engine.reserve_room(greq)
    except Overloaded as e:
        raise _refused(e) from None
    except (EngineDead, ValueError):
        return None  # submit says why
    try:
        keys = await pool.remote.prefill(engine, greq, first, authorization)
    finally:
        engine.release_room(reserved)
    if keys:
        flight.cleanup.append(lambda: engine.discard_pages(keys))
    return replica


def _submit_all(pool: Pool, greqs: list[GenerateRequest],
                replica: int | None = None) -> tuple[int, object]:
    """Submit a request's choices: one, or `n` to one replica sharing an event stream (the
    scheduler admits the others once the first has computed the prompt, whose pages they
    then share). All or none: a refusal of any takes back the others. `replica`: the
    one to submit to (None: the least busy)."""
    if len(greqs) == 1:
        return _submit(pool, greqs[0], replica=replica)
    send, recv = trio.open_memory_channel(CHOICE_EVENT_BUFFER * len(greqs))
    with send:  # each choice holds a clone; the stream ends after the last one's end
        replica, first = _submit(pool, greqs[0], send, replica)
        ids = [first.request_id]
        try:
            for greq in greqs[1:]:
                ids.append(_submit(pool, greq, send, replica)[1].request_id)
        except BaseException:
            for request_id in ids:
                pool.finish(replica, request_id)
            raise
    return replica, Choices(ids, recv)


def _submit(pool: Pool, greq: GenerateRequest, events=None,
            replica: int | None = None) -> tuple[int, object]:
    try:
        return pool.submit(greq, events, replica)
    except Overloaded as e:
        raise _refused(e) from None
    except EngineDead as e:
        raise unavailable(f"The engine has stopped: {e}", "engine_dead") from None
    except ValueError as e:  # the engine can never serve it (e.g. bigger than its KV cache)
        raise bad_request(f"{e}.", param="max_tokens", code="context_length_exceeded") from None


def _sampling(req: ChatCompletionRequest | CompletionRequest, pool: Pool,
              logprobs: int | None, rank: bool = False) -> SamplingParams:
    top_k = req.top_k or 0
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if top_k < 0 or top_k >= pool.vocab_size else top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logprobs=logprobs is not None or rank,
        top_logprobs=logprobs or 0,
        logit_bias=logit_bias_of(req, pool.vocab_size),
    )


def _stops(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _generation(pool: Pool, adapter: str) -> int:
    """This load of the adapter (0 if it was unloaded meanwhile: `pool.submit` says 404)."""
    info = pool.adapters.by_name.get(adapter)
    return 0 if info is None else info.generation
