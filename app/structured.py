"""Structured output and logit bias: from a request's parameters to what the engine takes.

One way to ask for structure per request: OpenAI's `response_format` (`json_object`,
`json_schema`), or vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, or newer vLLM's `structured_outputs` object. Each becomes an llguidance
grammar (model/grammar.py); the grammar is compiled in a worker thread (a big schema
takes milliseconds to seconds; compiled grammars are cached by text) and each request
gets its own `GrammarConstraint`. What cannot be compiled is a 400 naming the parameter
and llguidance's reason.
"""

from __future__ import annotations

import json

import trio

from . import tools
from .errors import bad_request
from .grammar import (GrammarError, choice_grammar, ebnf_grammar, json_schema_grammar,
                      regex_grammar)
from .pools import Pool
from .schemas import (ChatCompletionRequest, CompletionRequest, JsonObjectFormat,
                      JsonSchemaFormat)

Request = ChatCompletionRequest | CompletionRequest


def grammar_of(req: Request) -> tuple[str, str] | None:
    """(llguidance grammar, the parameter that asked for it), or None for free text."""
    asked: list[tuple[str, object]] = []
    rf = req.response_format
    if isinstance(rf, JsonObjectFormat):
        asked.append(("response_format", {"type": "object"}))
    elif isinstance(rf, JsonSchemaFormat):
        schema = rf.json_schema.schema
        asked.append(("response_format.json_schema.schema",
                      {"type": "object"} if schema is None else schema))
    so = req.structured_outputs
    for name, value in (
        ("guided_json", req.guided_json), ("guided_regex", req.guided_regex),
        ("guided_choice", req.guided_choice), ("guided_grammar", req.guided_grammar),
        *(((f"structured_outputs.{f}", getattr(so, f)) for f in
           ("json", "regex", "choice", "grammar")) if so is not None else ()),
    ):
        if value is not None:
            asked.append((name, value))
    if so is not None and so.json_object:
        asked.append(("structured_outputs.json_object", {"type": "object"}))
    if isinstance(req, ChatCompletionRequest) and (calls := tools.call_grammar(req)):
        asked.append(("tool_choice", calls))  # a call required: its arguments' schemas
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(f"`{n}`" for n, _ in asked)
        raise bad_request(f"Ask for one kind of structured output per request; got {names}.",
                          param=asked[1][0], code="conflicting_parameters")
    param, value = asked[0]
    try:
        return _grammar(param, value), param
    except GrammarError as e:
        raise bad_request(f"Unsupported or invalid `{param}`: {e}", param=param,
                          code="invalid_grammar") from None


def _grammar(param: str, value) -> str:
    kind = param.rsplit(".", 1)[-1].removeprefix("guided_")
    if kind in ("response_format", "schema", "json", "json_object"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise GrammarError(f"not JSON: {e}") from None
            except RecursionError:
                raise GrammarError("nested too deeply") from None
        if not isinstance(value, (dict, bool)):
            raise GrammarError("a JSON schema is an object (or true/false)")
        return json_schema_grammar(value)
    if kind == "regex":
        return regex_grammar(value)
    if kind == "choice":
        return choice_grammar(list(value))
    return ebnf_grammar(value)


async def constraint_for(pool: Pool, grammar: tuple[str, str] | None):
    """The request's own constraint (None for free text), compiled off the event loop."""
    if grammar is None:
        return None
    text, param = grammar
    try:
        return await trio.to_thread.run_sync(pool.grammars.constraint, text)
    except GrammarError as e:
        raise bad_request(f"Unsupported or invalid `{param}`: {e}", param=param,
                          code="invalid_grammar") from None


def logit_bias_of(req: Request, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token ids as JSON object keys) as (id, bias) pairs."""
    if not req.logit_bias:
        return ()
    out = []
    for key, bias in req.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size:
            raise bad_request(f"`logit_bias` keys must be token ids in [0, {vocab_size}); "
                              f"got {key!r}.", param="logit_bias", code="invalid_token_id")
        out.append((token, float(bias)))
    return tuple(out)
