"""The HTTP endpoints. Each handler is short: admission, streaming and errors live elsewhere.

/v1/* and the tokenizer endpoints authenticate like completions do (with tenants
configured, a key is needed); /health, /metrics and /openapi.json are open, for load
balancers and scrapers.
"""

from __future__ import annotations

import functools
from typing import TypeVar

import msgspec
from quart import Response, request
from quart_trio import QuartTrio

from . import disagg, kv_wire, responses
from .adapters import check_admin, is_admin, load_adapter, unload_adapter
from .batches.routes import register_batch_routes
from .console import register_console
from .completions import admit, check_phase
from .errors import LOADING_RETRY_S, bad_request, unavailable
from .guardrails import OutputGate
from .metrics import CONTENT_TYPE
from .openapi import openapi_spec
from .pools import Pool
from .prompts import encode_messages, maybe_thread
from .schemas import (DetokenizeRequest, DetokenizeResponse, LoadLoraAdapterRequest,
                      LoraAdapterCard, ModelCard, ModelList, TokenizeRequest, TokenizeResponse,
                      UnloadLoraAdapterRequest, decode_body)
from .state import ServerState
from .stats import parse_query, report
from .streaming import collect, sse_body

T = TypeVar("T")
FLIGHTS_KEY = "sluice.flights"  # the ASGI scope's list of flights to close (server.py)


def json_response(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status=status, content_type="application/json")


def register_routes(app: QuartTrio, state: ServerState, started: int) -> None:
    server = state.settings.server
    register_batch_routes(app, state)
    if server.console:
        register_console(app)

    async def generate(kind: str) -> Response:
        body = await request.get_data(cache=False)
        authorization = request.headers.get("Authorization")
        r = None  # a Responses request: its own output shape over the chat path
        if kind == "responses":
            adm, r, stored = await responses.admit(state, body, authorization)
        else:
            adm = await admit(state, kind, body, authorization)
        request.scope.setdefault(FLIGHTS_KEY, []).append(adm.flight)
        gates = None  # an output gate per choice
        if state.guard.checks_output:
            gates = functools.partial(OutputGate, state.guard, tenant=adm.tenant.name,
                                      model=adm.model)
        if not adm.stream:
            out = await collect(adm, gates)
            return Response(out if r is None else await responses.finish(out, adm, r, stored),
                            content_type="application/json")
        writer = None if r is None else responses.ResponsesWriter(adm, r, stored)
        body_iter = sse_body(adm, gates, server.sse_coalesce, server.sse_flush_interval_s,
                             writer=writer)
        resp = Response(body_iter, content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        resp.timeout = None  # an SSE stream lasts as long as the generation does
        return resp

    @app.post(kv_wire.PATH)
    async def internal_prefill() -> Response:
        check_phase(state)
        body = await request.get_data(cache=False)
        out, headers = await disagg.serve_prefill(state, body,
                                                  request.headers.get("Authorization"))
        return Response(out, content_type=kv_wire.CONTENT_TYPE, headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await generate("chat")

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await generate("completion")

    @app.post("/v1/responses")
    async def create_response() -> Response:
        return await generate("responses")

    @app.get("/v1/responses/<response_id>")
    async def get_response(response_id: str) -> Response:
        tenant = state.tenants.authenticate(request.headers.get("Authorization"))
        row = await responses.own(state, response_id, tenant)
        return Response(row["response"], content_type="application/json")

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> Response:
        tenant = state.tenants.authenticate(request.headers.get("Authorization"))
        await responses.own(state, response_id, tenant)
        await state.batches.store.delete_response(response_id)
        return json_response({"id": response_id, "object": "response.deleted",
                              "deleted": True})

    @app.get("/v1/models")
    async def models() -> Response:
        state.tenants.authenticate(request.headers.get("Authorization"))
        if state.router is None:
            raise unavailable("The model is still loading; retry shortly.", "model_loading",
                          LOADING_RETRY_S)
        cards = [ModelCard(name, started, p.max_context, p.config.model)
                 for p in state.router.pools for name in p.config.served_model_names]
        cards += [ModelCard(a.name, a.created, p.max_context, a.path, parent=p.model_name)
                  for p in state.router.pools for a in p.adapters.by_name.values()]
        return json_response(ModelList(cards))

    async def admin_request(type: type[T]) -> T:
        """An adapter endpoint's body, for the admin key only, once serving."""
        check_admin(server, state.tenants, request.headers.get("Authorization"))
        check_phase(state)
        return decode_body(await request.get_data(cache=False), type)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter() -> Response:
        req = await admin_request(LoadLoraAdapterRequest)
        assert state.router is not None
        pool, a = await load_adapter(state.router, req.lora_name, req.lora_path,
                                     req.base_model)
        return json_response(LoraAdapterCard(a.name, pool.model_name, a.path, a.rank,
                                             list(a.targets)))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter() -> Response:
        req = await admin_request(UnloadLoraAdapterRequest)
        assert state.router is not None
        unload_adapter(state.router, req.lora_name)
        return json_response({"id": req.lora_name, "object": "lora_adapter", "deleted": True})

    @app.get("/health")
    async def health() -> Response:
        return json_response(*state.health())

    @app.get("/v1/stats")
    async def stats() -> Response:
        """The console's live figures. Any valid key sees the pools; a tenant's key sees
        its own tenant and batches, the admin key (or an open server) everyone's."""
        auth = request.headers.get("Authorization")
        tenant = None
        if not is_admin(server, auth):
            t = state.tenants.authenticate(auth)
            tenant = None if state.tenants.open else t.name
        try:
            window, since = parse_query(request.args.get("window_s"),
                                        request.args.get("steps_since"))
        except ValueError as e:
            raise bad_request(str(e), param="window_s" if "window" in str(e)
                              else "steps_since") from None
        audit = request.args.get("audit", "0")
        if audit not in ("0", "1", "true", "false"):
            raise bad_request("audit must be 0, 1, true or false.", param="audit")
        out = report(state, state.metrics.live, window_s=window, steps_since=since,
                     tenant=tenant, audit=audit in ("1", "true"))
        return json_response(out)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), content_type=CONTENT_TYPE)

    async def tokenizer_request(type: type[T]) -> tuple[T, Pool]:
        state.tenants.authenticate(request.headers.get("Authorization"))
        check_phase(state)
        req = decode_body(await request.get_data(cache=False), type)
        assert state.router is not None
        return req, state.router.candidates(req.model)[0]  # type: ignore[attr-defined]

    @app.post("/tokenize")
    async def tokenize() -> Response:
        req, pool = await tokenizer_request(TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("Send exactly one of `prompt` and `messages`.", param="prompt")
        if req.messages is not None:
            size = sum(len(m.text()) for m in req.messages)
            ids = await maybe_thread(size, encode_messages, pool, req.messages)
        else:
            ids = await maybe_thread(len(req.prompt or ""), pool.tokenizer.encode,
                                     req.prompt or "")
        return json_response(TokenizeResponse(list(ids), len(ids), pool.max_context))

    @app.post("/detokenize")
    async def detokenize() -> Response:
        req, pool = await tokenizer_request(DetokenizeRequest)
        bad = [t for t in req.tokens if t >= pool.vocab_size]
        if bad:
            raise bad_request(f"Token ids must be in [0, {pool.vocab_size}); got {bad[:5]}.",
                              param="tokens", code="invalid_token_id")
        text = await maybe_thread(len(req.tokens), pool.tokenizer.decode, req.tokens)
        return json_response(DetokenizeResponse(text))

    @app.get("/openapi.json")
    async def openapi() -> Response:
        names = tuple(n for p in state.settings.pools for n in p.served_model_names)
        if state.router is not None:  # and the adapters loaded now
            names += tuple(a for p in state.router.pools for a in p.adapters.by_name)
        return Response(openapi_spec(names), content_type="application/json")
