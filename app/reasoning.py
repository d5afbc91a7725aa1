"""`reasoning_content`: the thinking of models that think in `<think>...</think>` tags.

On only where the model's chat template writes those tags (DeepSeek-R1's, Qwen3's ...):
`enabled`. Then a chat answer that opens with `<think>` (or starts inside it, when the
template opened the tag at the end of the prompt: `opened`) is reasoning up to
`</think>` and content after; cut before `</think>`, it is reasoning alone. An answer that
does not open the tag is content. Non-streamed, the message carries `reasoning_content`
beside `content` (`split`); streamed, the deltas carry `reasoning_content` until the tag
closes and `content` after (`ReasoningStream`), as vLLM's reasoning parsers do. The
embedded model's template (ChatML) has no such tags: off there.
"""

from __future__ import annotations

from typing import Sequence

OPEN, CLOSE = "<think>", "</think>"


def enabled(tokenizer) -> bool:
    """Whether the model thinks in tags (its chat template writes both)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return OPEN in template and CLOSE in template


def opened(tokenizer, prompt_ids: Sequence[int]) -> bool:
    """Whether the prompt itself ends inside the tag (the template opened it)."""
    return tokenizer.decode(list(prompt_ids[-4:])).rstrip().endswith(OPEN)


def split(text: str, inside: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    body = OPEN + text if inside else text.lstrip()
    if not body.startswith(OPEN):
        return None, text
    end = body.find(CLOSE)
    if end < 0:
        return body[len(OPEN):].strip(), ""
    return body[len(OPEN):end].strip(), body[end + len(CLOSE):].lstrip()


def _tail(text: str, marker: str) -> int:
    """How many of `text`'s last characters could begin `marker` (held back)."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1)
                 if marker.startswith(text[-k:])), 0)


class ReasoningStream:
    """One streamed choice's text split as it comes (`split`'s rule): reasoning until
    `</think>`, content after; a tag split across writes is held until it is whole."""

    def __init__(self, inside: bool = False) -> None:
        self.held = ""
        self.state = "thinking" if inside else "start"  # -> "thinking" | "answer"
        self.fresh = True  # no reasoning sent yet (its leading blanks dropped)
        self.lead = False  # just after `</think>`: the content's leading blanks dropped

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of `text` that can go out now."""
        self.held += text
        if self.state == "start":
            body = self.held.lstrip()
            if len(body) < len(OPEN) and OPEN.startswith(body):
                return "", ""  # maybe the tag, still coming
            if body.startswith(OPEN):
                self.held, self.state = body[len(OPEN):], "thinking"
            else:
                self.state = "answer"
        if self.state == "answer":
            out, self.held = self.held, ""
            return "", self._content(out)
        end = self.held.find(CLOSE)
        if end >= 0:
            thought, rest = self.held[:end], self.held[end + len(CLOSE):]
            self.held, self.state, self.lead = "", "answer", True
            return self._thought(thought).rstrip(), self._content(rest)
        keep = _tail(self.held, CLOSE)
        out = self.held[:len(self.held) - keep]
        sent = out.rstrip()  # blanks wait: before `</think>` they are not the reasoning's
        self.held = self.held[len(sent):]
        return self._thought(sent), ""

    def _thought(self, text: str) -> str:
        if self.fresh:
            text = text.lstrip()
            self.fresh = not text
        return text

    def _content(self, text: str) -> str:
        if self.lead:
            text = text.lstrip()
            self.lead = not text
        return text

    def finish(self) -> tuple[str, str]:
        """What is still held: (reasoning, content)."""
        held, self.held = self.held, ""
        return (self._thought(held), "") if self.state == "thinking" else ("", held)
