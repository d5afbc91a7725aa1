"""The tokenizer of a GGUF file, assembled from its `tokenizer.ggml.*` metadata.

Byte-level BPE ("gpt2": vocabulary and merges) and sentencepiece BPE ("llama": pieces and
scores, merges rebuilt from the scores) become a Hugging Face `tokenizers.Tokenizer`,
with the pre-tokenizer llama.cpp names in `tokenizer.ggml.pre` and the control tokens as
special tokens (the embedded SmolLM2 needs all 17 of them special: docs/operations.md).
"""

from __future__ import annotations

from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from ..base import ModelLoadError
from ..tokenizer import Tokenizer
from .gguf_reader import open_reader

# Pre-tokenizer regexes as llama.cpp names them in `tokenizer.ggml.pre`.
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = _LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")
_DIGITS_FIRST = {"smollm", "starcoder", "refact"}
_LLAMA3_LIKE = {"llama-bpe", "llama3", "dbrx", "smaug-bpe", "falcon3"}
_QWEN2_LIKE = {"qwen2", "deepseek-r1-qwen"}

# GGUF token types (llama.cpp's llama_token_type).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4


def tokenizer_from_gguf(reader_or_path) -> Tokenizer:
    """Assemble the tokenizer from a GGUF's `tokenizer.ggml.*` metadata."""
    from gguf import GGUFReader

    reader = reader_or_path
    if not isinstance(reader, GGUFReader):
        reader = open_reader(Path(reader_or_path))
    try:
        return _from_reader(reader)
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 -- the Rust side raises bare Exceptions
        raise ModelLoadError(f"{reader.data.filename}: bad tokenizer metadata ({e})") from None


def _from_reader(reader) -> Tokenizer:
    def field(name, default=None):
        f = reader.fields.get(name)
        return default if f is None else f.contents()

    kind = field("tokenizer.ggml.model")
    tokens = field("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError(f"{reader.data.filename}: no tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok = _byte_level_bpe(
            tokens, field("tokenizer.ggml.merges") or [], field("tokenizer.ggml.pre", "default")
        )
    elif kind == "llama":
        tok = _sentencepiece_bpe(
            tokens, field("tokenizer.ggml.scores"), types,
            field("tokenizer.ggml.add_space_prefix", True),
        )  # fmt: skip
    else:
        raise ModelLoadError(
            f"{reader.data.filename}: tokenizer.ggml.model={kind!r} is not supported "
            "(byte-level 'gpt2' and sentencepiece 'llama' are)"
        )
    specials = [t for t, ty in zip(tokens, types) if ty in (_CONTROL, _UNKNOWN)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    user = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def name(i):
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos_id = field("tokenizer.ggml.bos_token_id")
    bos = name(bos_id)
    if bos is not None and field("tokenizer.ggml.add_bos_token", kind == "llama"):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
        )
    extra = [field(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    return Tokenizer(
        tok,
        chat_template=field("tokenizer.chat_template"),
        bos_token=bos,
        eos_token=name(field("tokenizer.ggml.eos_token_id")),
        extra_eos_ids=[i for i in extra if isinstance(i, int)],
    )



# ---- builders ------------------------------------------------------------------------------


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_LIKE)
    )
    if pre in _DIGITS_FIRST:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )  # fmt: skip
    elif pre in _LLAMA3_LIKE or pre in _QWEN2_LIKE:
        regex = _LLAMA3_RE if pre in _LLAMA3_LIKE else _QWEN2_RE
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )  # fmt: skip
    else:  # "default", "gpt-2" and unknown names: GPT-2's own split
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens, scores, types, add_space_prefix: bool) -> tokenizers.Tokenizer:
    """Llama 2 / Mistral vocabularies: rebuild BPE merges from the piece scores.

    A piece that splits into two known pieces is a merge; higher-scored pieces merge
    first. This is how `transformers` converts sentencepiece models too.
    """
    scores = scores if scores is not None else [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores):
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((-score, vocab[left], vocab[right], left, right))
    merges.sort()
    unk = next((t for t, ty in zip(tokens, types) if ty == _UNKNOWN), None)
    tok = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], unk_token=unk,
                   fuse_unk=True, byte_fallback=True)
    )  # fmt: skip
    norm = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(norm)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok
