"""Prompt scoring (completions' `echo` with `logprobs`, `max_tokens: 0`) and `best_of` on
the real embedded model, through the official openai client.

The prompt's logprobs come from the steps that prefill it (model/runner.py, `_score`);
the generated tokens' from the sampler. Scoring a prompt that is a greedy answer must
give back the logprobs the answer was generated with: two code paths, one model.
"""

from __future__ import annotations

import openai
import pytest

from config.settings import ServerConfig, Settings
from tests.app.test_real_model import real_server, small_pool

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"


async def test_scored_prompt_gives_back_the_answers_logprobs_and_best_of_picks_the_best(
        embedded_gguf):
    pool = small_pool(embedded_gguf)
    async with real_server(Settings(server=ServerConfig(port=0), pools=[pool])) as (url, state):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        tok = state.router.pools[0].tokenizer
        # Long enough to be prefilled in several chunks of the 64-token shape.
        prompt = tok.encode("The history of the river begins in the mountains, where "
                            "snow melts every spring and feeds small streams. " * 3)
        gen = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                              temperature=0, logprobs=1,
                                              extra_body={"ignore_eos": True})
        answer = gen.choices[0].logprobs
        answer_ids = tok.encode(gen.choices[0].text)

        scored = await client.completions.create(model=MODEL, prompt=prompt + answer_ids,
                                                 max_tokens=0, echo=True, logprobs=2,
                                                 temperature=0)
        choice = scored.choices[0]
        lp = choice.logprobs
        n = len(prompt) + len(answer_ids)
        assert len(lp.tokens) == n and lp.token_logprobs[0] is None
        assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
        assert scored.usage.completion_tokens == 0
        assert scored.usage.prompt_tokens_details.cached_tokens == 0  # computed whole
        assert len(answer_ids) == len(answer.tokens)  # the answer re-tokenizes the same
        assert lp.tokens[len(prompt):] == answer.tokens
        assert lp.token_logprobs[len(prompt):] == pytest.approx(
            answer.token_logprobs, abs=2e-3)
        for text, tops in zip(answer.tokens, lp.top_logprobs[len(prompt):]):
            assert len(tops) <= 2 and max(tops, key=tops.get) == text  # greedy: top-1

        # best_of=3 returns, of three seeded samples, the one with the best mean logprob:
        # the same three as n=3 with the same seed (choice i draws from seed + i).
        body = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                    seed=7, extra_body={"ignore_eos": True})
        three = await client.completions.create(n=3, logprobs=0, **body)
        means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)
                 for c in three.choices]
        best = await client.completions.create(best_of=3, **body)
        assert len(best.choices) == 1 and best.choices[0].logprobs is None
        assert best.choices[0].text == three.choices[means.index(max(means))].text
        assert best.usage.completion_tokens == 24
        await client.close()
        assert sum(s.kv_pages_in_use for s in state.router.pools[0].stats()) == 0
