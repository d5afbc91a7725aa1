"""Incremental text and stop conditions (no engine, no trio)."""

from __future__ import annotations

import pytest

from scheduler.output import OutputStream
from scheduler.protocol import SampledToken

from .fake_runner import FakeDecoder


def stream(stops=(), stop_ids=(), words=None):
    words = words or {}
    dec = FakeDecoder(lambda t: words.get(t, chr(ord("a") + t % 26)))
    return OutputStream(dec, stop_ids=frozenset(stop_ids), stops=stops, channel=None)


def feed(out, tokens):
    """Push tokens; returns (text released after each token, stopped)."""
    released = []
    for t in tokens:
        stopped = out.append(SampledToken(t))
        released.append(out.token_event().text)
        out.sent()
        if stopped:
            return released, True
    return released, False


def test_no_stops_releases_every_token_at_once():
    out = stream()
    released, stopped = feed(out, [0, 1, 2])
    assert released == ["a", "b", "c"] and not stopped


def test_stop_string_spanning_tokens_is_cut_and_never_shown():
    out = stream(stops=["cde"])
    released, stopped = feed(out, [0, 1, 2, 3, 4, 5])
    # "c" and "d" are held back (they may begin "cde"); "e" completes the stop string.
    assert released == ["a", "b", "", "", ""] and stopped
    assert "".join(released) == "ab"


def test_held_back_text_is_released_when_the_stop_string_does_not_complete():
    out = stream(stops=["cdx"])
    released, stopped = feed(out, [2, 3, 4])
    assert released == ["", "", "cde"] and not stopped


def test_multi_character_tokens_and_overlapping_candidates():
    words = {0: "he", 1: "llo wo", 2: "rld", 3: "!!"}
    out = stream(stops=["lo world", "o w"], words=words)
    released, stopped = feed(out, [0, 1, 2])
    # "o w" ends inside token 1, earlier than "lo world": the earliest match wins.
    assert "".join(released) == "hell" and stopped


def test_stop_string_inside_one_token():
    out = stream(stops=["XY"], words={0: "abXYcd"})
    released, stopped = feed(out, [0])
    assert released == ["ab"] and stopped


def test_stop_token_adds_no_text_and_no_token_id():
    out = stream(stop_ids=[9])
    out.append(SampledToken(0))
    assert out.append(SampledToken(9)) is True
    ev = out.token_event()
    assert ev.text == "a" and ev.token_ids == (0,)


def test_close_releases_partial_stop_text_at_length():
    out = stream(stops=["bcz"])
    feed(out, [0, 1, 2])
    assert out.token_event().text == ""
    assert out.close() is False
    assert out.token_event().text == "bc"  # "a" went out with token 0


@pytest.mark.parametrize("width", range(1, 8))
def test_text_is_the_same_however_the_tokens_split_it(width):
    text = "The capital of France is Paris."
    words = {i: text[j:j + width] for i, j in enumerate(range(0, len(text), width))}
    out = stream(stops=["France is", "Berlin"], words=words)
    released, stopped = feed(out, range(len(words)))
    assert "".join(released) == "The capital of " and stopped
