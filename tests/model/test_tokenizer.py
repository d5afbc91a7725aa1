"""Tokenizer, chat template and streaming detokenizer (real SmolLM2 vocabulary + synthetic)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model.loaders.gguf_tokenizer import tokenizer_from_gguf
from model.tokenizer import ChatTemplateError, Tokenizer

gguf = pytest.importorskip("gguf")  # absent on the accelerator image (docs/stack.md)

TEXTS = {
    "ascii": "Hello, world! The quick brown fox jumps over the lazy dog.",
    "digits": "Pi is 3.14159, the year 2024, and 1,000,000 ants.",
    "cjk": "日本語のテキスト 你好世界 한국어 텍스트",
    "emoji": "👨‍👩‍👧‍👦 family 🎉🇫🇷 flag 🤖",
    "whitespace": "  leading\t\ttabs\n\n\n   spaces   \r\n trailing  ",
    "chatml": "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "mixed": "naïve café — “quotes” ½ ∑ x² <|endoftext|> done",
}


@pytest.fixture(scope="module")
def tok(embedded_model) -> Tokenizer:
    return embedded_model.tokenizer


def test_embedded_metadata(tok: Tokenizer):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.id_to_token(1) == "<|im_start|>"
    assert tok.eos_token_ids == frozenset({0, 2})  # <|im_end|> and <|endoftext|>
    assert tok.id_to_token(49151) is not None and tok.id_to_token(49152) is None


@pytest.mark.parametrize("name", list(TEXTS))
def test_round_trip(tok: Tokenizer, name: str):
    text = TEXTS[name]
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    # Our byte-table decode agrees with the tokenizers library's own decoder.
    assert tok.decode(ids, False) == tok.hf.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True)


def test_digits_split_one_by_one(tok: Tokenizer):
    ids = tok.encode("12345")
    assert [tok.id_to_token(i) for i in ids] == list("12345")


def test_chatml_specials_are_single_tokens(tok: Tokenizer):
    ids = tok.encode(TEXTS["chatml"])
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1
    assert tok.decode(ids) == "user\nhi there\nassistant\n"  # specials skipped
    # Text that merely looks like a special token inside a word is still matched whole,
    # while a broken marker is plain text.
    assert 2 not in tok.encode("<|im_end|")


def _check_stream(tok: Tokenizer, ids: list[int]) -> None:
    """Every prefix: pushes never show U+FFFD or change, and pushes + flush == decode."""
    full = tok.decode(ids)
    dec = tok.incremental([])
    streamed = ""
    for k, i in enumerate(ids, 1):
        piece = dec.push(i)
        assert "\ufffd" not in piece
        streamed += piece
        assert full.startswith(streamed)
        probe = tok.incremental([])
        text = "".join(probe.push(j) for j in ids[:k]) + probe.flush()
        assert text == tok.decode(ids[:k])
    assert streamed + dec.flush() == full


@pytest.mark.parametrize("name", ["emoji", "cjk", "mixed", "chatml"])
def test_incremental_matches_decode(tok: Tokenizer, name: str):
    ids = tok.encode(TEXTS[name])
    if name in ("emoji", "cjk"):  # the case that matters: characters split over tokens
        partial = [i for i in ids if _is_partial_utf8(tok.token_bytes(i))]
        assert partial, "expected byte tokens that are not valid UTF-8 on their own"
    _check_stream(tok, ids)


def _is_partial_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_incremental_after_prompt_that_ends_mid_character(tok: Tokenizer):
    ids = tok.encode("🎉")
    assert len(ids) >= 2
    dec = tok.incremental(tok.encode("Party: ") + ids[:1])
    out = "".join(dec.push(i) for i in ids[1:]) + dec.flush()
    assert out == "🎉"


def test_incremental_special_tokens_are_silent(tok: Tokenizer):
    dec = tok.incremental([1])
    assert [dec.push(i) for i in (2, 0, 1)] == ["", "", ""]
    assert dec.push(10_000_000) == ""  # ids beyond the vocabulary are ignored
    assert dec.flush() == ""


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    st.text(
        st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs",),
                      exclude_characters="\x04\x06\x13\x14\x16\x1d"),
        max_size=40,
    )
)
def test_round_trip_any_text(tok: Tokenizer, text: str):
    # SmolLM2's vocabulary has no token for some bytes (a few C0 controls, and 0xF1+
    # leads of code points past U+3FFFF); like the HF tokenizer, those are dropped.
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    dec = tok.incremental([])
    pieces = [dec.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text
    assert "".join(pieces) + dec.flush() == tok.decode(ids)


def test_lone_surrogate_becomes_replacement_character(tok: Tokenizer):
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffdb"


def test_chat_template_default_system(tok: Tokenizer):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    own = [{"role": "system", "content": "Be brief."}] + msgs
    text = tok.apply_chat_template(own, add_generation_prompt=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    )
    ids = tok.encode_chat(msgs)
    assert ids[0] == 1 and ids[-3:] == tok.encode("<|im_start|>assistant\n")[-3:]


def test_chat_template_sandbox_and_raise_exception():
    t = Tokenizer.byte_level()
    t.chat_template = (
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ bos_token }}{{ messages[0]['content'] }}"
    )
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"
    with pytest.raises(ChatTemplateError, match="one message only"):
        t.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    for evil in ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ messages.append(1) }}"):
        t = Tokenizer.byte_level()
        t.chat_template = evil
        with pytest.raises(ChatTemplateError):
            t.apply_chat_template([{"role": "user", "content": "x"}])


def test_chatml_fallback_and_byte_level_tokenizer():
    t = Tokenizer.byte_level(272)
    assert t.vocab_size == 272 and t.eos_token_ids == frozenset({0, 2})
    msgs = [{"role": "user", "content": "héllo 🎉"}]
    text = t.apply_chat_template(msgs)
    assert text == "<|im_start|>user\nhéllo 🎉<|im_end|>\n<|im_start|>assistant\n"
    ids = t.encode_chat(msgs)
    assert ids[0] == 1 and t.decode(ids, skip_special_tokens=False) == text
    _check_stream(t, t.encode("héllo 🎉 日本"))


def test_from_hf_dir(tmp_path, tok: Tokenizer):
    tok.hf.save(str(tmp_path / "tokenizer.json"))
    cfg = {
        "bos_token": {"content": "<|im_start|>"},
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "tool_use", "template": "x"},
            {"name": "default", "template": "{{ messages[0]['content'] }}!"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    t = Tokenizer.from_hf_dir(tmp_path)
    assert t.bos_token_id == 1 and t.eos_token_ids == frozenset({0, 2, 7})
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
    assert t.encode(TEXTS["digits"]) == tok.encode(TEXTS["digits"])


def test_save_hf_dir_reads_back_the_same(tmp_path, tok: Tokenizer):
    """`sluice export-tokenizer`'s directory (for GuideLLM, lm-eval): the same ids, chat
    prompt and special tokens when read back."""
    t = Tokenizer.from_hf_dir(tok.save_hf_dir(tmp_path / "tok", model_max_length=8192))
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert t.encode_chat(chat) == tok.encode_chat(chat)
    for text in TEXTS.values():
        assert t.encode(text) == tok.encode(text)
    assert (t.bos_token_id, t.eos_token_ids) == (tok.bos_token_id, tok.eos_token_ids)
    cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["model_max_length"] == 8192


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("smollm", ["1", "2", "3", "4", "5", "Ġab"]),
        ("llama-bpe", ["123", "45", "Ġab"]),
        ("qwen2", ["1", "2", "3", "4", "5", "Ġab"]),
        ("gpt2", ["12345", "Ġab"]),
    ],
)
def test_gguf_pre_tokenizers(tmp_path, pre, pieces):
    path = tmp_path / "t.gguf"
    byte = Tokenizer.byte_level()
    tokens = [byte.id_to_token(i) for i in range(byte.vocab_size)]
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens + ["ab", "Ġab"])
    w.add_token_types([3, 3, 3] + [1] * 258)
    w.add_token_merges(["a b", "Ġ ab"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    _finish(w)
    t = tokenizer_from_gguf(path)
    assert [p for p, _ in t.hf.pre_tokenizer.pre_tokenize_str("12345 ab")] == pieces
    ids = t.encode("12345 ab")
    assert ids[-1] == 260 and t.decode(ids) == "12345 ab"  # "Ġab" through two merges


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_sentencepiece_vocab(tmp_path):
    """Llama 2 / Mistral style: pieces with scores, byte fallback, '▁' for spaces."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "▁he", "▁hello",
             "▁w", "or", "ld", "▁wor", "▁world"]  # fmt: skip
    tokens = pieces + words
    scores = [0.0] * len(pieces) + [-float(i) for i in range(len(words))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    _finish(w)
    t = tokenizer_from_gguf(path)
    ids = t.encode("hello world")
    assert [t.id_to_token(i) for i in ids] == ["▁hello", "▁world"]
    assert t.encode("hello", add_special_tokens=True)[0] == 1
    assert t.decode(ids) == "hello world" == t.hf.decode(ids)
    ids = t.encode("héllo")  # é is not a piece: two byte-fallback tokens
    assert "<0xC3>" in [t.id_to_token(i) for i in ids]
    assert t.decode(ids) == "héllo"
    _check_stream(t, ids)
    dec = t.incremental([1, *t.encode("hello")])  # a continuation keeps its leading space
    assert "".join(dec.push(i) for i in t.encode("world")) + dec.flush() == " world"
    assert t.eos_token_ids == frozenset({2})


def test_token_bytes_table_matches_tokenizers(tok: Tokenizer):
    """Our per-token bytes decode like the tokenizers library does (sample of the vocab)."""
    rng = np.random.default_rng(0)
    ids = [int(i) for i in rng.choice(tok.vocab_size, 2000, replace=False)]
    for i in ids:
        want = tok.hf.decode([i], skip_special_tokens=False)
        assert tok.token_bytes(i).decode("utf-8", "replace") == want
