"""The system prompt is tokenized once: token ids of long text segments between added
tokens, cached.

Every request of a customer carries the same ~2,000-token system prompt. The KV cache
reads it once (scheduler/pages.py), but before this the server still tokenized it for
every request: 9 ms of BPE on the event loop here, while the rest of a refused or
admitted request's handling costs ~2 ms (docs/history/benchmarks-log.md, "Issue 16: a door that
calibrates itself").

A chat template renders each message between special tokens (`<|im_start|>system\\n ...
<|im_end|>`), and `tokenizers` splits its input on its added tokens before it normalizes
or pre-tokenizes anything: the ids of the text between two added tokens do not depend on
what is around it. So the rendered prompt is split on the added tokens here the same way
(leftmost-longest), each long piece's ids come from a small LRU cache, and the pieces'
ids are concatenated: the same ids as one `encode` of the whole text.

That independence holds only where nothing works across the split: no normalizer (one
that prepends or strips would act per piece and per text alike, but the rules are
subtle), no Metaspace pre-tokenizer (its "first" scheme marks only the text's first
piece), no byte-level prefix space, and added tokens matched as written (not normalized,
no lstrip/rstrip/single_word). Any other tokenizer encodes whole, as before; a probe at
construction checks the split against the whole text too.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Callable

import tokenizers

# Pieces shorter than this are encoded every time (a question, a role name): caching them
# would churn the cache for nothing. A system prompt is thousands of characters.
MIN_CACHED_CHARS = 512
MAX_ENTRIES = 256  # distinct long pieces kept (system prompts, few-shot blocks, documents)
MAX_CACHED_TOKENS = 2_000_000  # and their token ids in all (~16 bytes each in Python lists)


def _splittable(hf: tokenizers.Tokenizer) -> bool:
    """Whether encoding text piece by piece between added tokens equals one encode."""
    spec = json.loads(hf.to_str())
    if spec.get("normalizer") is not None:
        return False

    def plain(node) -> bool:
        if isinstance(node, dict):
            kind = node.get("type")
            if kind == "Metaspace" or (kind == "ByteLevel" and node.get("add_prefix_space")):
                return False
            return all(plain(v) for v in node.values())
        if isinstance(node, list):
            return all(plain(v) for v in node)
        return True

    if not plain(spec.get("pre_tokenizer")):
        return False
    return all(not (t.normalized or t.lstrip or t.rstrip or t.single_word)
               for t in hf.get_added_tokens_decoder().values())


class SegmentEncoder:
    """`encode(text)`: the ids of `text`, its long pieces between added tokens from a
    cache. Thread-safe (prompts are tokenized on the event loop and in worker threads).
    `hits` / `misses` count cached pieces looked up."""

    def __init__(self, hf: tokenizers.Tokenizer, encode: Callable[[str], list[int]]) -> None:
        self._encode = encode  # whole-text encode (no special tokens added)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._tokens = 0
        self.hits = self.misses = 0
        added = {t.content: i for i, t in hf.get_added_tokens_decoder().items()}
        self._ids = added
        self._split: re.Pattern | None = None
        if added and _splittable(hf):
            # Longest first: at one position the regex takes the first alternative that
            # matches, which is then the longest (tokenizers matches leftmost-longest).
            alts = sorted(added, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(map(re.escape, alts)) + ")")
            if not self._probe(alts[-1]):
                self._split = None

    @property
    def enabled(self) -> bool:
        return self._split is not None

    def _probe(self, token: str) -> bool:
        text = f"Hi  {token}\n  there {token}{token} x{token}ok\n\n"
        return self._pieces(text, cache=False) == self._encode(text)

    def encode(self, text: str) -> list[int]:
        if self._split is None or len(text) < MIN_CACHED_CHARS:
            return self._encode(text)
        return self._pieces(text, cache=True)

    def _pieces(self, text: str, *, cache: bool) -> list[int]:
        out: list[int] = []
        ids = self._ids
        for k, piece in enumerate(self._split.split(text)):  # type: ignore[union-attr]
            if k % 2:  # the captured separators: an added token
                out.append(ids[piece])
            elif piece:
                out.extend(self._cached(piece) if cache and len(piece) >= MIN_CACHED_CHARS
                           else self._encode(piece))
        return out

    def _cached(self, piece: str) -> tuple[int, ...]:
        with self._lock:
            hit = self._cache.get(piece)
            if hit is not None:
                self._cache.move_to_end(piece)
                self.hits += 1
                return hit
            self.misses += 1
        ids = tuple(self._encode(piece))  # outside the lock: BPE releases the GIL
        with self._lock:
            if piece not in self._cache:
                self._cache[piece] = ids
                self._tokens += len(ids)
                while self._cache and (len(self._cache) > MAX_ENTRIES
                                       or self._tokens > MAX_CACHED_TOKENS):
                    _, old = self._cache.popitem(last=False)
                    self._tokens -= len(old)
        return ids
