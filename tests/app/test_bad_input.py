"""Issue 4 point 6: every bad input gets the right status and OpenAI's error shape, and the
server keeps serving afterwards (checked by a normal request and an empty KV pool)."""

from __future__ import annotations

import json

import httpx

from tests.app.harness import MODEL, assert_error, serve

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": USER, **kw}


def comp(**kw) -> dict:
    return {"model": MODEL, "prompt": "abc", **kw}


# (case, path, body (bytes are sent raw), status, param or None, code or None)
CASES = [
    ("malformed json", CHAT, b'{"model": "x", "messages": [', 400, None, "invalid_json"),
    ("not an object", CHAT, b"[1, 2]", 400, None, "invalid_type"),
    ("null body", CHAT, b"null", 400, None, "invalid_type"),
    ("empty body", CHAT, b"", 400, None, "invalid_json"),
    ("invalid utf-8", CHAT, b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": '
     b'"user", "content": "\xff\xfe"}]}', 400, None, "invalid_json"),
    ("lone surrogate", CHAT, b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}',
     400, None, "invalid_json"),
    ("model wrong type", CHAT, {"model": 1, "messages": USER}, 400, "model", "invalid_value"),
    ("messages wrong type", CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages", None),
    ("max_tokens wrong type", CHAT, chat(max_tokens="10"), 400, "max_tokens", None),
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ("missing model", CHAT, {"messages": USER}, 400, "model", "missing_required_parameter"),
    ("empty messages", CHAT, chat(messages=[]), 400, "messages", None),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages[0].role", None),
    ("tool result without its call's id", CHAT, chat(messages=[{"role": "tool",
                                                                 "content": "x"}]), 400,
     "messages[0].tool_call_id", None),
    ("tool call asked of no tools", CHAT, chat(tool_choice="required"), 400, "tool_choice",
     None),
    ("tool choice naming no tool", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     "tool_choice", None),
    ("bad function name", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "no spaces"}}]), 400, "tools[0].function.name", None),
    ("image content", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400,
     "messages[0].content[0].type", None),
    ("template refuses", CHAT, chat(messages=[{"role": "assistant",
                                               "content": "refuse-template"}]), 400,
     "messages", "invalid_messages"),
    ("unknown model", CHAT, chat(model="gpt-5"), 404, "model", "model_not_found"),
    ("max_tokens zero", CHAT, chat(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens negative", COMP, comp(max_tokens=-5), 400, "max_tokens", None),
    ("max_completion_tokens negative", CHAT, chat(max_completion_tokens=-1), 400,
     "max_completion_tokens", None),
    ("max_tokens disagree", CHAT, chat(max_tokens=5, max_completion_tokens=6), 400,
     "max_completion_tokens", None),
    ("temperature negative", CHAT, chat(temperature=-0.1), 400, "temperature", None),
    ("temperature absurd", CHAT, chat(temperature=1e308), 400, "temperature", None),
    ("top_p zero", CHAT, chat(top_p=0), 400, "top_p", None),
    ("top_p above one", COMP, comp(top_p=1.5), 400, "top_p", None),
    ("top_k negative", CHAT, chat(top_k=-7), 400, "top_k", None),
    ("min_p above one", CHAT, chat(min_p=2), 400, "min_p", None),
    ("presence_penalty absurd", CHAT, chat(presence_penalty=5), 400, "presence_penalty", None),
    ("frequency_penalty absurd", COMP, comp(frequency_penalty=-3), 400, "frequency_penalty",
     None),
    ("seed absurd", CHAT, chat(seed=2**70), 400, "seed", None),
    ("priority absurd", CHAT, chat(priority=10**9), 400, "priority", None),
    ("n=17", CHAT, chat(n=17), 400, "n", None),
    ("best_of=17", COMP, comp(best_of=17), 400, "best_of", None),
    ("best_of below n", COMP, comp(best_of=2, n=3), 400, "best_of", None),
    ("best_of above n streamed", COMP, comp(best_of=3, stream=True), 400, "best_of", None),
    ("max_tokens 0 without echo", COMP, comp(max_tokens=0), 400, "max_tokens", None),
    ("top_logprobs 21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs", None),
    ("completion logprobs 21", COMP, comp(logprobs=21), 400, "logprobs", None),
    ("five stop strings", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    ("empty stop string", CHAT, chat(stop=[""]), 400, "stop[0]", None),
    ("stop_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400,
     "stream_options", None),
    ("unsupported params", CHAT, chat(tools=[], functions=[]), 400, "functions",
     "unsupported_parameter"),
    ("unsupported nested param", CHAT, chat(stream_options={"continuous_usage": True}), 400,
     "stream_options.continuous_usage", "unsupported_parameter"),
    ("logit_bias out of vocab", CHAT, chat(logit_bias={"5000": 1}), 400, "logit_bias",
     "invalid_token_id"),
    ("logit_bias not a token id", COMP, comp(logit_bias={"a": 1}), 400, "logit_bias",
     "invalid_token_id"),
    ("logit_bias absurd", CHAT, chat(logit_bias={"5": 1000}), 400, None, None),
    ("response_format unknown type", CHAT, chat(response_format={"type": "yaml"}), 400,
     "response_format.type", "invalid_value"),
    # The fake model's tokenizer is no Hugging Face one: no grammar can drive it.
    ("structured output without a tokenizer for it", CHAT,
     chat(response_format={"type": "json_object"}), 400, "response_format", "invalid_grammar"),
    ("two kinds of structured output", CHAT, chat(guided_regex="a", guided_choice=["b"]), 400,
     "guided_choice", "conflicting_parameters"),
    ("store true", CHAT, chat(store=True), 400, "store", "unsupported_value"),
    ("suffix", COMP, comp(suffix="x"), 400, "suffix", "unsupported_parameter"),
    ("several prompts", COMP, comp(prompt=["a", "b"]), 400, "prompt", None),
    ("nested prompt", COMP, comp(prompt=[[1, 2]]), 400, "prompt[0]", None),
    ("token id out of vocab", COMP, comp(prompt=[1, 5000]), 400, "prompt", "invalid_token_id"),
    ("negative token id", COMP, comp(prompt=[-1]), 400, "prompt", "invalid_token_id"),
    ("empty prompt", COMP, comp(prompt=""), 400, "prompt", "empty_prompt"),
    ("empty prompt list", COMP, comp(prompt=[]), 400, "prompt", None),
    ("tokenize both", "/tokenize", {"prompt": "a", "messages": USER}, 400, "prompt", None),
    ("tokenize unknown model", "/tokenize", {"model": "nope", "prompt": "a"}, 404, "model",
     None),
    ("detokenize out of vocab", "/detokenize", {"tokens": [1, 99999]}, 400, "tokens", None),
    ("detokenize negative", "/detokenize", {"tokens": [-1]}, 400, "tokens[0]", None),
]


async def test_every_bad_input_is_refused_and_the_server_keeps_serving():
    async with serve() as srv, srv.client() as http:
        for case, path, body, status, param, code in CASES:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await http.post(path, content=content,
                                headers={"content-type": "application/json"})
            try:
                assert_error(r, status, param=param, code=code)
            except AssertionError as e:
                raise AssertionError(f"case {case!r}: {e}") from None
        err = assert_error(await http.post(CHAT, json=chat(tools=[], functions=[],
                                                           function_call="auto")), 400)
        assert all(f"`{p}`" in err["message"] for p in ("functions", "function_call")), err
        # A normal request still works (with the parameters accepted and ignored), and
        # nothing leaked.
        r = await http.post(CHAT, json=chat(max_tokens=3, store=False, metadata={"a": "b"},
                                            parallel_tool_calls=False, reasoning_effort="low"))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hij"
        await srv.wait_idle()
        assert srv.pages_in_use() == 0 and not srv.state.flights


async def test_context_overflow_names_both_numbers():
    async with serve() as srv, srv.client() as http:
        prompt = "x" * 2000
        r = await http.post(COMP, json=comp(prompt=prompt, max_tokens=100))
        err = assert_error(r, 400, param="max_tokens", code="context_length_exceeded")
        assert "2048" in err["message"] and "2100" in err["message"]
        assert "2000 in the prompt" in err["message"] and "100 in the completion" in err["message"]
        r = await http.post(COMP, json=comp(prompt="x" * 2048))  # no room at all
        err = assert_error(r, 400, code="context_length_exceeded")
        assert "2048" in err["message"]
        # Without max_tokens the rest of the context is the budget.
        r = await http.post(COMP, json=comp(prompt="x" * 2040))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


async def test_oversized_body_and_http_errors():
    async with serve() as srv, srv.client() as http:
        big = json.dumps(chat(messages=[{"role": "user", "content": "x" * 70_000}]))
        r = await http.post(CHAT, content=big, headers={"content-type": "application/json"})
        assert_error(r, 413, type="invalid_request_error")
        # The body was not read to its end: the answer says that the connection closes, so
        # the client opens a new one instead of racing the close with its next request.
        assert r.headers["connection"] == "close"
        assert_error(await http.get(CHAT), 405)
        assert_error(await http.get("/v1/nothing-here"), 404, type="not_found_error")
        r = await http.post(CHAT, json=chat(max_tokens=2))
        assert r.status_code == 200


async def test_chunked_oversized_body_is_413():
    async def chunks():
        for _ in range(20):
            yield b"x" * 8192

    async with serve() as srv:
        async with srv.client(timeout=5) as http:
            try:
                r = await http.post(CHAT, content=chunks())
            except httpx.HTTPError:  # the server may close before the upload ends: fine too
                pass
            else:
                assert_error(r, 413)
        # A fresh connection: the one above is dead (the server stopped reading its body
        # half way, so it cannot carry another request).
        async with srv.client(timeout=5) as http:
            assert (await http.get("/health")).status_code == 200
