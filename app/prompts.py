"""The prompt of a completion request: the body's cross-field checks, the chat template
and tokenizing (off the event loop when it is long), and the checks on what comes out
(token ids in the vocabulary, not empty)."""

from __future__ import annotations

from typing import Sequence

import trio

from .errors import bad_request
from .pools import Pool
from . import tools
from .schemas import ChatCompletionRequest, ChatMessage, CompletionRequest

# Prompts longer than this many characters are tokenized in a worker thread, so a 4 MiB
# body does not stall every other stream on the event loop.
THREAD_TOKENIZE_CHARS = 20_000


async def tokenize(pool: Pool, req: ChatCompletionRequest | CompletionRequest
                    ) -> tuple[list[int], str]:
    """Prompt token ids, and the prompt's text for the input guardrail."""
    tok = pool.tokenizer
    if isinstance(req, ChatCompletionRequest):
        text = "\n".join(m.text() for m in req.messages)
        ids = await maybe_thread(len(text), encode_messages, pool, req.messages, req)
    elif isinstance(req.prompt, list) and all(isinstance(t, int) for t in req.prompt):
        ids = list(req.prompt)
        bad = [t for t in ids if not 0 <= t < pool.vocab_size]  # type: ignore[operator]
        if bad:
            raise bad_request(f"Token ids must be in [0, {pool.vocab_size}); got {bad[:5]}.",
                              param="prompt", code="invalid_token_id")
        text = tok.decode(ids)
    else:
        text = req.prompt if isinstance(req.prompt, str) else str(req.prompt[0])
        # As the model's file says (a BOS for Gemma and Llama; none for SmolLM2), as
        # llama.cpp's server and vLLM do for completions.
        ids = await maybe_thread(len(text), tok.encode, text, True)
    if not ids:
        raise bad_request("The prompt is empty.", param="prompt", code="empty_prompt")
    return list(ids), text


def encode_messages(pool: Pool, messages: Sequence[ChatMessage],
                    req: ChatCompletionRequest | None = None) -> list[int]:
    """Render the chat template and tokenize ("developer" is the template's "system"; a
    chat request's tools, calls and results as app/tools.py writes them)."""
    plain = tools.plain_messages(list(messages))
    if req is not None:
        plain = tools.render(req, plain)
    try:
        return pool.tokenizer.encode_chat(plain)
    except ValueError as e:  # the template refused (e.g. roles out of the order it wants)
        raise bad_request(f"The chat template cannot render these messages: {e}",
                          param="messages", code="invalid_messages") from None


async def maybe_thread(size: int, fn, *args):
    """`fn(*args)`, in a worker thread when `size` (characters or tokens) is big enough to
    stall the event loop."""
    if size < THREAD_TOKENIZE_CHARS:
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args)


def chat_checks(req: ChatCompletionRequest) -> int | None:
    if (wrong := tools.check(req)) is not None:
        raise bad_request(wrong[0], param=wrong[1])
    if req.max_tokens == 0:
        raise bad_request("`max_tokens` must be at least 1.", param="max_tokens")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("`top_logprobs` needs `logprobs` set to true.", param="top_logprobs")
    if (req.max_tokens is not None and req.max_completion_tokens is not None
            and req.max_tokens != req.max_completion_tokens):
        raise bad_request("`max_tokens` and `max_completion_tokens` disagree; send one.",
                          param="max_completion_tokens")
    return req.max_completion_tokens or req.max_tokens


def completion_checks(req: CompletionRequest) -> int | None:
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("`max_tokens` of 0 needs `echo` (it returns the prompt and, with "
                          "`logprobs`, the prompt's logprobs); otherwise at least 1.",
                          param="max_tokens")
    n = req.n or 1
    best_of = req.best_of or n
    if best_of < n:
        raise bad_request(f"`best_of` ({best_of}) must be at least `n` ({n}).",
                          param="best_of")
    if req.stream and best_of > n:
        raise bad_request("`best_of` above `n` cannot be streamed: the best are known only "
                          "at the end.", param="best_of")
    if isinstance(req.prompt, list):
        ints = all(isinstance(t, int) for t in req.prompt)
        one_str = len(req.prompt) == 1 and isinstance(req.prompt[0], str)
        if not (ints or one_str):
            raise bad_request("`prompt` must be one string or one list of token ids "
                              "(one prompt per request).", param="prompt")
    return req.max_tokens
