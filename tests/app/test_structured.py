"""Structured output, logit bias and the parameters real clients send, end to end.

On the embedded SmolLM2 with the official openai client: `beta.chat.completions.parse`
(and the Responses API's `responses.parse` and `.stream` with `text_format`)
with a Pydantic model returns the parsed object (and LangChain's
`ChatOpenAI.with_structured_output` too), JSON mode returns a JSON object, a
choice returns one of the choices, a logit bias of -100 on the greedy token changes it,
`continuous_usage_stats` puts usage in every chunk, harmless parameters are accepted and
bad grammars refused with a 400 naming them, and `n=4` gives four distinct seeded choices
that share the prompt's pages. On a tiny random model (same code, a byte
vocabulary): 200 hypothesis-drawn JSON schemas, each answered greedily and sampled, all
validate. Every page is back in the pool at the end.
"""

from __future__ import annotations

import json

import jsonschema
import msgspec
import openai
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from config.settings import PoolConfig, SchedulerConfig, ServerConfig, Settings
from tests.app.test_real_model import QUESTION, real_server, small_pool

pytestmark = pytest.mark.slow


class Capital(BaseModel):
    city: str
    country: str


def _pages_in_use(state) -> int:
    return sum(s.kv_pages_in_use for p in state.router.pools for s in p.stats())


async def test_structured_output_and_logit_bias_on_the_embedded_model(embedded_gguf):
    pool = small_pool(embedded_gguf)
    async with real_server(Settings(server=ServerConfig(port=0), pools=[pool])) as (url, state):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        model = "smollm2-135m-instruct"
        ask = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]

        parsed = await client.beta.chat.completions.parse(
            model=model, messages=ask, response_format=Capital, temperature=0, max_tokens=60)
        capital = parsed.choices[0].message.parsed
        assert isinstance(capital, Capital), parsed.choices[0].message.content
        assert parsed.choices[0].finish_reason == "stop"

        # LangChain's structured output (langchain-openai), as agent frameworks use it.
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(base_url=f"{url}/v1", api_key="none", model=model, temperature=0,
                         max_tokens=60, max_retries=0)
        chain = llm.with_structured_output(Capital, method="json_schema")
        # LangChain's async API needs asyncio; this test runs on trio: its sync API in a
        # thread, against the server in this one.
        answer = await trio.to_thread.run_sync(chain.invoke, ask[0]["content"])
        assert isinstance(answer, Capital)

        r = await client.chat.completions.create(
            model=model, messages=ask, temperature=0, max_tokens=60,
            response_format={"type": "json_object"})
        assert isinstance(json.loads(r.choices[0].message.content), dict)

        # The Responses API's `text.format` (app/responses.py): the SDK's parse, and its
        # stream, whose final response carries the same answer.
        resp = await client.responses.parse(model=model, input=ask[0]["content"],
                                            text_format=Capital, temperature=0,
                                            max_output_tokens=60)
        assert resp.status == "completed" and isinstance(resp.output_parsed, Capital), resp
        async with client.responses.stream(model=model, input=ask[0]["content"],
                                           text_format=Capital, temperature=0,
                                           max_output_tokens=60) as s:
            final = await s.get_final_response()
        assert final.output_text == resp.output_text
        assert final.output_parsed == resp.output_parsed

        r = await client.chat.completions.create(
            model=model, messages=QUESTION, temperature=0.7, seed=3, max_tokens=10,
            extra_body={"guided_choice": ["Paris", "Lyon", "not sure"]})
        assert r.choices[0].message.content in ("Paris", "Lyon", "not sure")
        r = await client.completions.create(
            model=model, prompt="The year was", temperature=0, max_tokens=8,
            extra_body={"structured_outputs": {"regex": " [12][0-9]{3}"}})
        assert len(r.choices[0].text) == 5 and r.choices[0].text[1:].isdigit(), r

        # logit_bias: -100 on the greedy first token makes it another one.
        first = await client.chat.completions.create(
            model=model, messages=QUESTION, temperature=0, max_tokens=1, logprobs=True)
        greedy = first.choices[0].logprobs.content[0]
        token_id = state.router.pools[0].tokenizer.encode(greedy.token)[0]
        biased = await client.chat.completions.create(
            model=model, messages=QUESTION, temperature=0, max_tokens=1, logprobs=True,
            logit_bias={str(token_id): -100})
        assert biased.choices[0].logprobs.content[0].token != greedy.token

        # Usage in every chunk; harmless parameters accepted.
        stream = await client.chat.completions.create(
            model=model, messages=QUESTION, temperature=0, max_tokens=5, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            store=False, metadata={"team": "a"}, parallel_tool_calls=False,
            extra_body={"reasoning_effort": "low"})
        chunks = [c async for c in stream]
        assert all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 5

        # Refused, naming the parameter.
        for body, param in [
            ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {
                    "a": {"type": "no-such-type"}}}}}}, "response_format.json_schema.schema"),
            ({"guided_regex": "(unclosed"}, "guided_regex"),
            ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
            ({"logit_bias": {"99999999": 1}}, "logit_bias"),
            ({"store": True}, "store"),
        ]:
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model=model, messages=QUESTION,
                                                     max_tokens=4, extra_body=body)
            assert err.value.body["param"] == param, err.value.body
        # n=4: distinct seeded choices, the prompt counted once and its pages shared.
        system = {"role": "system", "content": "You are a helpful assistant. " * 40}
        messages = [system, *QUESTION]

        async def most_pages(**kw) -> tuple[int, list]:
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=16, temperature=1.0, seed=5,
                stream=True, stream_options={"include_usage": True}, **kw)
            most, chunks = 0, []
            async for c in stream:
                chunks.append(c)
                most = max(most, _pages_in_use(state))
            return most, chunks

        one, _ = await most_pages()
        four, chunks = await most_pages(n=4)
        texts = {i: "" for i in range(4)}
        for c in chunks:
            for ch in c.choices:
                texts[ch.index] += ch.delta.content or ""
        assert len(set(texts.values())) == 4, texts
        usage = chunks[-1].usage
        assert usage.prompt_tokens == len(state.router.pools[0].tokenizer.encode_chat(
            [m for m in messages]))
        assert four < 4 * one, (four, one)
        again = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=1.0, seed=5, n=4)
        assert [c.message.content for c in again.choices] == [texts[i] for i in range(4)]
        await client.close()
        assert _pages_in_use(state) == 0


# ------------------------------------------------------------- random schemas, tiny model
SHORT = st.text(alphabet="abcxyz ", min_size=1, max_size=4)
NAMES = st.text(alphabet="abcdefgh", min_size=1, max_size=5)


def _leaf():
    bounded = st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})
    strings = st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n})
    return st.one_of(
        bounded, strings, st.just({"type": "boolean"}), st.just({"type": "null"}),
        st.lists(SHORT, min_size=1, max_size=4, unique=True).map(lambda e: {"enum": e}),
        st.lists(st.integers(0, 9), min_size=1, max_size=3, unique=True).map(
            lambda e: {"enum": e}))


def _compound(children):
    objects = st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req,
                         "additionalProperties": False}))
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1],
                   "maxItems": t[1] + t[2]})
    unions = st.lists(children, min_size=2, max_size=3).map(lambda a: {"anyOf": a})
    return st.one_of(objects, arrays, unions)


SCHEMAS = st.recursive(_leaf(), _compound, max_leaves=6)


@settings(max_examples=1, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(schemas=st.lists(SCHEMAS, min_size=200, max_size=200, unique_by=json.dumps))
def test_200_random_schemas_validate_greedy_and_sampled(schemas):
    trio.run(_answer_all, schemas)


async def _answer_all(schemas: list[dict]) -> None:
    pool = PoolConfig(model="random:tiny", served_model_names=["tiny"], max_context=1024,
                      page_size=16, kv_cache_bytes=64 << 20, decode_buckets=[16],
                      prefill_buckets=[64], mixed_decode_buckets=[16], dtype="float32",
                      # Throughput, not latency, here: no TTFT target to refuse at.
                      scheduler=SchedulerConfig(max_running=16, ttft_target_s=0.0,
                                                queue_deadline_s=600.0))
    settings_ = Settings(server=ServerConfig(port=0), pools=[pool])
    async with real_server(settings_) as (url, state):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        failures: list[str] = []
        limit = trio.Semaphore(16)

        async def one(i: int, schema: dict, temperature: float) -> None:
            async with limit:
                r = await client.completions.create(
                    model="tiny", prompt=f"record {i}:", max_tokens=600,
                    temperature=temperature, seed=i,
                    extra_body={"guided_json": schema})
            text, reason = r.choices[0].text, r.choices[0].finish_reason
            try:
                jsonschema.validate(json.loads(text), schema)
                assert reason == "stop", reason
            except (ValueError, AssertionError, jsonschema.ValidationError) as e:
                failures.append(f"{json.dumps(schema)} ({temperature}): {text!r}: {e}")

        async with trio.open_nursery() as nursery:
            for i, schema in enumerate(schemas):
                for temperature in (0.0, 1.0):
                    nursery.start_soon(one, i, schema, temperature)
        await client.close()
        assert not failures, f"{len(failures)} of {2 * len(schemas)}:\n" + "\n".join(
            failures[:5])
        assert state.router.pools[0].grammars.compiles <= len(schemas)
        assert _pages_in_use(state) == 0


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string"},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}


async def test_tool_calls_on_the_embedded_model(embedded_gguf):
    """`tool_choice="required"`: 100 of 100 sampled calls carry arguments valid against the
    function's schema (the answer is constrained to a call); streamed, the call arrives as
    a tool_calls delta; the Agents-style loop (a call, the tool's result, an answer);
    LangChain's `bind_tools` reads the calls back. Every page is back in the pool."""
    small = small_pool(embedded_gguf)  # 16 streams at once: the hundred calls go faster
    pool = msgspec.structs.replace(
        small, decode_buckets=[16], mixed_decode_buckets=[16],
        scheduler=msgspec.structs.replace(small.scheduler, max_running=16))
    async with real_server(Settings(server=ServerConfig(port=0), pools=[pool])) as (url, state):
        # (The strict door may refuse some of 16 cold prompts at once, with a Retry-After:
        # the client waits it out and retries, as the openai client does by default.)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=4)
        model = "smollm2-135m-instruct"
        ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
        schema = WEATHER["function"]["parameters"]
        results = []
        limit = trio.CapacityLimiter(16)  # the pool's running slots

        async def one(i: int) -> None:
            async with limit:
                results.append(await client.chat.completions.create(
                    model=model, messages=ask, tools=[WEATHER], tool_choice="required",
                    parallel_tool_calls=False, temperature=1.0, seed=i, max_tokens=80))

        async with trio.open_nursery() as nursery:
            for i in range(100):
                nursery.start_soon(one, i)
        for r in results:
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schema)
        assert len(results) == 100

        stream = await client.chat.completions.create(
            model=model, messages=ask, tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, temperature=0, max_tokens=80, stream=True)
        chunks = [c async for c in stream]
        calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        plain = await client.chat.completions.create(
            model=model, messages=ask, tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, temperature=0, max_tokens=80)
        assert plain.choices[0].message.tool_calls[0].function.arguments \
            == calls[0].function.arguments

        # The loop an agent runs: the call, the tool's result, then an answer in words.
        call = plain.choices[0].message.tool_calls[0]
        answer = await client.chat.completions.create(model=model, tools=[WEATHER],
                                                      temperature=0, max_tokens=40, messages=[
            *ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}],
            tool_choice="none")
        assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls

        # The Responses API's function tools: a function_call item, its result sent back
        # as a function_call_output on the stored response, then an answer; streamed, the
        # call's arguments arrive in the function_call_arguments events.
        rt = [{"type": "function", "name": "get_weather", "parameters": schema,
               "description": WEATHER["function"]["description"]}]
        resp = await client.responses.create(
            model=model, input=ask[0]["content"], tools=rt, tool_choice="required",
            parallel_tool_calls=False, temperature=0, max_output_tokens=80)
        (fc,) = [o for o in resp.output if o.type == "function_call"]
        assert fc.name == "get_weather" and resp.status == "completed"
        jsonschema.validate(json.loads(fc.arguments), schema)
        follow = await client.responses.create(
            model=model, previous_response_id=resp.id, tools=rt, tool_choice="none",
            input=[{"type": "function_call_output", "call_id": fc.call_id,
                    "output": "18 C and sunny"}], temperature=0, max_output_tokens=40)
        assert follow.output_text and not [o for o in follow.output
                                           if o.type == "function_call"]
        stream = await client.responses.create(
            model=model, input=ask[0]["content"], tools=rt, tool_choice="required",
            parallel_tool_calls=False, temperature=0, max_output_tokens=80, stream=True)
        events = [e async for e in stream]
        (args,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert args.arguments == fc.arguments and events[-1].type == "response.completed"

        # LangChain's bind_tools (in a thread: its sync API; this test runs on trio).
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(base_url=f"{url}/v1", api_key="none", model=model, temperature=0,
                         max_tokens=80, max_retries=0)
        bound = llm.bind_tools([WEATHER], tool_choice="required")
        msg = await trio.to_thread.run_sync(bound.invoke, ask[0]["content"])
        assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
        jsonschema.validate(msg.tool_calls[0]["args"], schema)
        await trio.sleep(0.2)
        assert _pages_in_use(state) == 0
