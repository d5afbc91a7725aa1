"""Tool calls on chat completions: the tools in the prompt, the calls out of the answer.

Sluice emits and accepts calls; running them is the client's business. The format is the
Hermes one that vLLM's `hermes` parser and many chat templates use: the tools are
described in a system block (`<tools>` the functions' JSON, and how to call one), a call
is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the answer, and a tool's
result comes back as a `tool` turn holding `<tool_response>...</tool_response>`. The
embedded model's template (ChatML) renders every role as it is given, so the conversation
needs nothing of the template but that.

- `tool_choice` "auto" (the default with tools): the model may call or answer; calls
  are read from its text (`split_calls`) and a malformed one stays text.
- "required", or a named function: the answer is constrained (`call_grammar`, an
  llguidance grammar whose arguments are each function's JSON schema) to one call (or
  several with `parallel_tool_calls`), so its arguments always parse and validate.
- "none": the tools are not shown and nothing is read as a call.

A streamed answer sends its text as it comes until a call begins; the calls go out whole
(`index`, `id`, name, complete arguments), one delta each, when the answer ends, with
finish_reason "tool_calls" (`CallStream`).
"""

from __future__ import annotations

import json
import re
import uuid

from .schemas import (ChatCompletionRequest, ChatMessage, FunctionCall, NamedToolChoice, Tool,
                      ToolCall, ToolCallDelta)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def active(req: ChatCompletionRequest) -> bool:
    """Whether the request's tools are in play (given, and `tool_choice` not "none")."""
    return bool(req.tools) and req.tool_choice != "none"


def _schema(tool: Tool) -> dict:
    return {"name": tool.function.name, "description": tool.function.description or "",
            "parameters": tool.function.parameters or {"type": "object"}}


def system_block(req: ChatCompletionRequest) -> str:
    """The tools' description for the prompt (the functions the choice allows)."""
    tools = allowed(req)
    listing = "\n".join(json.dumps(_schema(t)) for t in tools)
    return ("You can call functions to help answer. The functions, as JSON schemas:\n"
            f"<tools>\n{listing}\n</tools>\n"
            "To call a function, answer with a JSON object naming it and giving its "
            f"arguments, inside {OPEN}{CLOSE} tags, one block per call:\n"
            f'{OPEN}\n{{"name": "<function name>", "arguments": {{...}}}}\n{CLOSE}')


def allowed(req: ChatCompletionRequest) -> list[Tool]:
    """The tools the model may call (a named choice: that one alone)."""
    tools = list(req.tools or ())
    if isinstance(req.tool_choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == req.tool_choice.function.name]
    return tools


def check(req: ChatCompletionRequest) -> tuple[str, str] | None:
    """What is wrong with the request's tools: (message, parameter) for a 400, or None."""
    for i, m in enumerate(req.messages):
        if m.role == "tool" and not m.tool_call_id:
            return ("A `tool` message answers a call: it needs that call's `tool_call_id`.",
                    f"messages[{i}].tool_call_id")
    names = [t.function.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        return "Function names in `tools` must be unique.", "tools"
    if req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice):
        if not names:
            return "`tool_choice` asks for a call but `tools` is empty.", "tool_choice"
        if isinstance(req.tool_choice, NamedToolChoice) and not allowed(req):
            return (f"`tool_choice` names {req.tool_choice.function.name!r}, which is not "
                    "in `tools`.", "tool_choice")
    return None


def render(req: ChatCompletionRequest, messages: list[dict]) -> list[dict]:
    """The conversation as the template renders it, with the tools' system block (merged
    into a leading system message) and calls and results in the Hermes form."""
    out: list[dict] = []
    for m, src in zip(messages, req.messages):
        content = m["content"]
        if src.role == "tool":
            out.append({"role": "tool",
                        "content": f"<tool_response>\n{content}\n</tool_response>"})
            continue
        if src.role == "assistant" and src.tool_calls:
            calls = "\n".join(
                f'{OPEN}\n{{"name": {json.dumps(c.function.name)}, "arguments": '
                f"{c.function.arguments or '{}'}}}\n{CLOSE}" for c in src.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m["role"], "content": content})
    if active(req):
        block = system_block(req)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def call_grammar(req: ChatCompletionRequest) -> str | None:
    """The llguidance (Lark) grammar a "required" or named choice constrains the answer
    to: one call, or with `parallel_tool_calls` (the default) one or more, each a JSON
    object of an allowed function's name and its schema's arguments. None: free text."""
    if not (req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)):
        return None
    variants = [{"type": "object", "additionalProperties": False,
                 "required": ["name", "arguments"],
                 "properties": {"name": {"const": t.function.name},
                                "arguments": t.function.parameters or {"type": "object"}}}
                for t in allowed(req)]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    repeat = "" if req.parallel_tool_calls is False else '("\\n" call)*'
    return (f"start: call {repeat}\n"
            f'call: "{OPEN}\\n" obj "\\n{CLOSE}"\n'
            f"obj: %json {json.dumps(schema)}\n")


def _call(raw: str) -> FunctionCall | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if (not isinstance(obj, dict) or not isinstance(obj.get("name"), str)
            or not isinstance(obj.get("arguments", {}), dict)):
        return None
    return FunctionCall(obj["name"], json.dumps(obj.get("arguments", {})))


def new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def split_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """An answer's text and the calls in it (well-formed blocks only: a malformed one
    stays in the text). The text is None when only calls were said."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for m in _CALL.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[at:m.start()])
        at = m.end()
        calls.append(ToolCall(new_id(), call))
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else content, calls


class CallStream:
    """One streamed choice's text while calls may come: text before a call goes out as it
    comes (less any tail that could be the start of `<tool_call>`); from the first call
    on everything is held, and `finish` returns the held text's calls."""

    def __init__(self) -> None:
        self.held = ""
        self.calling = False

    def feed(self, text: str) -> str:
        """What of `text` can go out now."""
        self.held += text
        if self.calling:
            return ""
        at = self.held.find(OPEN)
        if at >= 0:
            out, self.held, self.calling = self.held[:at], self.held[at:], True
            return out
        keep = next((k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1)
                     if OPEN.startswith(self.held[-k:])), 0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """(text still to send, the calls as deltas)."""
        text, calls = split_calls(self.held) if self.calling else (self.held, [])
        return text or "", [ToolCallDelta(i, c.id, c.function) for i, c in enumerate(calls)]


def plain_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the template takes them ("developer" is its "system")."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in messages]
