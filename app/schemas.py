"""The OpenAI wire format as msgspec Structs, and `decode_body`, the one way bodies come in.

Requests forbid unknown fields: a parameter this server does not implement (``functions``,
an image part ...) is refused with a 400 naming it, never silently ignored, since a client that
asked for something and got plain text would have no way to tell. A few parameters that
change nothing a client can observe here are accepted and ignored (docs/api.md lists
them). Limits live in the types (``Meta``), so msgspec reports the exact path of a bad
value and the handlers only do cross-field checks (context length, prompt shape).

Optional parameters default to None rather than to a value, so that explicit JSON
``null`` (which some clients send) means "the default", as it does at OpenAI.

This module must stay importable on its own: msgspec resolves the string annotations
through the module's globals. (Over 350 lines on purpose: it is only type declarations,
the request and response shapes side by side, and splitting them would scatter the wire
format the openapi generator and docs/api.md walk as one.)
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, TypeVar

import msgspec
from msgspec import Meta

from .errors import APIError, bad_request

# ------------------------------------------------------------------------------ requests
Prob = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
StopString = Annotated[str, Meta(min_length=1, max_length=1024)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=4)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]  # image, audio and file parts are refused: text models only
    text: str


FunctionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionCallIn(msgspec.Struct, forbid_unknown_fields=True):
    name: FunctionName
    arguments: str  # JSON text, as the model wrote it


class ToolCallIn(msgspec.Struct, forbid_unknown_fields=True):
    """A call an earlier assistant turn made (sent back with the conversation)."""

    id: Annotated[str, Meta(max_length=256)]
    function: FunctionCallIn
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    # "developer" is OpenAI's newer name for "system". A "tool" message answers an
    # assistant turn's call (`tool_call_id`); app/tools.py renders both for the template.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Annotated[str, Meta(max_length=256)] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk


# Structured output (app/structured.py): OpenAI's `response_format`, and vLLM's names.
class JsonSchemaSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, Meta(max_length=64)] = "response"
    schema: dict | bool | None = None  # None: any JSON object
    strict: bool | None = None  # the schema is always enforced
    description: str | None = None


class TextFormat(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    pass


class JsonObjectFormat(msgspec.Struct, tag="json_object", tag_field="type",
                       forbid_unknown_fields=True):
    pass


class JsonSchemaFormat(msgspec.Struct, tag="json_schema", tag_field="type",
                       forbid_unknown_fields=True):
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat
Choices = Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1, max_length=256)]


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Newer vLLM's one field for all kinds (give one)."""

    json: dict | bool | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: FunctionName
    description: Annotated[str, Meta(max_length=4096)] | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (None: any object)
    strict: bool | None = None  # the schema is always enforced where the call is


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionDef
    type: Literal["function"] = "function"


class ToolChoiceFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: FunctionName


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    function: ToolChoiceFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _GenerateParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What chat and completions share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Meta(ge=0)] | None = None  # 0: completions' echo only
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None  # -1 or 0: off
    min_p: Prob | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: Stop | None = None
    n: Annotated[int, Meta(ge=1, le=16)] | None = None  # choices: the prompt prefilled once
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None  # vLLM's
    ignore_eos: bool = False  # vLLM's: benchmarks use it to get exactly max_tokens
    # vLLM's: token ids that end the answer like eos does (not shown in the text).
    stop_token_ids: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=64)] | None = None
    priority: Annotated[int, Meta(ge=-1000, le=1000)] | None = None  # smaller: sooner
    user: Annotated[str, Meta(max_length=256)] | None = None  # logged, like OpenAI
    # Token id (as a string, OpenAI's JSON) -> bias added to its logit before sampling.
    logit_bias: Annotated[dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]],
                          Meta(max_length=300)] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict | bool | str | None = None  # vLLM's structured-output names
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None  # GBNF (llama.cpp's, vLLM's) or Lark
    structured_outputs: StructuredOutputs | None = None
    # Accepted and ignored (docs/api.md): nothing is stored (`store: true` is refused),
    # there are no tools to call in parallel, and the model does not reason first.
    store: bool | None = None
    metadata: Annotated[dict[str, Annotated[str, Meta(max_length=512)]],
                        Meta(max_length=16)] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None


class ChatCompletionRequest(_GenerateParams, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    tools: list[Tool] | None = None  # (bounded by the body size, `max_body_bytes`)
    tool_choice: ToolChoice | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None


class CompletionRequest(_GenerateParams, kw_only=True):
    # One prompt: a string or token ids. A list of several prompts is n>1 in disguise.
    prompt: str | Annotated[list[int | str], Meta(min_length=1)]
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool | None = None
    best_of: Annotated[int, Meta(ge=1, le=16)] | None = None  # >= n; ranked by mean logprob


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


# ----------------------------------------------------------------------------- responses
class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # a thinking model's (app/reasoning.py)


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    object: str  # "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(msgspec.Struct):
    """A whole call in one delta (its arguments complete), as the stream's last chunks."""

    index: int
    id: str
    function: FunctionCall
    type: str = "function"


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str  # "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct, omit_defaults=True):
    id: str
    object: str  # "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    root: str  # the pool's model source; an adapter's directory
    object: str = "model"
    owned_by: str = "sluice"
    parent: str | None = None  # an adapter's base model (vLLM's field); None for a base


class LoadLoraAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's POST /v1/load_lora_adapter body (`base_model`: ours, to pick a pool when
    several serve adapters)."""

    lora_name: str
    lora_path: str
    base_model: str | None = None


class UnloadLoraAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM sends it; unused


class LoraAdapterCard(msgspec.Struct):
    """What a load answers: the adapter as /v1/models will list it."""

    id: str
    parent: str
    root: str
    rank: int
    target_modules: list[str]
    object: str = "lora_adapter"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class Health(msgspec.Struct):
    # "ok" | "degraded" (a replica died; the others serve) | "loading" | "draining" |
    # "engine_dead" (a pool has no live replica; the detail says why)
    status: str
    detail: str = ""
    # Step shapes still compiling in the background: the server already serves, some
    # steps padded to a bigger shape until they are done (docs/operations.md).
    warmup_remaining_shapes: int = 0


# ------------------------------------------------------------------------------ decoding
T = TypeVar("T")
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<name>.+)`")
_HINTS = {
    "n": "1 to 16 choices per request",
    "best_of": "1 to 16 sequences, at least `n`",
    "stop": "up to 4 non-empty stop strings",
    "top_logprobs": "0 to 20",
    "logprobs": "0 to 20 for completions, a boolean for chat",
}


def decode_body(body: bytes, type: type[T]) -> T:
    """Decode a request body, turning every failure into a 400 that names the parameter."""
    try:
        return msgspec.json.decode(body, type=type)
    except msgspec.ValidationError as e:
        raise _validation_error(body, type, e) from None
    except msgspec.DecodeError as e:
        raise bad_request(
            f"We could not parse the JSON body of your request ({e}). The body must be a "
            "UTF-8 JSON object.",
            code="invalid_json",
        ) from None
    except RecursionError:  # msgspec recurses as deep as the JSON nests (to Python's limit)
        raise bad_request("The JSON body of your request is nested too deeply.",
                          code="invalid_json") from None


def _validation_error(body: bytes, type: type, e: msgspec.ValidationError) -> APIError:
    what, sep, where = str(e).rpartition(" - at ")
    if not sep:
        what, where = str(e), "$"
    path = where.strip("`").removeprefix("$").lstrip(".") or None
    unknown = _UNKNOWN.match(what)
    if unknown:
        names = [unknown["name"]]
        if path is None:  # top level: name every unsupported parameter, not just the first
            try:
                raw = msgspec.json.decode(body)
                names = sorted(set(raw) - set(type.__struct_fields__)) or names
            except (msgspec.DecodeError, TypeError, RecursionError):
                pass
        where_txt = f" in `{path}`" if path else ""
        listed = ", ".join(f"`{n}`" for n in names)
        return bad_request(
            f"Unsupported parameter{'s' if len(names) > 1 else ''}{where_txt}: {listed}. "
            "This server does not implement it; remove it from the request.",
            param=f"{path}.{names[0]}" if path else names[0],
            code="unsupported_parameter",
        )
    missing = re.match(r"Object missing required field `(.+)`", what)
    if missing:
        param = f"{path}.{missing[1]}" if path else missing[1]
        return bad_request(f"Missing required parameter: `{param}`.", param=param,
                           code="missing_required_parameter")
    if path is None:
        return bad_request(f"Invalid request body: {what}.", code="invalid_type")
    hint = _HINTS.get(path.split("[")[0].split(".")[0])
    return bad_request(
        f"Invalid value for `{path}`: {what}" + (f" ({hint})." if hint else "."),
        param=path,
        code="invalid_value",
    )
