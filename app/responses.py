"""OpenAI's Responses API (`POST /v1/responses`) over the chat path.

A Responses request is a chat request in another shape: `instructions` is the system
message, `input` a string (one user message) or message items, `max_output_tokens` the
answer's bound, `text.format` structured output. `parse` turns the body into the chat
request the rest of admission takes (`completions.admit_parsed`: tenant, pool, context,
quotas, the door), so a response is admitted, scheduled, cancelled on disconnect and
metered exactly as a chat completion is. What differs is the output's shape:

- without `stream`: one `response` object (`output[0]` the assistant message, its
  `output_text`; `status` "incomplete" with `incomplete_details.reason`
  "max_output_tokens" when the bound cut it; `usage` as input/output tokens);
- with `stream`: the Responses event sequence (`ResponsesWriter`): `response.created`,
  `response.in_progress`, `response.output_item.added`, `response.content_part.added`,
  `response.output_text.delta` per write, then `.output_text.done`,
  `.content_part.done`, `.output_item.done` and `response.completed` (or
  `response.incomplete`) carrying the whole response; an error mid-stream is an `error`
  event. The deltas concatenate to the non-streamed text.

Kept responses: with the batch store on (`[batches]`, the default), a response is kept,
with the conversation it ends, for `response_retention_s` (30 days), unless the request
says `store: false`; `previous_response_id` continues such a conversation (the tenant's
own: another tenant's is a 404, as if absent), `GET` / `DELETE /v1/responses/{id}` read
and remove one. Function tools are chat's (app/tools.py): a call is a `function_call`
output item, its result comes back as a `function_call_output` input item. docs/api.md
lists every parameter's status.

(About 460 lines: the Responses wire types, the conversion to chat, the stored
conversation and the event writer are one API's shape, read together.)
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

import msgspec
import trio
from msgspec import Meta

from .completions import Admitted, Parsed, admit_parsed, check_phase
from .errors import not_found
from .prompts import chat_checks
from .schemas import (ChatCompletionRequest, ChatMessage, FunctionDef, FunctionName,
                      JsonObjectFormat, JsonSchemaFormat, JsonSchemaSpec, NamedToolChoice,
                      PromptTokensDetails, TextFormat, Tool, ToolCall, ToolChoiceFunction,
                      Usage, decode_body)
from .streaming import sse_data
from .structured import grammar_of
from .tenants import Tenant

_decode_chat = msgspec.json.Decoder().decode


# ------------------------------------------------------------------------------ request
class InputText(msgspec.Struct, tag="input_text", tag_field="type", forbid_unknown_fields=True):
    text: str


class OutputText(msgspec.Struct, tag="output_text", tag_field="type",
                 forbid_unknown_fields=True, kw_only=True):
    """An earlier answer's text, sent back as input (an assistant message item)."""

    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(msgspec.Struct, tag="message", tag_field="type",
                   forbid_unknown_fields=True, kw_only=True):
    """A message item of `input` (image, file and audio parts are refused: text models).
    Its `type` may be left out (`_decode` adds it)."""

    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | OutputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type",
                       forbid_unknown_fields=True, kw_only=True):
    """A call an earlier response made, sent back with the conversation."""

    call_id: Annotated[str, Meta(max_length=256)]
    name: FunctionName
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(msgspec.Struct, tag="function_call_output", tag_field="type",
                         forbid_unknown_fields=True, kw_only=True):
    """A tool's result for a call (`call_id`)."""

    call_id: Annotated[str, Meta(max_length=256)]
    output: str
    id: str | None = None
    status: str | None = None


class FunctionTool(msgspec.Struct, tag="function", tag_field="type",
                   forbid_unknown_fields=True, kw_only=True):
    name: FunctionName
    description: Annotated[str, Meta(max_length=4096)] | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(msgspec.Struct, tag="function", tag_field="type",
                    forbid_unknown_fields=True):
    name: FunctionName


class TextFormatJsonSchema(msgspec.Struct, tag="json_schema", tag_field="type",
                           forbid_unknown_fields=True, kw_only=True):
    """Chat's `json_schema` format with its `json_schema` object's fields flattened."""

    name: Annotated[str, Meta(max_length=64)] = "response"
    schema: dict | bool | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: TextFormat | JsonObjectFormat | TextFormatJsonSchema | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, no effect


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    input: str | Annotated[list[InputMessage | FunctionCallItem | FunctionCallOutput],
                           Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    text: TextConfig | None = None
    user: Annotated[str, Meta(max_length=256)] | None = None
    metadata: Annotated[dict[str, Annotated[str, Meta(max_length=512)]],
                        Meta(max_length=16)] | None = None
    store: bool | None = None  # kept unless false (where the server has the store)
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None  # (bounded by the body size)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = None  # (a prompt past the context: a 400)


def turns(r: ResponsesRequest) -> list[dict]:
    """The request's input as chat turns (dicts of `ChatMessage`'s fields): messages, an
    earlier response's calls (assistant turns) and the tools' results (tool turns)."""
    if isinstance(r.input, str):
        return [{"role": "user", "content": r.input}]
    out: list[dict] = []
    for item in r.input:
        if isinstance(item, FunctionCallItem):
            out.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}]})
        elif isinstance(item, FunctionCallOutput):
            out.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
        else:
            out.append({"role": item.role, "content": item.text()})
    return out


def _decode(body: bytes) -> ResponsesRequest:
    """The body, message items without `type` taken as messages (as OpenAI takes them)."""
    try:
        raw = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return decode_body(body, ResponsesRequest)  # (its error)
    if isinstance(raw, dict) and isinstance(raw.get("input"), list):
        for item in raw["input"]:
            if isinstance(item, dict) and "type" not in item:
                item["type"] = "message"
        body = msgspec.json.encode(raw)
    return decode_body(body, ResponsesRequest)


def _tools(r: ResponsesRequest) -> tuple[list[Tool] | None, object]:
    """The request's function tools and choice, in the chat request's terms."""
    chat_tools = [Tool(FunctionDef(name=t.name, description=t.description,
                                   parameters=t.parameters, strict=t.strict))
                  for t in r.tools] if r.tools else None
    choice = r.tool_choice
    if isinstance(choice, NamedFunction):
        choice = NamedToolChoice(ToolChoiceFunction(choice.name))
    return chat_tools, choice


def parse(body: bytes, previous: list[dict] | None = None
          ) -> tuple[Parsed, ResponsesRequest]:
    """A Responses body as the chat request admission takes (400 naming the parameter):
    `instructions` first, then the `previous` turns (a stored response's conversation,
    when `previous_response_id` names one), then the input. (Without `previous`, a
    `previous_response_id` is left to `admit`, which looks it up.)"""
    r = _decode(body)
    messages = [ChatMessage("system", r.instructions)] if r.instructions else []
    messages += [msgspec.convert(m, ChatMessage) for m in [*(previous or ()), *turns(r)]]
    fmt = r.text.format if r.text is not None else None
    response_format = None
    if isinstance(fmt, JsonObjectFormat):
        response_format = fmt
    elif isinstance(fmt, TextFormatJsonSchema):
        response_format = JsonSchemaFormat(JsonSchemaSpec(
            name=fmt.name, schema=fmt.schema, strict=fmt.strict, description=fmt.description))
    chat_tools, choice = _tools(r)
    chat = ChatCompletionRequest(
        model=r.model, messages=messages, max_completion_tokens=r.max_output_tokens,
        temperature=r.temperature, top_p=r.top_p, stream=r.stream, user=r.user,
        metadata=r.metadata, response_format=response_format, tools=chat_tools,
        tool_choice=choice, parallel_tool_calls=r.parallel_tool_calls)
    return Parsed(chat, chat_checks(chat), None, grammar_of(chat)), r


class Stored:
    """Where responses are kept (the batch store's SQLite, app/batches/store.py) for one
    request: its tenant's, with the conversation before it."""

    def __init__(self, state, tenant: Tenant, previous: list[dict]) -> None:
        self.state, self.tenant, self.previous = state, tenant, previous

    def keeps(self, r: ResponsesRequest) -> bool:
        """Whether the response will be kept: asked (`store` not false) and a store here."""
        return r.store is not False and self.state.batches is not None

    async def save(self, r: ResponsesRequest, obj: dict) -> None:
        """Keep `obj` (the ended response) and the conversation it ends, if `keeps`."""
        if not self.keeps(r):
            return
        batches = self.state.batches
        text = "".join(c.get("text", "") for item in obj["output"]
                       for c in item.get("content", ()))
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in obj["output"] if i["type"] == "function_call"]
        answer = {"role": "assistant", "content": text or None}
        if calls:
            answer["tool_calls"] = calls
        conversation = [*self.previous, *turns(r), answer]
        await batches.store.add_response(
            obj["id"], self.tenant.name, json.dumps(conversation).encode(),
            msgspec.json.encode(obj), self.state.settings.batches.response_retention_s)


async def own(state, response_id: str, tenant: Tenant, param: str | None = None) -> dict:
    """A stored response of this tenant's (another tenant's, or none: 404, as if absent)."""
    row = None if state.batches is None else await state.batches.store.response(response_id)
    if row is None or row["tenant"] != tenant.name:
        raise not_found(f"Response with id '{response_id}' not found.", param=param,
                        code="response_not_found")
    return row


async def admit(state, body: bytes, authorization: str | None
                ) -> tuple[Admitted, ResponsesRequest, Stored]:
    """`completions.admit` for a Responses body: the same checks in the same order, and
    a `previous_response_id` looked up (the tenant's own, 404 otherwise)."""
    arrival = trio.current_time()
    check_phase(state)
    tenant = state.tenants.authenticate(authorization)
    parsed, r = parse(body)
    previous: list[dict] = []
    if r.previous_response_id is not None:
        row = await own(state, r.previous_response_id, tenant, "previous_response_id")
        previous = json.loads(row["conversation"])
        parsed, r = parse(body, previous)
    adm = await admit_parsed(state, "chat", parsed, tenant, arrival,
                             authorization=authorization)
    return adm, r, Stored(state, tenant, previous)


# ----------------------------------------------------------------------------- response
class _Ids:
    """The response's and its message's ids, and when it was created."""

    def __init__(self) -> None:
        self.response = f"resp_{uuid.uuid4().hex}"
        self.message = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())


def _usage(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def _message(ids: _Ids, text: str | None, status: str) -> dict:
    content = [] if text is None else [
        {"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": ids.message, "status": status, "role": "assistant",
            "content": content}


def _call_item(call) -> dict:
    """A call the answer made (`schemas.ToolCall` or its delta) as an output item."""
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}",
            "call_id": call.id, "name": call.function.name,
            "arguments": call.function.arguments, "status": "completed"}


def response_object(ids: _Ids, adm: Admitted, r: ResponsesRequest, *, status: str,
                    text: str | None = None, finish: str | None = None,
                    usage: Usage | None = None, store: bool = False,
                    calls: list | None = None) -> dict:
    """The `response` object: in progress (no output yet) or ended with `text` (a message
    item, unless the answer was calls alone) and `calls` (function_call items), its
    finish reason deciding "completed" or "incomplete"."""
    incomplete = None
    if status != "in_progress":
        if finish == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        elif finish == "content_filter":
            status, incomplete = "incomplete", {"reason": "content_filter"}
    item_status = "completed" if status == "completed" else "incomplete"
    fmt = {"type": "text"}
    if r.text is not None and r.text.format is not None:
        fmt = msgspec.to_builtins(r.text.format)
    return {
        "id": ids.response, "object": "response", "created_at": ids.created,
        "status": status, "model": adm.model, "error": None,
        "incomplete_details": incomplete, "instructions": r.instructions,
        "max_output_tokens": r.max_output_tokens,
        "output": [] if status == "in_progress" else [
            *([_message(ids, text or "", item_status)] if text or not calls else []),
            *(_call_item(c) for c in calls or ())],
        "parallel_tool_calls": r.parallel_tool_calls is not False,
        "previous_response_id": r.previous_response_id,
        "store": store, "temperature": r.temperature, "top_p": r.top_p,
        "text": {"format": fmt},
        "tool_choice": msgspec.to_builtins(r.tool_choice) if r.tool_choice is not None
        else ("auto" if r.tools else "none"),
        "tools": msgspec.to_builtins(r.tools or []),
        "truncation": "disabled", "metadata": r.metadata or {}, "user": r.user,
        "usage": _usage(usage)}


async def finish(body: bytes, adm: Admitted, r: ResponsesRequest, stored: Stored) -> bytes:
    """The non-streamed response, from the chat completion `streaming.collect` made; kept
    before it is answered (a next turn may name it at once)."""
    chat = _decode_chat(body)
    choice = chat["choices"][0]
    u = chat["usage"]
    details = u.get("prompt_tokens_details") or {}
    usage = Usage(u["prompt_tokens"], u["completion_tokens"], u["total_tokens"],
                  PromptTokensDetails(details.get("cached_tokens", 0)))
    calls = [msgspec.convert(c, ToolCall) for c in choice["message"].get("tool_calls") or ()]
    obj = response_object(_Ids(), adm, r, status="completed",
                          text=choice["message"]["content"], finish=choice["finish_reason"],
                          usage=usage, store=stored.keeps(r), calls=calls)
    await stored.save(r, obj)
    return msgspec.json.encode(obj)


class ResponsesWriter:
    """Renders the Responses stream's events for one admitted request (`streaming.sse_body`
    drives it as it drives the chat writer: start, tokens, tool_calls, finish_choice, end,
    error). The message item opens with the first text (an answer of calls alone has
    none); each call is a function_call item, its arguments in one delta, at the end."""

    def __init__(self, adm: Admitted, r: ResponsesRequest, stored: Stored) -> None:
        self.adm, self.r, self.ids, self.stored = adm, r, _Ids(), stored
        self.done: dict | None = None  # the ended response, once `end` made it
        self.seq = 0
        self.parts: list[str] = []
        self.opened = False  # the message item announced
        self.calls: list = []
        self.reason: str | None = None

    def _event(self, kind: str, **fields) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\n".encode() + sse_data(obj)

    def _where(self) -> dict:
        return {"item_id": self.ids.message, "output_index": 0, "content_index": 0}

    def start(self) -> bytes:
        head = response_object(self.ids, self.adm, self.r, status="in_progress",
                               store=self.stored.keeps(self.r))
        return (self._event("response.created", response=head)
                + self._event("response.in_progress", response=head))

    def _open(self) -> bytes:
        self.opened = True
        return (self._event("response.output_item.added", output_index=0,
                            item=_message(self.ids, None, "in_progress"))
                + self._event("response.content_part.added", **self._where(),
                              part={"type": "output_text", "text": "", "annotations": [],
                                    "logprobs": []}))

    def tokens(self, text: str, events: list, index: int = 0) -> bytes:
        if not text:
            return b""
        self.parts.append(text)
        head = b"" if self.opened else self._open()
        return head + self._event("response.output_text.delta", **self._where(), delta=text,
                                  logprobs=[])

    def tool_calls(self, calls: list, index: int = 0) -> bytes:
        self.calls += calls
        return b""

    def finish_choice(self, reason: str, index: int = 0) -> bytes:
        self.reason = reason
        return b""

    def end(self, usage: Usage | None) -> bytes:
        text = "".join(self.parts)
        done = response_object(self.ids, self.adm, self.r, status="completed", text=text,
                               finish=self.reason, usage=usage,
                               store=self.stored.keeps(self.r), calls=self.calls)
        self.done = done
        out = b""
        if not self.opened and not self.calls:
            out += self._open()  # an empty answer is still a message
        if self.opened:
            item = done["output"][0]
            out += (self._event("response.output_text.done", **self._where(), text=text,
                                logprobs=[])
                    + self._event("response.content_part.done", **self._where(),
                                  part=item["content"][0])
                    + self._event("response.output_item.done", output_index=0, item=item))
        first = len(done["output"]) - len(self.calls)
        for i, item in enumerate(done["output"][first:], start=first):
            where = {"item_id": item["id"], "output_index": i}
            out += (self._event("response.output_item.added", output_index=i,
                                item={**item, "arguments": "", "status": "in_progress"})
                    + self._event("response.function_call_arguments.delta", **where,
                                  delta=item["arguments"])
                    + self._event("response.function_call_arguments.done", **where,
                                  arguments=item["arguments"], name=item["name"])
                    + self._event("response.output_item.done", output_index=i, item=item))
        final = "response.completed" if done["status"] == "completed" else "response.incomplete"
        return out + self._event(final, response=done)

    async def ended(self) -> None:
        """Kept before the last event goes out (`sse_body` awaits it): a next turn may
        name this response as soon as its client has it."""
        if self.done is not None:
            await self.stored.save(self.r, self.done)

    def error(self, ev) -> bytes:
        # `error` names the failure as chat streams do, so the official clients raise it.
        code = ev.kind or "server_error"
        return self._event("error", code=code, message=ev.message, param=None,
                           error={"message": ev.message, "type": "server_error", "code": code})
