"""`sluice chat`: a terminal chat client that streams from a running server.

Plain httpx and SSE, no JAX and no openai dependency, so it starts instantly. The
conversation is kept client-side and sent whole each turn (the server's prefix cache
makes the repeated part cheap). Ctrl-C during an answer stops it (closing the stream
makes the server abort the request); Ctrl-C or Ctrl-D at the prompt quits.
"""

from __future__ import annotations

import argparse
import os
import sys

import httpx
import msgspec


def _headers(args: argparse.Namespace) -> dict[str, str]:
    key = args.api_key or os.environ.get("SLUICE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _error_text(r: httpx.Response) -> str:
    try:
        return msgspec.json.decode(r.read())["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return r.text[:200]


def chat(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    timeout = httpx.Timeout(10, read=None)  # an answer may take a while between tokens
    with httpx.Client(base_url=url, headers=_headers(args), timeout=timeout) as client:
        try:
            model = args.model or _first_model(client)
        except (httpx.HTTPError, RuntimeError) as e:
            print(f"sluice chat: cannot reach {url}: {e}", file=sys.stderr)
            return 1
        print(f"chatting with {model} at {url} (Ctrl-D to quit)", file=sys.stderr)
        messages = [{"role": "system", "content": args.system}] if args.system else []
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            try:
                answer = _stream(client, args, model, messages)
            except KeyboardInterrupt:
                print("\n[stopped]", file=sys.stderr)
                messages.pop()
                continue
            except (httpx.HTTPError, RuntimeError) as e:
                print(f"\n[error] {e}", file=sys.stderr)
                messages.pop()
                continue
            messages.append({"role": "assistant", "content": answer})


def _first_model(client: httpx.Client) -> str:
    r = client.get("/v1/models")
    if r.status_code != 200:
        raise RuntimeError(f"/v1/models: {r.status_code} {_error_text(r)}")
    return r.json()["data"][0]["id"]


def _stream(client: httpx.Client, args: argparse.Namespace, model: str,
            messages: list[dict]) -> str:
    body: dict = {"model": model, "messages": messages, "stream": True}
    if args.temperature is not None:
        body["temperature"] = args.temperature
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    parts = []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {_error_text(r)}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = msgspec.json.decode(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk.get("choices", []):
                text = choice["delta"].get("content") or ""
                parts.append(text)
                sys.stdout.write(text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(parts)
