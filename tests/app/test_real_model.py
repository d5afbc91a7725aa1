"""The acceptance demo on the real embedded SmolLM2: the official openai client (no retries)
streams a chat completion from the full server stack, says Paris, and counts usage right.

Same runner shapes as tests/model/test_real_model.py, so the persistent compilation cache
makes warmup quick after either has run once.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

import openai
import pytest
import trio

from app.guardrails import Guardrails
from app.loading import load_pools
from app.server import run_server
from app.state import Phase, ServerState
from app.tenants import Tenants
from config.settings import PoolConfig, SchedulerConfig, ServerConfig, Settings

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def small_pool(gguf) -> PoolConfig:
    """The embedded model in a few small shapes (the same as tests/model's real-model
    runner, so the persistent compilation cache serves both), in f32: these tests compare
    numbers across code paths (a scored prompt against its generation, a batch against a
    lone request) to f32's precision, which int8 weights with bf16 products do not keep
    (docs/benchmarks.md); the CPU's default, int8, serves the other real-model tests."""
    return PoolConfig(model=str(gguf), max_context=2048, page_size=16,
                      kv_cache_bytes=200 * 16 * 46080, decode_buckets=[4],
                      prefill_buckets=[64, 256], mixed_decode_buckets=[4], dtype="float32",
                      quantization="none",
                      scheduler=SchedulerConfig(max_running=4, max_step_tokens=260))


@asynccontextmanager
async def real_server(settings: Settings) -> AsyncIterator[tuple[str, ServerState]]:
    """The whole server on real pools, in this test's nursery: (url, state) once ready;
    drained at the end."""
    state = ServerState(settings, Tenants(list(settings.tenants)),
                        Guardrails(settings.guardrails))
    with trio.fail_after(900):
        async with trio.open_nursery() as nursery:
            url = (await nursery.start(lambda task_status: run_server(
                state, lambda: load_pools(settings, show_progress=False),
                handle_signals=False, task_status=task_status)))[0]
            while state.phase is Phase.LOADING:
                await trio.sleep(0.1)
            yield url, state
            state.request_drain()


async def test_openai_client_streams_paris_from_the_embedded_model(embedded_gguf):
    pool = small_pool(embedded_gguf)
    settings = Settings(server=ServerConfig(port=0), pools=[pool])
    async with real_server(settings) as (url, state):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        model = "smollm2-135m-instruct"
        stream = await client.chat.completions.create(
            model=model, messages=QUESTION, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert "Paris" in text, text
        assert chunks[0].choices[0].delta.role == "assistant"
        usage = chunks[-1].usage
        prompt_ids = state.router.pools[0].tokenizer.encode_chat(QUESTION)
        assert usage.prompt_tokens == len(prompt_ids)
        answer_ids = state.router.pools[0].tokenizer.encode(text)
        # The completion counts every generated token, the final <|im_end|> included.
        assert usage.completion_tokens == len(answer_ids) + 1
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

        r = await client.chat.completions.create(model=model, messages=QUESTION,
                                                 temperature=0)
        assert r.choices[0].message.content == text
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.prompt_tokens_details.cached_tokens > 0  # the prefix cache hit
        await client.close()
        assert sum(s.kv_pages_in_use for s in state.router.pools[0].stats()) == 0


async def test_openai_batch_round_trip_equals_interactive_greedy(embedded_gguf, tmp_path):
    """files.create + batches.create + batches.retrieve (polled) + files.content with the
    official client on the embedded model: each output equals the same request sent
    interactively (greedy)."""
    import json

    from config.settings import BatchConfig

    pool = small_pool(embedded_gguf)
    settings = Settings(server=ServerConfig(port=0), pools=[pool],
                        batches=BatchConfig(data_dir=str(tmp_path)))
    questions = ["What is the capital of France?", "Name a primary colour.",
                 "What is 2 + 2?", "Say hello in Spanish.", "What is the capital of Italy?",
                 "Name a planet."]
    model = "smollm2-135m-instruct"
    bodies = [{"model": model, "messages": [{"role": "user", "content": q}],
               "max_tokens": 12, "temperature": 0} for q in questions]
    lines = b"".join(json.dumps({"custom_id": f"q{i}", "method": "POST",
                                 "url": "/v1/chat/completions", "body": b}).encode() + b"\n"
                     for i, b in enumerate(bodies))
    async with real_server(settings) as (url, state):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        f = await client.files.create(file=("questions.jsonl", lines), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
        with trio.fail_after(300):
            while b.status not in ("completed", "failed", "expired", "cancelled"):
                await trio.sleep(0.5)
                b = await client.batches.retrieve(b.id)
        assert b.status == "completed" and b.request_counts.completed == len(bodies)
        out = [json.loads(x) for x in
               (await client.files.content(b.output_file_id)).text.splitlines()]
        got = {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"]
               for x in out}
        assert "Paris" in got["q0"]
        for i, body in enumerate(bodies):
            r = await client.chat.completions.create(**body)
            assert got[f"q{i}"] == r.choices[0].message.content, (i, got[f"q{i}"])
        await client.close()
