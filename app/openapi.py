"""GET /openapi.json: the API described from the same msgspec Structs that decode it.

Generating the schemas from the types keeps the description and the validation from
drifting apart, and lets a fuzzer (schemathesis) aim at exactly what the server claims
to accept.
"""

from __future__ import annotations

import functools

import msgspec

from .errors import ErrorBody
from .responses import ResponsesRequest
from .schemas import (ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Completion,
                      CompletionRequest, DetokenizeRequest, DetokenizeResponse, Health,
                      LoadLoraAdapterRequest, LoraAdapterCard, ModelList, TokenizeRequest,
                      TokenizeResponse, UnloadLoraAdapterRequest)
from .stats import KEEP_S, STEPS_SINCE
from .stats_schema import Stats

_TYPES = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest,
          ChatCompletion, ChatCompletionChunk, Completion, ModelList, TokenizeResponse,
          DetokenizeResponse, Health, ErrorBody, LoadLoraAdapterRequest, LoraAdapterCard,
          UnloadLoraAdapterRequest, Stats, ResponsesRequest)
_REF = "#/components/schemas/{name}"
_RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}


def _ref(t: type) -> dict:
    return {"$ref": _REF.format(name=t.__name__)}


def _json(t: type) -> dict:
    return {"application/json": {"schema": _ref(t)}}


def _errors(*codes: int) -> dict:
    return {str(c): {"description": "OpenAI-shaped error", "content": _json(ErrorBody)}
            for c in codes}


def _sse(chunk: type) -> dict:
    """One server-sent event: `data` is a JSON chunk, an error object, or "[DONE]"."""
    return {"schema": {
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string",
                                "description": f"JSON {chunk.__name__}, an error, or [DONE]"},
                       "event": {"type": "string"}}}}


def _generate(summary: str, req: type, resp: type, chunk: type) -> dict:
    return {"post": {
        "summary": summary,
        "security": [{"bearer": []}, {}],
        "requestBody": {"required": True, "content": _json(req)},
        "responses": {
            "200": {"description": "A completion, or with `stream` an SSE stream of chunks "
                                   "ending with `data: [DONE]`",
                    "content": {**_json(resp), "text/event-stream": _sse(chunk)}},
            **_errors(400, 401, 404, 413, 429, 503),
        },
    }}


@functools.cache
def openapi_spec(model_names: tuple[str, ...] = ()) -> bytes:
    """The spec; `model_names` (the served names) narrow every `model` field to them."""
    _, components = msgspec.json.schema_components(_TYPES, ref_template=_REF)
    # A Responses message item may leave its `type` out (app/responses.py `_decode`).
    message = components["InputMessage"]
    message["required"] = [f for f in message.get("required", []) if f != "type"]
    items = components["ResponsesRequest"]["properties"]["input"]["anyOf"][1]["items"]
    items.pop("discriminator", None)
    if model_names:
        names = {"type": "string", "enum": list(model_names)}
        for req in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest"):
            components[req]["properties"]["model"] = names
        for req in ("TokenizeRequest", "DetokenizeRequest"):
            components[req]["properties"]["model"] = {"anyOf": [names, {"type": "null"}],
                                                      "default": None}
    paths = {
        "/v1/chat/completions": _generate("Chat completion", ChatCompletionRequest,
                                          ChatCompletion, ChatCompletionChunk),
        "/v1/completions": _generate("Text completion", CompletionRequest, Completion,
                                     Completion),
        "/v1/responses": {"post": {
            "summary": "A response (OpenAI's Responses API), over the chat path",
            "security": [{"bearer": []}, {}],
            "requestBody": {"required": True, "content": _json(ResponsesRequest)},
            "responses": {
                "200": {"description": "A `response` object, or with `stream` an SSE stream "
                                       "of Responses events (`response.created` ... "
                                       "`response.completed`)",
                        "content": {"application/json": {"schema": {"type": "object"}},
                                    "text/event-stream": {"schema": {
                                        "type": "object", "required": ["data"],
                                        "properties": {"event": {"type": "string"},
                                                       "data": {"type": "string"}}}}}},
                **_errors(400, 401, 404, 413, 429, 503),
            },
        }},
        "/v1/responses/{response_id}": {
            "get": {"summary": "A stored response (the tenant's own)",
                    "security": [{"bearer": []}, {}], "parameters": [_RESPONSE_ID],
                    "responses": {"200": {"description": "The `response` object",
                                          "content": {"application/json": {
                                              "schema": {"type": "object"}}}},
                                  **_errors(401, 404)}},
            "delete": {"summary": "Remove a stored response (the tenant's own)",
                       "security": [{"bearer": []}, {}], "parameters": [_RESPONSE_ID],
                       "responses": {"200": {"description": "Deleted",
                                             "content": {"application/json": {
                                                 "schema": {"type": "object"}}}},
                                     **_errors(401, 404)}},
        },
        "/v1/models": {"get": {"summary": "Served models", "responses": {
            "200": {"description": "Models", "content": _json(ModelList)},
            **_errors(401, 503)}}},
        "/v1/stats": {"get": {
            "summary": "Live figures per pool and replica (what the /dashboard page draws)",
            "description": "Rates and percentiles over the last `window_s` seconds (or "
                           "since start): TTFT and inter-token latency as clients saw them, "
                           "output tokens/s, refusals/s by reason, KV pages, prefix-cache "
                           "hit rate, busy and useful-busy fractions, the steps each replica "
                           "ran since `steps_since`, tenants' tokens/min against quota and "
                           "batch jobs' progress. A tenant's key sees only its own tenant "
                           "and batches; the admin key, or a server without tenants, all.",
            "security": [{"bearer": []}, {}],
            "parameters": [
                {"name": "window_s", "in": "query", "required": False,
                 "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": KEEP_S,
                            "default": 60}},
                {"name": "steps_since", "in": "query", "required": False,
                 "description": "Comma-separated `pool/replica:index`: return only steps "
                                "after that index for that replica (the last one seen).",
                 "schema": {"type": "string", "pattern": STEPS_SINCE}},
                {"name": "audit", "in": "query", "required": False,
                 "description": "1: audit each pool's KV page books against the live page "
                                "tables (`kv_pages.audit_problems`; O(pages) per replica).",
                 "schema": {"type": "string", "enum": ["0", "1", "true", "false"]}}],
            "responses": {"200": {"description": "Live figures", "content": _json(Stats)},
                          **_errors(400, 401)}}},
        "/tokenize": {"post": {
            "summary": "Prompt (or chat messages, templated) to token ids",
            "requestBody": {"required": True, "content": _json(TokenizeRequest)},
            "responses": {"200": {"description": "Token ids", "content": _json(TokenizeResponse)},
                          **_errors(400, 401, 404, 413, 503)}}},
        "/detokenize": {"post": {
            "summary": "Token ids to text",
            "requestBody": {"required": True, "content": _json(DetokenizeRequest)},
            "responses": {"200": {"description": "Text", "content": _json(DetokenizeResponse)},
                          **_errors(400, 401, 404, 413, 503)}}},
        "/v1/load_lora_adapter": {"post": {
            "summary": "Load a LoRA adapter (PEFT directory) at run time; admin key only",
            "security": [{"bearer": []}],
            "requestBody": {"required": True, "content": _json(LoadLoraAdapterRequest)},
            "responses": {"200": {"description": "Loaded", "content": _json(LoraAdapterCard)},
                          **_errors(400, 401, 403, 413, 503)}}},
        "/v1/unload_lora_adapter": {"post": {
            "summary": "Unload a LoRA adapter (running requests finish); admin key only",
            "security": [{"bearer": []}],
            "requestBody": {"required": True, "content": _json(UnloadLoraAdapterRequest)},
            "responses": {"200": {"description": "Unloaded", "content": {
                "application/json": {"schema": {"type": "object"}}}},
                          **_errors(400, 401, 403, 404, 413, 503)}}},
        "/health": {"get": {"summary": "200 when serving; 503 loading, draining or dead",
                            "responses": {"200": {"description": "Serving",
                                                  "content": _json(Health)},
                                          "503": {"description": "Not serving",
                                                  "content": _json(Health)}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
            "200": {"description": "Prometheus text format",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {
            "200": {"description": "OpenAPI 3.1", "content": {"application/json": {}}}}}},
    }
    spec = {
        "openapi": "3.1.0",
        "info": {"title": "Sluice", "version": "0.1.0",
                 "description": "OpenAI-compatible streaming LLM inference server."},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
    return msgspec.json.encode(spec)
