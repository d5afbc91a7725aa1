"""Tool calls (app/tools.py) without a model: calls read from an answer's text, a streamed
answer's text held from where a call begins (markers split anywhere across writes), the
conversation rendered with the tools, calls and results, and the SSE chunks a streamed
call makes. (On the embedded model, through the openai client and LangChain:
tests/app/test_structured.py.)"""

from __future__ import annotations

import json

import msgspec
import pytest
import trio

from app import tools
from app.schemas import ChatCompletionRequest, decode_body
from app.streaming import sse_body
from scheduler.api import FinishEvent, TokenEvent
from tests.app.harness import sse_events
from tests.app.test_streaming import admitted

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def req(**kw) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return decode_body(json.dumps(body).encode(), ChatCompletionRequest)


def test_calls_are_read_from_the_answer_and_malformed_ones_stay_text():
    text, calls = tools.split_calls(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
        "</tool_call>")
    assert text == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    assert len({c.id for c in calls}) == 2 and calls[0].id.startswith("call_")
    assert tools.split_calls('<tool_call>{"name": "f"}</tool_call>')[0] is None
    broken = "<tool_call>{not json}</tool_call> ok"
    assert tools.split_calls(broken) == (broken, [])
    assert tools.split_calls("plain") == ("plain", [])


@pytest.mark.parametrize("cut", [1, 3, 7, 11, 12, 20])
def test_a_streamed_call_is_held_wherever_the_writes_split_it(cut):
    answer = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    s = tools.CallStream()
    sent = "".join(s.feed(answer[i:i + cut]) for i in range(0, len(answer), cut))
    rest, calls = s.finish()
    assert sent + rest == "Sure. "
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "f", {"a": 1})]
    plain = tools.CallStream()
    out = "".join(plain.feed(p) for p in ("a <tool", "_ca", "t> b"))
    assert out + plain.finish()[0] == "a <tool_cat> b"  # not a call: all of it goes out


def test_the_conversation_carries_tools_calls_and_results():
    r = req(tools=[WEATHER], messages=[
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"}])
    out = tools.render(r, tools.plain_messages(r.messages))
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool"]
    assert out[0]["content"].startswith("Be kind.\n\n") and "<tools>" in out[0]["content"]
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                 '{"city": "Oslo"}}\n</tool_call>')
    assert out[3]["content"] == "<tool_response>\n12 C, rain\n</tool_response>"
    # tool_choice "none": no tools shown, the history still rendered
    none = req(tools=[WEATHER], tool_choice="none")
    assert "<tools>" not in json.dumps(tools.render(none, tools.plain_messages(none.messages)))


def test_a_required_or_named_choice_is_a_grammar_and_auto_is_not():
    assert tools.call_grammar(req(tools=[WEATHER])) is None
    g = tools.call_grammar(req(tools=[WEATHER], tool_choice="required"))
    assert g.startswith("start: call (") and '"const": "get_weather"' in g
    one = tools.call_grammar(req(tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False))
    assert one.startswith("start: call \n")
    named = tools.call_grammar(req(tools=[WEATHER, {**WEATHER, "function": {
        **WEATHER["function"], "name": "other"}}], tool_choice={
            "type": "function", "function": {"name": "other"}}))
    assert '"const": "other"' in named and '"const": "get_weather"' not in named


async def test_a_streamed_call_goes_out_whole_with_finish_reason_tool_calls():
    send, recv = trio.open_memory_channel(100)
    for piece in ("Sure. <tool", '_call>\n{"name": "get_weather", ',
                  '"arguments": {"city": "Oslo"}}\n</tool_call>'):
        send.send_nowait(TokenEvent(piece, (1,)))
    send.send_nowait(FinishEvent("stop", 3, 3, 0, 0.1, 0.0, 0.2))
    adm, _ = admitted("chat", recv)
    adm.tools = True
    body = b"".join([w async for w in sse_body(adm, None, coalesce=False)])
    chunks = [msgspec.json.decode(d) for d in sse_events(body.decode()) if d != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    text = "".join(d.get("content") or "" for d in deltas)
    assert text == "Sure. "
    calls = [tc for d in deltas for tc in d.get("tool_calls") or ()]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [(0, "get_weather", {"city": "Oslo"})]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] \
        == "tool_calls"
