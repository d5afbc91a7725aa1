"""The happy paths, through httpx and the official openai client (max_retries=0)."""

from __future__ import annotations

import json

import msgspec

from tests.app.harness import EOS, MODEL, VOCAB, assert_error, serve, sse_events


async def test_chat_non_streaming_openai_client():
    async with serve() as srv:
        client = srv.openai()
        r = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        # Chat prompts end with token 500; succ_rule then gives 501.. = letters of t % 26.
        assert r.choices[0].message.content == "hijkl"
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == "length"
        assert r.model == MODEL and r.object == "chat.completion"
        prompt = len("<user>hi") + 1
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt, 5)
        assert r.usage.total_tokens == prompt + 5
        await client.close()


async def test_chat_streaming_openai_client_with_usage():
    async with serve() as srv:
        client = srv.openai()
        stream = await client.chat.completions.create(
            model="fake-alias", messages=[{"role": "user", "content": "hi"}], max_tokens=7,
            stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "hijklmn"
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
        assert all(c.model == MODEL for c in chunks)
        await client.close()


async def test_completion_stops_at_eos_streaming_and_not():
    # A prompt ending in token EOS-3 generates EOS-2, EOS-1, then EOS: "stop" after 2 tokens
    # (the eos is counted as a completion token but not output).
    prompt = "ab" + chr(EOS - 3)
    async with serve() as srv, srv.client() as http:
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                     "max_tokens": 50})
        body = r.json()
        assert r.status_code == 200, body
        assert body["object"] == "text_completion"
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["choices"][0]["text"] == "jk"  # 997, 998 -> letters 9, 10
        assert body["usage"]["completion_tokens"] == 3


async def test_stop_token_ids_end_the_answer_like_eos():
    """vLLM's `stop_token_ids`: generation 'ab' + chr(EOS-9) runs EOS-8, EOS-7, ...; stop
    token EOS-6 ends it after two shown tokens, counted but not shown. An id outside the
    vocabulary is a 400 naming the parameter."""
    prompt = "ab" + chr(EOS - 9)
    async with serve() as srv, srv.client() as http:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 50,
                "stop_token_ids": [EOS - 6]}
        r = await http.post("/v1/completions", json=body)
        out = r.json()
        assert r.status_code == 200, out
        assert out["choices"][0]["finish_reason"] == "stop"
        assert out["usage"]["completion_tokens"] == 3
        assert len(out["choices"][0]["text"]) == 2
        r = await http.post("/v1/completions", json={**body, "stop_token_ids": [VOCAB + 5]})
        assert_error(r, 400, param="stop_token_ids", code="invalid_token_id")


async def test_completion_streaming_raw_sse_ends_with_done():
    async with serve() as srv, srv.client() as http:
        r = await http.post("/v1/completions", json={
            "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}})
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [msgspec.json.decode(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "efgh"
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                       "total_tokens": 7,
                                       "prompt_tokens_details": {"cached_tokens": 0}}


async def test_models_health_tokenize_detokenize_openapi():
    async with serve() as srv, srv.client() as http:
        models = (await http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL, "fake-alias"]
        assert models["data"][0]["max_model_len"] == 2048
        assert (await http.get("/health")).json() == {"status": "ok", "detail": "",
                                                      "warmup_remaining_shapes": 0}
        r = await http.post("/tokenize", json={"prompt": "abc"})
        assert r.json() == {"tokens": [97, 98, 99], "count": 3, "max_model_len": 2048}
        r = await http.post("/tokenize", json={"model": MODEL,
                                               "messages": [{"role": "user", "content": "x"}]})
        assert r.json()["tokens"][-1] == 500
        r = await http.post("/detokenize", json={"tokens": [0, 1, 2]})
        assert r.json() == {"prompt": "abc"}
        spec = (await http.get("/openapi.json")).json()
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                "/metrics", "/tokenize", "/detokenize", "/openapi.json"} <= set(spec["paths"])
        assert "ChatCompletionRequest" in spec["components"]["schemas"]


async def test_stop_strings_logprobs_and_seed():
    async with serve() as srv, srv.client() as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 10, "stop": ["kl"], "logprobs": True, "top_logprobs": 0,
                "seed": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
                "presence_penalty": 0.5, "frequency_penalty": -0.5, "priority": 3,
                "user": "someone", "n": 1}
        r = await http.post("/v1/chat/completions", json=body)
        out = r.json()
        assert r.status_code == 200, out
        assert out["choices"][0]["message"]["content"] == "hij"
        assert out["choices"][0]["finish_reason"] == "stop"
        lps = out["choices"][0]["logprobs"]["content"]
        assert [lp["token"] for lp in lps][:3] == ["h", "i", "j"]
        assert all(lp["logprob"] == -1.0 and lp["top_logprobs"] == [] for lp in lps)


async def test_metrics_names_and_labels():
    async with serve() as srv, srv.client() as http:
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "abc",
                                                     "max_tokens": 3, "stream": True})
        assert r.status_code == 200
        await srv.wait_idle()
        text = (await http.get("/metrics")).text
        names = {
            "histogram": ["time_to_first_token_seconds", "inter_token_latency_seconds",
                          "e2e_request_latency_seconds", "request_queue_time_seconds"],
            "gauge": ["num_requests_running", "num_requests_waiting",
                      "oldest_waiting_age_seconds", "kv_cache_usage_perc", "kv_pages_in_use",
                      "kv_pages_total", "engine_busy_fraction"],
            "counter": ["prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                        "requests_rejected", "prompt_tokens", "generation_tokens"],
        }
        for kind, metrics in names.items():
            for name in metrics:
                name += "_total" if kind == "counter" else ""
                assert f"# TYPE sluice:{name} {kind}" in text, name
        labels = f'{{model="{MODEL}",pool="test"}}'
        assert f"sluice:time_to_first_token_seconds_count{labels} 1.0" in text
        assert f"sluice:kv_pages_in_use{labels} 0.0" in text
        assert f"sluice:generation_tokens_total{labels} 3.0" in text
        assert f"sluice:prompt_tokens_total{labels} 3.0" in text


async def test_dead_engine_turns_health_and_requests_503():
    async with serve() as srv, srv.client() as http:
        runner = srv.pool.engines[0].runner
        runner.fail_next = 10  # three failed steps in a row kill the engine
        for _ in range(3):
            r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a",
                                                         "max_tokens": 2})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        r = await http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "engine_dead"
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert (await http.get("/metrics")).status_code == 200


async def test_health_and_metrics_say_what_is_still_warming():
    """While a replica still compiles shapes in the background the server serves: /health
    is 200 and says how many are left, /metrics has the count and the process's memory."""
    async with serve() as srv, srv.client() as http:
        srv.pool.engines[0].runner.warmup_remaining = 3
        health = (await http.get("/health")).json()
        assert health["status"] == "ok" and health["warmup_remaining_shapes"] == 3
        assert "3 step shapes still compiling" in health["detail"]
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "abc",
                                                     "max_tokens": 2})
        assert r.status_code == 200
        metrics = (await http.get("/metrics")).text
        assert 'sluice:warmup_remaining_shapes{model="fake-model",pool="test"} 3.0' in metrics
        rss = [line for line in metrics.splitlines()
               if line.startswith("process_resident_memory_bytes ")]
        assert rss and float(rss[0].split()[1]) > 10e6


async def test_n_choices_streamed_and_whole_with_usage_counting_the_prompt_once():
    """n=3 on the fake model: three choices, each with its index and finish_reason,
    interleaved in the stream; usage counts the prompt once and every choice's tokens;
    echo puts the prompt before each completion; every page comes back."""
    async with serve() as srv, srv.client() as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "n": 3, "seed": 1}
        r = await http.post("/v1/chat/completions", json=body)
        out = r.json()
        assert r.status_code == 200, out
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert {c["message"]["content"] for c in out["choices"]} == {"hijk"}
        assert all(c["finish_reason"] == "length" for c in out["choices"])
        prompt = out["usage"]["prompt_tokens"]
        assert out["usage"]["completion_tokens"] == 12
        assert out["usage"]["total_tokens"] == prompt + 12

        r = await http.post("/v1/chat/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        text = {i: "" for i in range(3)}
        finish = {}
        for c in chunks:
            for ch in c["choices"]:
                text[ch["index"]] += ch["delta"].get("content") or ""
                if ch["finish_reason"]:
                    finish[ch["index"]] = ch["finish_reason"]
        assert text == {i: "hijk" for i in range(3)} and finish == {i: "length" for i in range(3)}
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] == prompt
        assert r.text.endswith("data: [DONE]\n\n")

        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "abc",
                                                     "max_tokens": 2, "n": 2, "echo": True})
        assert [c["text"] for c in r.json()["choices"]] == ["abcwx", "abcwx"]
        await srv.wait_idle()
        assert srv.pages_in_use() == 0 and not srv.state.flights


async def test_the_bodies_guidellm_sends_are_served():
    """GuideLLM 0.8.1's request bodies, as its OpenAI backend builds them
    (backends/openai/request_handlers.py): streaming with `continuous_usage_stats`, a fixed
    output length through `max_completion_tokens` (chat) or `max_tokens` (completions),
    `stop: null` and `ignore_eos`. Every chunk carries the usage so far. (GuideLLM itself
    needs torch, transformers and datasets: not installed here; docs/api.md.)"""
    async with serve() as srv, srv.client() as http:
        common = {"model": MODEL, "stream": True, "stop": None, "ignore_eos": True,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        for path, body in [
            ("/v1/chat/completions", {**common, "max_completion_tokens": 5,
                                      "messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {**common, "max_tokens": 5, "prompt": "abc"}),
        ]:
            r = await http.post(path, json=body)
            assert r.status_code == 200, r.text
            chunks = [json.loads(e) for e in sse_events(r.text) if e != "[DONE]"]
            assert chunks and all("usage" in c for c in chunks), chunks
            assert chunks[-1]["usage"]["completion_tokens"] == 5
        await srv.wait_idle()
        assert srv.pages_in_use() == 0


async def test_echo_with_logprobs_scores_the_prompt_and_best_of_picks():
    """Completions' `echo` + `logprobs`: the prompt's tokens come first in the logprobs
    object (the first without a logprob, as OpenAI's), streamed in the first chunk of each
    choice; `max_tokens: 0` returns only the scored prompt (no completion tokens);
    `best_of` generates more sequences than it returns. (Scores are the fake runner's;
    tests/model checks them against the oracle, tests/app/test_scoring.py on the real
    model.) Every page comes back."""
    async with serve() as srv, srv.client() as http:
        comp = {"model": MODEL, "prompt": "abc", "echo": True, "logprobs": 1}
        r = await http.post("/v1/completions", json={**comp, "max_tokens": 2})
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"] == "abcwx"
        assert len(lp["tokens"]) == 3 + 2 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        # The fake runner scores position j's next token t as -(j + t / 1000).
        ids = srv.state.router.pools[0].tokenizer.encode("abc")
        assert lp["token_logprobs"][1:3] == [-(j + t / 1000) for j, t in enumerate(ids[1:])]
        assert lp["text_offset"] == sorted(lp["text_offset"])

        r = await http.post("/v1/completions", json={**comp, "max_tokens": 0})
        body = r.json()
        assert body["choices"][0]["text"] == "abc"
        assert body["choices"][0]["finish_reason"] == "length"
        assert len(body["choices"][0]["logprobs"]["tokens"]) == 3
        assert body["usage"]["completion_tokens"] == 0

        r = await http.post("/v1/completions", json={**comp, "max_tokens": 2, "n": 2,
                                                     "stream": True})
        chunks = [json.loads(e) for e in sse_events(r.text) if e != "[DONE]"]
        firsts = {}
        for c in chunks:
            for ch in c["choices"]:
                firsts.setdefault(ch["index"], ch)
        assert sorted(firsts) == [0, 1]
        for ch in firsts.values():
            assert ch["text"].startswith("abc")
            assert ch["logprobs"]["token_logprobs"][:3] == lp["token_logprobs"][:3]

        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "abc",
                                                     "max_tokens": 2, "best_of": 3})
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0]
        assert body["choices"][0]["logprobs"] is None  # ranked by them, not asked for
        assert body["usage"]["completion_tokens"] == 6  # all three sequences generated
        await srv.wait_idle()
        assert srv.pages_in_use() == 0
