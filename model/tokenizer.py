"""Tokenizer, chat template and streaming detokenizer.

Encoding is delegated to Hugging Face `tokenizers` (a Rust BPE that is both correct and
fast); we only assemble it from whatever the checkpoint ships: a `tokenizer.json` here,
GGUF metadata (`tokenizer.ggml.*`) in `loaders/gguf_tokenizer.py`.

Decoding does *not* go through `tokenizers`: we keep one table of raw bytes per token id.
Streaming then costs a list lookup and a C-level incremental UTF-8 decode per token, and
the incremental decoder holds back a character whose bytes are split over several
byte-level tokens (an emoji is often 2-4 tokens), so no stream ever shows U+FFFD for
text the model wrote correctly. `decode()` uses the same table so that the stream and
the full decode always agree.

(About 420 lines: encoding, the chat template and the byte-level decoder share the token
table and are tested as one; split, each part would import the others.)
"""

from __future__ import annotations

import codecs
import copy
import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from .base import ModelLoadError

if TYPE_CHECKING:
    from .segment_cache import SegmentEncoder

# End-of-turn / end-of-text markers of the Llama family; any the vocabulary declares as a
# special token stops generation, alongside the declared eos.
END_TOKENS = frozenset(
    ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "</s>",
     "<end_of_turn>", "<|end|>")
)  # fmt: skip

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Gemma's turns (Gemma 3's own template, without its image parts): a system message
# opens the first user turn; the assistant is "model"; a turn ends with <end_of_turn>.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\n' + (first if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Per family: the chat template a model file without one gets, and its turn's end token.
FAMILY_CHAT = {"gemma3": (GEMMA_TEMPLATE, "<end_of_turn>")}


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (raise_exception) or failed to render."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable-character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_CHARS = _bytes_to_unicode()
# str.translate table: byte-level character -> the latin-1 character of its byte value.
_UNBYTE = str.maketrans({c: chr(b) for b, c in _BYTE_CHARS.items()})
_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SURROGATE = re.compile("[\ud800-\udfff]")


class IncrementalDecoder:
    """Streams text for one sequence: `push` returns only complete characters."""

    __slots__ = ("_table", "_utf8", "_strip")

    def __init__(self, table: list[bytes], strip_leading_space: bool) -> None:
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._strip = strip_leading_space

    def push(self, token_id: int) -> str:
        try:
            text = self._utf8.decode(self._table[token_id])
        except IndexError:  # ids past the tokenizer's vocab (padded embedding rows)
            return ""
        if self._strip and text:
            self._strip = False
            return text[1:] if text[0] == " " else text
        return text

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        if self._strip and text:
            self._strip = False
            return text[1:] if text[0] == " " else text
        return text


class Tokenizer:
    """A `tokenizers.Tokenizer` plus chat template, special ids and a bytes table."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        self._tok = tok
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._extra_eos = frozenset(extra_eos_ids)
        self._build_tables()

    # ---- construction -------------------------------------------------------------------

    def with_family_chat(self, family: str) -> "Tokenizer":
        """This tokenizer with its family's chat template where it has none (Gemma 3
        GGUFs often ship none), and the family's end-of-turn token stopping generation."""
        template, end = FAMILY_CHAT.get(family, (None, None))
        end_id = self._tok.token_to_id(end) if end else None
        new = copy.copy(self)  # the tables built once (1.4 s for Gemma's 262,144 tokens)
        new.chat_template = self.chat_template or template
        new._extra_eos = self._extra_eos | ({end_id} - {None})
        for cached in ("eos_token_ids", "_template", "segments"):  # cached_property values
            new.__dict__.pop(cached, None)
        return new

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config)."""
        path = Path(path)
        tj = path / "tokenizer.json"
        try:
            tok = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"{tj}: cannot read tokenizer: {e}") from None
        cfg = _read_json(path / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id", [])
        return cls(
            tok,
            chat_template=template,
            bos_token=_token_content(cfg.get("bos_token")),
            eos_token=_token_content(cfg.get("eos_token")),
            extra_eos_ids=[i for i in (gen_eos if isinstance(gen_eos, list) else [gen_eos])
                           if isinstance(i, int)],  # fmt: skip
        )

    def save_hf_dir(self, path: str | Path, model_max_length: int | None = None) -> Path:
        """Write a Hugging Face tokenizer directory that `from_hf_dir` and transformers'
        `AutoTokenizer` read back (tokenizer.json + tokenizer_config.json): what tools that
        count tokens themselves (GuideLLM, lm-eval) need to agree with this server."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "tokenizer.json").write_text(self._tok.to_str())
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": self.chat_template,
               "bos_token": self.bos_token, "eos_token": self.eos_token,
               "clean_up_tokenization_spaces": False}
        if model_max_length:
            cfg["model_max_length"] = model_max_length
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
        return path

    @classmethod
    def byte_level(cls, vocab_size: int = 259) -> "Tokenizer":
        """A merge-free byte tokenizer with ChatML specials, for random-weight models.

        Ids 0-2 are <|endoftext|>, <|im_start|>, <|im_end|>; 3-258 the 256 bytes; any
        further ids up to `vocab_size` are reserved special tokens. Every text round-trips.
        """
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        specials += [f"<|reserved_{i}|>" for i in range(max(0, vocab_size - 259))]
        vocab = {c: 3 + b for b, c in _BYTE_CHARS.items()}
        vocab |= {t: i if i < 3 else 256 + i for i, t in enumerate(specials)}
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        return cls(tok, bos_token="<|im_start|>", eos_token="<|im_end|>")

    def to_json(self) -> dict:
        """Everything needed to rebuild this tokenizer (orbax checkpoints store it)."""
        return {
            "tokenizer": json.loads(self._tok.to_str()),
            "chat_template": self.chat_template,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "extra_eos_ids": sorted(self._extra_eos),
        }

    @classmethod
    def from_json(cls, d: dict) -> "Tokenizer":
        tok = tokenizers.Tokenizer.from_str(json.dumps(d["tokenizer"]))
        return cls(
            tok,
            chat_template=d.get("chat_template"),
            bos_token=d.get("bos_token"),
            eos_token=d.get("eos_token"),
            extra_eos_ids=d.get("extra_eos_ids", ()),
        )

    # ---- the bytes table -----------------------------------------------------------------

    def _build_tables(self) -> None:
        tok = self._tok
        spec = json.loads(tok.to_str())
        dec_types = _decoder_types(spec.get("decoder"))
        added = {a["id"]: a for a in spec.get("added_tokens", [])}
        vocab = tok.get_vocab(with_added_tokens=True)
        n = max(vocab.values(), default=-1) + 1
        names: list[str | None] = [None] * n
        for t, i in vocab.items():
            names[i] = t
        byte_level = "ByteLevel" in dec_types
        fallback = "ByteFallback" in dec_types
        metaspace = "Metaspace" in dec_types or "Replace" in dec_types
        table: list[bytes] = []
        for i, t in enumerate(names):
            if t is None:
                b = b""
            elif i in added:
                b = added[i]["content"].encode()
            elif byte_level:
                u = t.translate(_UNBYTE)
                b = u.encode("latin-1") if u.isascii() or max(u) <= "\xff" else t.encode()
            elif fallback and (m := _HEX_BYTE.fullmatch(t)):
                b = bytes([int(m.group(1), 16)])
            elif metaspace:
                b = t.replace("\u2581", " ").encode()
            else:
                b = tok.decode([i], skip_special_tokens=False).encode()
            table.append(b)
        self._special_ids = frozenset(i for i, a in added.items() if a.get("special"))
        self._names = names
        self._table = table
        self._table_skip = [b"" if i in self._special_ids else b for i, b in enumerate(table)]
        # Sentencepiece decoders drop the space the normalizer put before the first word.
        self._strip_first = "Strip" in dec_types or (
            "Metaspace" in dec_types and _metaspace_prepends(spec.get("decoder"))
        )

    # ---- public API ----------------------------------------------------------------------

    @property
    def hf(self) -> tokenizers.Tokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._table)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._tok.token_to_id(self.bos_token)

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        ids = set(self._extra_eos)
        if self.eos_token is not None and (i := self._tok.token_to_id(self.eos_token)) is not None:
            ids.add(i)
        ids.update(i for i in self._special_ids if self._names[i] in END_TOKENS)
        return frozenset(ids)

    def id_to_token(self, token_id: int) -> str | None:
        return self._names[token_id] if 0 <= token_id < len(self._names) else None

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (special tokens: their text)."""
        return self._table[token_id] if 0 <= token_id < len(self._table) else b""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # lone surrogates (JSON "\ud800") are not valid UTF-8 text
            text = _SURROGATE.sub("\ufffd", text)
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        table = self._table_skip if skip_special_tokens else self._table
        n = len(table)
        text = b"".join([table[i] for i in ids if 0 <= i < n]).decode("utf-8", "replace")
        return text[1:] if self._strip_first and text.startswith(" ") else text

    def incremental(self, prompt_ids: Sequence[int] = ()) -> IncrementalDecoder:
        """A streaming decoder for the tokens generated after `prompt_ids`.

        Bytes of a character the prompt left incomplete are fed in first, so a completion
        that finishes the character emits it whole instead of a U+FFFD.
        """
        dec = IncrementalDecoder(self._table_skip, self._strip_first and not prompt_ids)
        for i in prompt_ids[-3:]:  # a UTF-8 character spans at most 4 bytes
            dec.push(i)
        return dec

    # ---- chat ----------------------------------------------------------------------------

    @cached_property
    def _template(self):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ChatTemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)  # fmt: skip

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = tojson
        try:
            return env.from_string(self.chat_template or CHATML_TEMPLATE)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from None

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra
    ) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except TemplateError as e:  # includes sandbox SecurityError
            raise ChatTemplateError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The rendered template already carries bos where the model wants it. Its long
        # pieces between special tokens (a system prompt) are tokenized once.
        return self.segments.encode(self.apply_chat_template(messages, add_generation_prompt))

    def warm(self) -> None:
        """Build what the first chat request would otherwise build on the event loop: the
        template's compile and the segment cache's checks (~0.2 s here)."""
        self.segments  # noqa: B018 - built now
        try:
            self.encode_chat([{"role": "user", "content": "hi"}])
        except ValueError:  # a template that wants other roles: each request is told
            pass

    @cached_property
    def segments(self) -> "SegmentEncoder":
        from .segment_cache import SegmentEncoder

        return SegmentEncoder(self._tok, self.encode)


# ---- helpers -------------------------------------------------------------------------------


def _decoder_types(spec: dict | None) -> set[str]:
    if not spec:
        return set()
    found = {spec.get("type", "")}
    for sub in spec.get("decoders", []) or []:
        found |= _decoder_types(sub)
    return found


def _metaspace_prepends(spec: dict | None) -> bool:
    if not spec:
        return False
    if spec.get("type") == "Metaspace":
        scheme = spec.get("prepend_scheme", "always")
        return scheme != "never" and spec.get("add_prefix_space", True)
    return any(_metaspace_prepends(s) for s in spec.get("decoders", []) or [])


def _token_content(t) -> str | None:
    return t.get("content") if isinstance(t, dict) else t


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
