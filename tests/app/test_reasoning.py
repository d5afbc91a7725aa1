"""`reasoning_content` (app/reasoning.py) for models that think in `<think>` tags: on only
where the template writes the tags; an answer's reasoning apart from its content, whole
or streamed with the tags split anywhere across writes (or opened by the prompt), and the
SSE deltas it makes."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
import trio

from app import reasoning
from app.streaming import sse_body
from scheduler.api import FinishEvent, TokenEvent
from tests.app.harness import sse_events
from tests.app.test_streaming import admitted

ANSWER = "<think>\nThe user greets. Greet back.\n</think>\n\nHello there!"


def test_on_only_where_the_template_thinks_in_tags():
    assert reasoning.enabled(SimpleNamespace(chat_template="{{ '<think>' }}...</think>"))
    assert not reasoning.enabled(SimpleNamespace(chat_template="<|im_start|>{{ role }}"))
    assert not reasoning.enabled(SimpleNamespace())


@pytest.mark.parametrize("text, inside, want", [
    (ANSWER, False, ("The user greets. Greet back.", "Hello there!")),
    ("Plain answer.", False, (None, "Plain answer.")),
    ("<think>cut off befo", False, ("cut off befo", "")),
    ("Thinking already.</think>Answer.", True, ("Thinking already.", "Answer.")),
    ("  <think></think>\n\nJust this.", False, ("", "Just this.")),
])
def test_an_answer_is_split_into_reasoning_and_content(text, inside, want):
    assert reasoning.split(text, inside) == want


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("text, inside", [(ANSWER, False), ("Plain answer.", False),
                                          ("Thinking already.</think>Answer.", True)])
def test_a_streamed_answer_splits_the_same_wherever_the_writes_cut(cut, text, inside):
    s = reasoning.ReasoningStream(inside)
    thought, content = "", ""
    for i in range(0, len(text), cut):
        t, c = s.feed(text[i:i + cut])
        thought, content = thought + t, content + c
    t, c = s.finish()
    thought, content = thought + t, content + c
    want_thought, want_content = reasoning.split(text, inside)
    assert (thought.strip() or None, content) == (want_thought or None, want_content)


async def test_streamed_reasoning_goes_out_as_reasoning_content_deltas():
    send, recv = trio.open_memory_channel(100)
    for piece in ("<thi", "nk>\nThe user greets.", " Greet back.\n</th", "ink>\n\nHello",
                  " there!"):
        send.send_nowait(TokenEvent(piece, (1,)))
    send.send_nowait(FinishEvent("stop", 3, 5, 0, 0.1, 0.0, 0.2))
    adm, _ = admitted("chat", recv)
    adm.thinks = True
    body = b"".join([w async for w in sse_body(adm, None, coalesce=False)])
    deltas = [msgspec.json.decode(d)["choices"][0]["delta"]
              for d in sse_events(body.decode()) if d != "[DONE]"
              if msgspec.json.decode(d)["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) \
        == "The user greets. Greet back."
    assert "".join(d.get("content") or "" for d in deltas) == "Hello there!"
