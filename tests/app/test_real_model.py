"""The acceptance demo on the real embedded SmolLM2: the official openai client (no retries)
streams a chat completion from the full server stack, says Paris, and counts usage right.

Same runner shapes as tests/model/test_real_model.py, so the persistent compilation cache
makes warmup quick after either has run once.
"""

from __future__ import annotations

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


async def test_openai_client_streams_paris_from_the_embedded_model(embedded_gguf):
    pool = PoolConfig(model=str(embedded_gguf), max_context=2048, page_size=16,
                      kv_cache_bytes=200 * 16 * 46080, decode_buckets=[4],
                      prefill_buckets=[64, 256], mixed_decode_buckets=[4], dtype="float32",
                      scheduler=SchedulerConfig(max_running=4, max_step_tokens=260))
    settings = Settings(server=ServerConfig(port=0), pools=[pool])
    state = ServerState(settings, Tenants([]), Guardrails(settings.guardrails))
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            url = (await nursery.start(lambda task_status: run_server(
                state, lambda: load_pools(settings, show_progress=False),
                handle_signals=False, task_status=task_status)))[0]
            while state.phase is Phase.LOADING:
                await trio.sleep(0.1)
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
            state.request_drain()
