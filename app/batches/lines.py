"""Batch input: JSONL lines and the platform's `{"requests": [...]}` form, each request
validated like an interactive one (same schema, model, adapter and context checks). An
invalid line becomes an error-file entry (`Line.error`), never a failed upload; what
fails the whole batch (no lines, too many, a bad window) is a 400 naming it."""

from __future__ import annotations

import json
import re

import trio

from ..completions import parse, resolve
from ..errors import APIError, bad_request
from ..state import ServerState
from ..tenants import Tenant
from .store import Line

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
_WINDOW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_YIELD_EVERY = 32  # validate this many lines, then let the event loop serve others


def parse_window(text: object, max_s: float, param: str = "completion_window") -> float:
    """"90m", "24h", "7d" -> seconds."""
    m = _WINDOW.match(text) if isinstance(text, str) else None
    if m is None:
        raise bad_request(f"`{param}` must be a duration like 90m, 24h or 7d; got "
                          f"{text!r}.", param=param, code="invalid_completion_window")
    seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if not 0 < seconds <= max_s:
        raise bad_request(f"`{param}` must be more than 0 and at most {max_s / 86400:g} "
                          f"days; got {text!r}.", param=param,
                          code="invalid_completion_window")
    return seconds


def read_jsonl(content: bytes, endpoint: str, max_requests: int) -> list[Line | dict]:
    """The OpenAI batch file: one `{"custom_id", "method", "url", "body"}` per line. Returns
    per line either its decoded body (a dict with custom_id, url, body) or an invalid
    `Line`."""
    out: list[Line | dict] = []
    seen: set[str] = set()
    for n, raw in enumerate(content.splitlines(), 1):
        if not raw.strip():
            continue
        if len(out) >= max_requests:
            raise bad_request(f"The batch has more than {max_requests} requests.",
                              param="input_file_id", code="too_many_requests")

        def bad(message: str, custom_id: str | None = None) -> Line:
            return Line(custom_id or f"line-{n}", "", raw,
                        {"code": "invalid_request", "message": f"line {n}: {message}",
                         "line": n})

        try:
            obj = json.loads(raw)
        except ValueError as e:
            out.append(bad(f"not valid JSON ({e})"))
            continue
        except RecursionError:
            out.append(bad("nested too deeply"))
            continue
        if not isinstance(obj, dict):
            out.append(bad("expected a JSON object"))
            continue
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            out.append(bad("`custom_id` must be a non-empty string"))
            continue
        if cid in seen:
            out.append(bad(f"`custom_id` {cid!r} is used twice", f"{cid}#line-{n}"))
            continue
        seen.add(cid)
        if obj.get("method", "POST") != "POST":
            out.append(bad("`method` must be POST", cid))
        elif obj.get("url") != endpoint:
            out.append(bad(f"`url` must be the batch's endpoint {endpoint}; got "
                           f"{obj.get('url')!r}", cid))
        elif not isinstance(obj.get("body"), dict):
            out.append(bad("`body` must be a JSON object", cid))
        else:
            out.append({"custom_id": cid, "url": endpoint, "body": obj["body"]})
    if not out:
        raise bad_request("The batch has no requests.", param="input_file_id",
                          code="empty_batch")
    return out


def platform_requests(requests: object, max_requests: int) -> list[Line | dict]:
    """The platform's form: `{"requests": [chat bodies, each maybe with "custom_id"]}`."""
    if not isinstance(requests, list) or not requests:
        raise bad_request("`requests` must be a non-empty list of chat completion bodies.",
                          param="requests")
    if len(requests) > max_requests:
        raise bad_request(f"The batch has more than {max_requests} requests.",
                          param="requests", code="too_many_requests")
    out: list[Line | dict] = []
    seen: set[str] = set()
    for i, body in enumerate(requests):
        if not isinstance(body, dict):
            out.append(Line(f"request-{i}", "", b"", {
                "code": "invalid_request", "message": f"requests[{i}]: expected an object"}))
            continue
        body = dict(body)
        cid = body.pop("custom_id", None) or f"request-{i}"
        if not isinstance(cid, str) or cid in seen:
            out.append(Line(f"request-{i}", "", b"", {
                "code": "invalid_request",
                "message": f"requests[{i}]: `custom_id` must be a unique string"}))
            continue
        seen.add(cid)
        out.append({"custom_id": cid, "url": "/v1/chat/completions", "body": body})
    return out


async def validate(state: ServerState, tenant: Tenant, items: list[Line | dict]
                   ) -> list[Line]:
    """Check each request as an interactive one would be checked; invalid ones become
    error lines. Yields to the event loop as it goes (a batch may have 50,000 lines)."""
    lines: list[Line] = []
    for i, item in enumerate(items):
        if i % _YIELD_EVERY == _YIELD_EVERY - 1:
            await trio.sleep(0)
        if isinstance(item, Line):
            lines.append(item)
            continue
        body = json.dumps(item["body"]).encode()
        cid, url = item["custom_id"], item["url"]
        try:
            if item["body"].get("stream"):
                raise bad_request("`stream` is not supported in a batch.", param="stream")
            parsed = parse(ENDPOINTS[url], body)
            _, prompt, _, max_tokens, _ = await resolve(state, ENDPOINTS[url], parsed, tenant)
        except APIError as e:
            lines.append(Line(cid, url, body, {"code": e.detail.code or "invalid_request",
                                               "message": e.detail.message,
                                               "param": e.detail.param}))
            continue
        lines.append(Line(cid, url, body, cost=len(prompt) + max_tokens))
    return lines
