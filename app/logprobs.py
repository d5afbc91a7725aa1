"""Token logprobs as the two APIs render them: chat's `logprobs.content` (text, bytes,
top alternatives) and completions' legacy object (tokens, token_logprobs, top_logprobs,
text_offset), with the echoed prompt's tokens first when it was scored; and `best_of`'s
ranking."""

from __future__ import annotations

from scheduler.api import TokenEvent

from .completions import Admitted
from .schemas import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


def _token_text(adm: Admitted, token_id: int) -> str:
    return adm.flight.pool.tokenizer.decode([token_id])


def _token_bytes(adm: Admitted, token_id: int) -> list[int]:
    """A token's own bytes (may be half a UTF-8 character, which its text cannot show)."""
    tok = adm.flight.pool.tokenizer
    raw = tok.token_bytes(token_id) if hasattr(tok, "token_bytes") else None
    return list(raw if raw is not None else _token_text(adm, token_id).encode())


def chat_logprobs(adm: Admitted, events: list[TokenEvent]) -> ChatLogprobs | None:
    if adm.logprobs is None:
        return None
    out = []
    for ev in events:
        for lp in ev.logprobs:
            tops = [TopLogprob(_token_text(adm, a.token_id), a.logprob,
                               _token_bytes(adm, a.token_id)) for a in lp.top_logprobs or ()]
            out.append(ChatTokenLogprob(_token_text(adm, lp.token_id), lp.logprob,
                                        _token_bytes(adm, lp.token_id), tops))
    return ChatLogprobs(out)


def completion_logprobs(adm: Admitted, events: list[TokenEvent], offset: int,
                        prompt: bool = False) -> CompletionLogprobs | None:
    """The legacy logprobs object; `prompt`: the echoed prompt's tokens first (the first
    one without a logprob, as OpenAI's), their logprobs from the first token event."""
    if adm.logprobs is None:
        return None
    lp_out = CompletionLogprobs([], [], [], [])

    def add(token_id: int, lp) -> None:
        nonlocal offset
        tok = _token_text(adm, token_id)
        lp_out.tokens.append(tok)
        lp_out.token_logprobs.append(None if lp is None else lp.logprob)
        lp_out.top_logprobs.append(None if lp is None else {
            _token_text(adm, a.token_id): a.logprob for a in lp.top_logprobs or ()})
        lp_out.text_offset.append(offset)
        offset += len(tok)

    if prompt:
        scores = next((e.prompt_logprobs for e in events if e.prompt_logprobs), ())
        for j, token_id in enumerate(adm.prompt_ids):
            add(token_id, scores[j - 1] if 0 < j <= len(scores) else None)
    for ev in events:
        for lp in ev.logprobs:
            add(lp.token_id, lp)
    return lp_out


def mean_logprob(events: list[TokenEvent]) -> float:
    """best_of's ranking: the mean logprob of a sequence's tokens (OpenAI's "highest log
    probability per token")."""
    lps = [lp.logprob for e in events for lp in e.logprobs]
    return sum(lps) / len(lps) if lps else float("-inf")
