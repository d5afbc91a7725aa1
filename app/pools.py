"""Pools (one model, its tokenizer, its engine replicas) and the Router that picks one.

A pool is the unit clients address by model name. Several pools may serve one name with
different prompt-length ranges (a long-context pool with its own, larger KV budget next to
a short-context pool with more decode slots); the Router picks by name, then by where the
prompt's length falls and whether prompt + max_tokens fits the pool's context.

Replica choice is least-in-flight among live engines: the pool counts what it handed to
each engine and has not seen finish, which is cheaper than asking every engine for stats
on every request and good enough, since all replicas of a pool are alike.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence

import trio

from config.settings import PoolConfig
from scheduler.api import EngineDead, EngineStats, GenerateRequest, Overloaded

from .adapters import PoolAdapters, Reader
from .errors import bad_request, not_found
from .grammar import Grammars

log = logging.getLogger("sluice.pools")


class TokenizerLike(Protocol):
    """What app/ needs from `model.tokenizer.Tokenizer` (the engine also calls `incremental`)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...
    def incremental(self, prompt_ids: Sequence[int]) -> Any: ...


class Pool:
    def __init__(
        self,
        config: PoolConfig,
        tokenizer: TokenizerLike,
        engines: list[Any],
        *,
        max_context: int,
        vocab_size: int,
        adapter_reader: Reader | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.engines = engines
        self.max_context = max_context
        self.vocab_size = vocab_size
        self._in_flight = [0] * len(engines)
        self.admitting = 0  # requests past the precheck, being tokenized (app/completions.py)
        self.adapters = PoolAdapters(self, adapter_reader)  # LoRA adapters (app/adapters.py)
        self._grammars: Grammars | None = None
        self.remote = None  # a decode pool's prefill servers (app/disagg.RemotePrefill)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def grammars(self) -> Grammars:
        """Structured output's grammar compiler for this pool's tokenizer (built on first
        use: no pool pays for it unless a request asks)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size)
        return self._grammars

    @property
    def model_name(self) -> str:
        """What responses and metrics call this pool's model."""
        return self.config.served_model_names[0]

    @property
    def alive(self) -> bool:
        """Can it serve? True while one replica is alive: a dead replica's requests fail,
        and the others take the new ones (`submit` skips it)."""
        return any(e.alive for e in self.engines)

    @property
    def deaths(self) -> list[str]:
        """Why each dead replica stopped (empty: all alive)."""
        return [e.death or f"engine {e.name!r} stopped" for e in self.engines if not e.alive]

    @property
    def warmup_remaining(self) -> int:
        """Step shapes the replicas are still compiling in the background (0: all ready)."""
        return sum(getattr(e.runner, "warmup_remaining", 0) for e in self.engines)

    def accepts(self, prompt_tokens: int) -> bool:
        c = self.config
        return c.min_prompt_tokens <= prompt_tokens and (
            c.max_prompt_tokens is None or prompt_tokens <= c.max_prompt_tokens
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every replica's engine loop; started once all of them are."""
        async with trio.open_nursery() as nursery:
            for engine in self.engines:
                await nursery.start(engine.run)
            task_status.started()

    def submit(self, req: GenerateRequest, events: Any = None,
               replica: int | None = None) -> tuple[int, Any]:
        """Hand `req` to the least busy live replica (or to `replica`: a request's other
        choices go where its first went, to share its prompt's pages); returns (replica
        index, handle). `events`: the request's shared event channel (`Engine.submit`).

        A replica whose queue is full refuses at once; the next one gets a try, and only
        when all refuse does the caller see `Overloaded` (or `EngineDead` if none is alive).
        """
        if req.adapter is not None and req.adapter not in self.adapters:
            raise not_found(f"The lora adapter '{req.adapter}' was unloaded.", param="model",
                            code="model_not_found")  # while the request was being admitted
        order = (sorted(range(len(self.engines)), key=self._in_flight.__getitem__)
                 if replica is None else [replica])
        refusal: Overloaded | None = None
        for i in order:
            engine = self.engines[i]
            if not engine.alive:
                continue
            try:
                handle = engine.submit(req, events)
            except EngineDead:
                continue
            except Overloaded as e:
                if refusal is None or e.retry_after_s < refusal.retry_after_s:
                    refusal = e
                continue
            self._in_flight[i] += 1
            return i, handle
        if refusal is not None:
            raise refusal
        raise EngineDead(f"every engine of pool {self.name!r} has stopped")

    def least_busy(self) -> int:
        """The live replica with the fewest requests in flight, then the most free KV
        pages (where a decode pool's prefilled prompt goes)."""
        live = [i for i, e in enumerate(self.engines) if e.alive] or [0]
        return min(live, key=lambda i: (self._in_flight[i],
                                        -getattr(self.engines[i], "free_pages", 0)))

    def precheck(self, max_tokens: int | None = None) -> None:
        """Raise `Overloaded` (the soonest Retry-After) when every live replica would refuse
        even a one-token request now, counting those already past this check and still
        being tokenized (`admitting`, spread over the replicas); `EngineDead` when none is
        alive."""
        refusal: Overloaded | None = None
        pending = -(-self.admitting // max(1, len(self.engines)))
        for engine in self.engines:
            try:
                engine.precheck(pending, max_tokens)
                return
            except EngineDead:
                continue
            except Overloaded as e:
                if refusal is None or e.retry_after_s < refusal.retry_after_s:
                    refusal = e
        if refusal is not None:
            raise refusal
        raise EngineDead(f"every engine of pool {self.name!r} has stopped")

    def finish(self, replica: int, request_id: str) -> None:
        """The request is over for the client (done, failed or abandoned): sync, idempotent
        per request in the engine, called exactly once per submit by the stream's cleanup."""
        self._in_flight[replica] -= 1
        self.engines[replica].abort(request_id)

    def stats(self, audit: bool = False) -> list[EngineStats]:
        return [e.stats(audit) for e in self.engines]

    def close(self) -> None:
        """Stop the replicas' background compiles (each ends after its current shape);
        with a disk tier, first write the cached prefixes there (docs/operations.md,
        "KV tiers")."""
        for engine in self.engines:
            try:
                if (n := engine.persist_prefixes()):
                    log.info("%s: %d cached KV pages written to the disk tier", self.name, n)
            except Exception:  # noqa: BLE001 - a cache: the next start recomputes
                log.exception("%s: could not write the cached KV pages to disk", self.name)
            if close := getattr(engine.runner, "close", None):
                close()

    def start_draining(self) -> None:
        for e in self.engines:
            e.start_draining()


class Router:
    def __init__(self, pools: list[Pool]) -> None:
        self.pools = pools
        self.by_name: dict[str, list[Pool]] = {}
        for pool in pools:
            for name in pool.config.served_model_names:
                self.by_name.setdefault(name, []).append(pool)

    @property
    def alive(self) -> bool:
        """Every pool can serve (has a live replica)."""
        return all(p.alive for p in self.pools)

    def is_adapter(self, model: str | None) -> bool:
        """Does `model` name a LoRA adapter (rather than a pool's base model)?"""
        return model is not None and model not in self.by_name and any(
            model in p.adapters for p in self.pools)

    def candidates(self, model: str | None) -> list[Pool]:
        """Pools serving `model`, a base model or an adapter (None: the first pool's
        model), or 404."""
        if model is None:
            model = self.pools[0].model_name
        found = self.by_name.get(model) or [p for p in self.pools if model in p.adapters]
        # A prefill pool computes prompts for the decode pools beside it, not for clients.
        found = [p for p in found if p.config.role != "prefill"] or found
        if not found:
            adapters = [a for p in self.pools for a in p.adapters.by_name]
            raise not_found(
                f"The model `{model}` does not exist. Available: "
                + ", ".join(sorted(self.by_name) + sorted(adapters)) + ".",
                param="model",
                code="model_not_found",
            )
        return found

    def choose(self, pools: list[Pool], prompt_tokens: int, max_tokens: int | None) -> Pool:
        """The first pool whose prompt range holds the prompt and whose context fits the
        request; failing that, any pool of the model whose context fits it."""
        in_range = [p for p in pools if p.accepts(prompt_tokens)]
        for pool in in_range + [p for p in pools if p not in in_range]:
            if prompt_tokens + (max_tokens or 1) <= pool.max_context:
                return pool
        limit = max(p.max_context for p in pools)
        if max_tokens is None:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt has {prompt_tokens} tokens, leaving no room for the completion. "
                "Please shorten the prompt.",
                param="messages",
                code="context_length_exceeded",
            )
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{max_tokens} in the completion). Please reduce the length of the prompt or "
            "of max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
