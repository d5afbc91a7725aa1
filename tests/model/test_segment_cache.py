"""The system prompt tokenized once (model/segment_cache.py): a chat prompt's long pieces
between special tokens come from a cache, and the ids are exactly one whole encode's."""

from __future__ import annotations

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, models, normalizers, pre_tokenizers

from model import segment_cache
from model.segment_cache import MIN_CACHED_CHARS, SegmentEncoder
from model.tokenizer import Tokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


@pytest.fixture(scope="module")
def tok(embedded_model) -> Tokenizer:
    return embedded_model.tokenizer


def _whole(tok: Tokenizer, messages: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, True))


def test_a_system_prompt_is_tokenized_once_and_the_ids_are_the_same(tok: Tokenizer):
    enc = SegmentEncoder(tok.hf, tok.encode)  # a fresh cache, not the shared one
    assert enc.enabled
    system = "You are a careful assistant; answer in French.  " * 40  # ~2,000 characters
    for q in ["Where is parcel 1?", " leading space", "emoji 🎉\n\n", "<|im_end|> inside"]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        text = tok.apply_chat_template(messages, True)
        assert enc.encode(text) == _whole(tok, messages)
    assert (enc.hits, enc.misses) == (3, 1)  # the system prompt: encoded once
    # The shared tokenizer's chat path goes through it.
    before = tok.segments.hits + tok.segments.misses
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    assert tok.encode_chat(messages) == _whole(tok, messages)
    assert tok.segments.hits + tok.segments.misses == before + 1


_piece = st.one_of(
    st.sampled_from(SPECIALS + ["<|im_start", "|>", "<", "\n", " ", "  ", "\t"]),
    st.text(st.characters(max_codepoint=0x2FFFF, exclude_categories=("Cs",)), max_size=30),
)


@pytest.fixture(scope="module")
def shared(tok: Tokenizer) -> SegmentEncoder:
    return SegmentEncoder(tok.hf, tok.encode)  # (~0.1 s to build: once for the examples)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(st.lists(_piece, max_size=12), st.integers(0, 3))
def test_any_text_encodes_as_one_whole_encode(tok: Tokenizer, shared, pieces, long_piece):
    # Specials, their fragments and whitespace at every boundary; one piece is long enough
    # to be cached, and the text is encoded twice (the second from the cache).
    enc = shared
    pieces = list(pieces) + ["x" * (MIN_CACHED_CHARS // 2) + " é " * MIN_CACHED_CHARS]
    pieces.insert(min(long_piece, len(pieces)), "Ünïcode text, spaced  out\n" * 30)
    text = "".join(pieces)
    assert enc.encode(text) == tok.encode(text) == enc.encode(text)


def test_the_cache_is_bounded(tok: Tokenizer, monkeypatch):
    monkeypatch.setattr(segment_cache, "MAX_ENTRIES", 3)
    enc = SegmentEncoder(tok.hf, tok.encode)
    texts = [f"<|im_start|>system\n{i} " + "padding words " * 60 + "<|im_end|>"
             for i in range(5)]
    for t in texts:
        assert enc.encode(t) == tok.encode(t)
    assert len(enc._cache) == 3 and enc.misses == 5
    enc.encode(texts[-1])
    assert enc.hits == 1
    monkeypatch.setattr(segment_cache, "MAX_CACHED_TOKENS", 10)
    enc.encode(texts[0])  # over the token bound: everything older goes
    assert len(enc._cache) <= 1


def _bpe(pre, normalizer=None) -> tokenizers.Tokenizer:
    vocab = {c: i for i, c in enumerate(["[UNK]", "▁", "a", "b", " ", "<s>"])}
    t = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token="[UNK]"))
    t.pre_tokenizer = pre
    if normalizer is not None:
        t.normalizer = normalizer
    t.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    return t


@pytest.mark.parametrize("hf", [
    _bpe(pre_tokenizers.Metaspace(prepend_scheme="first")),  # only the first piece marked
    _bpe(pre_tokenizers.ByteLevel(add_prefix_space=True)),
    _bpe(pre_tokenizers.Whitespace(), normalizers.Lowercase()),
], ids=["metaspace", "byte-level-prefix-space", "normalizer"])
def test_tokenizers_whose_pieces_interact_encode_whole(hf):
    encode = lambda text: hf.encode(text, add_special_tokens=False).ids  # noqa: E731
    enc = SegmentEncoder(hf, encode)
    assert not enc.enabled
    text = "ab <s>" * MIN_CACHED_CHARS
    assert enc.encode(text) == encode(text) and enc.misses == 0


def test_added_tokens_that_strip_spaces_encode_whole():
    t = tokenizers.Tokenizer(models.BPE({"a": 0, " ": 1, "[UNK]": 2}, [], unk_token="[UNK]"))
    t.add_special_tokens([AddedToken("<x>", special=True, normalized=False, lstrip=True)])
    assert not SegmentEncoder(t, lambda s: t.encode(s).ids).enabled
