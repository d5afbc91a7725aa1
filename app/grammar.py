"""Structured output: a token mask per sampled token from a grammar, with llguidance.

A request that asks for JSON (a schema, or any object), a regex, one of a few strings or
a grammar carries a `GrammarConstraint`: before a step samples its sequence, the runner
has it write the allowed tokens into that row's bitmask (`fill`, in the step's worker
thread, never on the event loop), the sampler sets every other token's logit to -inf
on the device, and after the step the engine feeds it the sampled token (`accept`).
Constrained and free sequences share every step; a free one costs nothing.

llguidance (Rust, no torch) computes a mask in microseconds for JSON-schema grammars on
this vocabulary; xgrammar, the other well-kept engine, needs torch, transformers and
triton at install, which a JAX server does not carry (docs/api.md, "Structured output").

`Grammars` is one tokenizer's: its llguidance tokenizer is built once, lazily (0.5 s
for a 49k vocabulary), and each distinct grammar is compiled once and kept (LRU); a
sequence gets a copy of the compiled matcher.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np

import llguidance

# JSON as the schema says, and no free whitespace: a small model given the freedom of
# "any whitespace" can spend its whole budget on newlines.
JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar this engine cannot compile (the message says what and where)."""


def json_schema_grammar(schema: dict | bool) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                             defaults=JSON_DEFAULTS)
    except (ValueError, TypeError, RuntimeError) as e:
        raise GrammarError(f"JSON schema: {e}") from None


def regex_grammar(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of `choices`."""
    return llguidance.grammar_from("choice", json.dumps(choices))


def ebnf_grammar(text: str) -> str:
    """A GBNF grammar (llama.cpp's and vLLM's `guided_grammar` syntax) or a Lark one."""
    try:
        return llguidance.grammar_from("grammar", text)
    except (ValueError, TypeError, RuntimeError) as e:
        raise GrammarError(f"grammar: {e}") from None


class GrammarConstraint:
    """One sequence's place in its grammar."""

    __slots__ = ("_matcher", "error")

    def __init__(self, matcher) -> None:
        self._matcher = matcher
        self.error: str | None = None

    def fill(self, row: np.ndarray) -> None:
        """Write the tokens allowed next into `row` (int32 words, bit i of word w for
        token 32 * w + i)."""
        assert row.dtype == np.int32 and row.flags["C_CONTIGUOUS"]
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False (and `error` set) if the grammar refuses
        it, which the mask prevents unless the token was forced past it."""
        if self._matcher.consume_token(token_id):
            return True
        self.error = self._matcher.get_error() or f"token {token_id} is not allowed here"
        return False

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (the answer is over)."""
        return self._matcher.is_stopped()

    # Speculative decoding (scheduler/speculative.py): proposals are checked against the
    # grammar before they are verified, and each verify row samples under the mask the
    # grammar would have after the proposals before it.
    def valid_prefix(self, tokens) -> int:
        """How many of `tokens`, in order, the grammar allows from here (it does not move)."""
        return self._matcher.validate_tokens(list(tokens))

    def after(self, tokens) -> "_After":
        """This constraint as it would be after `tokens` (allowed: `valid_prefix`), for
        one `fill`; the state itself does not move."""
        return _After(self._matcher, list(tokens))


class _After:
    """A grammar's mask after some proposed tokens: consumed, the mask written, rolled back
    (in the step's worker thread, before the engine feeds the sampled tokens)."""

    __slots__ = ("_matcher", "_tokens")

    def __init__(self, matcher, tokens: list[int]) -> None:
        self._matcher = matcher
        self._tokens = tokens

    def fill(self, row: np.ndarray) -> None:
        m = self._matcher
        n = m.try_consume_tokens(self._tokens)
        try:
            if n == len(self._tokens):
                m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            else:  # (never planned: proposals are cut where the grammar refuses them)
                row[:] = 0
        finally:
            if n:
                m.rollback(n)


class Grammars:
    """Compiles grammars for one tokenizer and hands out constraints (thread-safe)."""

    def __init__(self, tokenizer, vocab_size: int, *, cache_size: int = 256) -> None:
        """`tokenizer`: model.tokenizer.Tokenizer (its `hf` Rust tokenizer and eos ids)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltok = None
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiles = 0

    def _ll_tokenizer(self):
        if self._lltok is None:
            try:
                self._lltok = llguidance.LLTokenizer(
                    self._tokenizer.hf.to_str(), n_vocab=self.vocab_size,
                    eos_token=sorted(self._tokenizer.eos_token_ids))
            except Exception as e:  # no Hugging Face tokenizer behind it, or one it refuses
                raise GrammarError(f"this model's tokenizer cannot drive structured output "
                                   f"({type(e).__name__}: {e})") from None
        return self._lltok

    def constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh constraint for `grammar` (compiled once; GrammarError if it cannot be).
        May take milliseconds to seconds for a big schema: call it off the event loop."""
        with self._lock:
            lltok = self._ll_tokenizer()
            matcher = self._compiled.get(grammar)
            if matcher is not None:
                self._compiled.move_to_end(grammar)
            else:
                try:
                    matcher = llguidance.LLMatcher(lltok, grammar)
                except (ValueError, TypeError, RuntimeError) as e:
                    raise GrammarError(str(e)) from None
                if matcher.is_error():
                    raise GrammarError(matcher.get_error())
                self.compiles += 1
                self._compiled[grammar] = matcher
                while len(self._compiled) > self._cache_size:
                    self._compiled.popitem(last=False)
            return GrammarConstraint(matcher.deep_copy())
