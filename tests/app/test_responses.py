"""The Responses API (`POST /v1/responses`) through the official openai client, on a real
server with the fake runner (tests/app/harness.py: chat answers run to max tokens, each
token a letter): text out as the `response` object and as the Responses event stream
(whose deltas concatenate to the non-streamed text), instructions and message items in,
`max_output_tokens` as an "incomplete" status, usage, a client that leaves mid-stream
(its pages freed), stored responses (two turns by `previous_response_id`, GET, DELETE,
never another tenant's), and bad input as OpenAI-shaped errors naming the parameter.
(The json_schema format on the real model: tests/app/test_structured.py.)"""

from __future__ import annotations

import json

import openai
import pytest

from tests.app.harness import MODEL, TenantConfig, assert_error, serve, settings, sha


async def test_a_response_streamed_and_not_carries_the_same_text():
    async with serve() as srv:
        client = srv.openai()
        r = await client.responses.create(model=MODEL, input="hello", max_output_tokens=6,
                                          instructions="Answer briefly.", temperature=0)
        assert r.id.startswith("resp_") and r.object == "response"
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[0].role == "assistant" and r.output[0].type == "message"
        text = r.output_text
        assert len(text) == 6 and text.isalpha(), text
        assert r.usage.output_tokens == 6
        # <system>Answer briefly.<user>hello + the marker: the instructions are the system
        assert r.usage.input_tokens == len("<system>Answer briefly.<user>hello") + 1
        assert r.usage.total_tokens == r.usage.input_tokens + 6
        assert r.instructions == "Answer briefly." and r.max_output_tokens == 6

        stream = await client.responses.create(model=MODEL, input="hello", max_output_tokens=6,
                                               instructions="Answer briefly.", stream=True)
        kinds, deltas, final = [], [], None
        async for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        assert kinds[:4] == ["response.created", "response.in_progress",
                             "response.output_item.added", "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.incomplete"]
        assert "".join(deltas) == text == final.output_text
        assert final.usage.output_tokens == 6 and final.status == "incomplete"

        # The SDK's streaming helper reads the same events (its `get_final_response` wants
        # "response.completed", which OpenAI too sends only for a complete answer).
        async with client.responses.stream(model=MODEL, input="hello", max_output_tokens=6,
                                           instructions="Answer briefly.") as s:
            helper = [ev async for ev in s]
        assert "".join(ev.delta for ev in helper if ev.type == "response.output_text.delta") \
            == text
        assert helper[-1].type == "response.incomplete"
        await srv.wait_idle()
        assert srv.pages_in_use() == 0


async def test_message_items_make_the_conversation():
    async with serve() as srv:
        client = srv.openai()
        r = await client.responses.create(model=MODEL, max_output_tokens=3, input=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "again"}]},
        ])
        assert len(r.output_text) == 3
        assert r.usage.input_tokens == len("<user>hi<assistant>yo<user>again") + 1


async def test_a_client_that_leaves_mid_stream_frees_its_pages():
    async with serve(step_delay_s=0.01) as srv:
        async with srv.client() as c:
            async with c.stream("POST", "/v1/responses", json={
                    "model": MODEL, "input": "x", "max_output_tokens": 500,
                    "stream": True}) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if "response.output_text.delta" in line:
                        break  # the client goes away mid-answer
        await srv.wait_idle()
        assert srv.pages_in_use() == 0


@pytest.mark.parametrize("body, param, code", [
    ({"input": "x", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", None),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]", None),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]", None),
    ({"input": "x", "frobnicate": 1}, "frobnicate", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content", None),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", None),
    ({"input": []}, "input", None),
])
async def test_bad_input_is_a_400_naming_the_parameter(body, param, code):
    async with serve() as srv:
        async with srv.client() as c:
            r = await c.post("/v1/responses", json={"model": MODEL, **body})
            err = assert_error(r, 400, code=code)
            assert err["param"] is not None and err["param"].startswith(param), err
            ok = await c.post("/v1/responses", json={"model": MODEL, "input": "x",
                                                      "max_output_tokens": 2})
            assert ok.status_code == 200 and json.loads(ok.text)["status"] == "incomplete"
        assert srv.pages_in_use() == 0


async def test_an_unknown_model_is_a_404_and_bad_json_a_400():
    async with serve() as srv:
        client = srv.openai()
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="nope", input="x")
        async with srv.client() as c:
            r = await c.post("/v1/responses", content=b"{not json")
            assert_error(r, 400, code="invalid_json")


async def test_stored_responses_continue_a_conversation_for_their_tenant_only(tmp_path):
    tenants = [TenantConfig(name="a", api_key_sha256=sha("ka")),
               TenantConfig(name="b", api_key_sha256=sha("kb"))]
    async with serve(settings(data_dir=str(tmp_path), tenants=tenants)) as srv:
        a, b = srv.openai("ka"), srv.openai("kb")
        first = await a.responses.create(model=MODEL, input="hello", max_output_tokens=4,
                                         instructions="Be brief.")
        assert first.store is True
        # The second turn: the first's conversation (not its instructions) before the input.
        second = await a.responses.create(model=MODEL, input="again", max_output_tokens=3,
                                          previous_response_id=first.id)
        assert second.previous_response_id == first.id
        convo = f"<user>hello<assistant>{first.output_text}<user>again"
        assert second.usage.input_tokens == len(convo) + 1
        # Streamed, it is kept before its last event: a third turn can follow at once.
        stream = await a.responses.create(model=MODEL, input="more", max_output_tokens=2,
                                          previous_response_id=second.id, stream=True)
        third = [ev async for ev in stream][-1].response
        assert third.store is True
        fourth = await a.responses.create(model=MODEL, input="end", max_output_tokens=2,
                                          previous_response_id=third.id)
        convo += f"<assistant>{second.output_text}<user>more<assistant>{third.output_text}"
        assert fourth.usage.input_tokens == len(convo + "<user>end") + 1

        got = await a.responses.retrieve(first.id)
        assert got.output_text == first.output_text and got.id == first.id
        # Another tenant's response does not exist for b: never its content.
        with pytest.raises(openai.NotFoundError):
            await b.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as e:
            await b.responses.create(model=MODEL, input="x", previous_response_id=first.id)
        assert e.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            await b.responses.delete(first.id)

        await a.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await a.responses.retrieve(first.id)
        unkept = await a.responses.create(model=MODEL, input="x", max_output_tokens=1,
                                          store=False)
        assert unkept.store is False
        with pytest.raises(openai.NotFoundError):
            await a.responses.retrieve(unkept.id)
        await srv.wait_idle()
        assert srv.pages_in_use() == 0


async def test_without_a_store_nothing_is_kept_or_found():
    async with serve() as srv:  # the harness's default: batch jobs, and so the store, off
        client = srv.openai()
        r = await client.responses.create(model=MODEL, input="x", max_output_tokens=1)
        assert r.store is False
        with pytest.raises(openai.NotFoundError) as e:
            await client.responses.create(model=MODEL, input="x",
                                          previous_response_id=r.id)
        assert e.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(r.id)


async def test_an_oversized_body_is_a_413_and_the_server_goes_on():
    async with serve() as srv:  # the harness's max_body_bytes: 64 KiB
        async with srv.client() as c:
            r = await c.post("/v1/responses", json={"model": MODEL, "input": "x" * 70_000})
            assert_error(r, 413)
            ok = await c.post("/v1/responses", json={"model": MODEL, "input": "x",
                                                      "max_output_tokens": 1})
            assert ok.status_code == 200
        await srv.wait_idle()
        assert srv.pages_in_use() == 0
