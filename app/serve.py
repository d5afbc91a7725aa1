"""`sluice serve` and `sluice generate`: the two commands that load a model.

`serve` binds the port first (so /health answers "loading" at once), shows loading and
warmup progress on stderr, then prints a ready line with a curl example. `generate` loads
the same pool and streams one answer to the terminal through the engine, without HTTP:
the quickest way to see the model, the runner and the engine work together.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import trio

from config.settings import Settings

from .guardrails import Guardrails
from .state import ServerState
from .tenants import Tenants


def _console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def serve(settings: Settings, group: tuple[str, int, int] | None = None) -> int:
    """`group`: (coordinator, processes, this process's id) of a multi-host replica;
    process 0 serves HTTP, the others follow (`follow`)."""
    from model.host_memory import limit_arenas

    from .loading import load_pools
    from .server import run_server

    limit_arenas()  # before JAX and the compile threads start (model/host_memory.py)

    logging.basicConfig(level=logging.WARNING,  # libraries' INFO chatter (jax) stays out
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("sluice", "hypercorn.error"):
        logging.getLogger(name).setLevel(logging.INFO)
    console = _console()
    if group is not None:
        from model import multihost

        coordinator, processes, pid = group
        console.print(f"[bold]sluice[/] process {pid} of {processes}: joining the replica "
                      f"at {coordinator}", soft_wrap=True)
        multihost.initialize(coordinator, processes, pid)
        if pid:
            return follow(settings)
    state = ServerState(settings, Tenants(list(settings.tenants)), Guardrails(settings.guardrails))
    names = [n for p in settings.pools for n in p.served_model_names]

    def listening(binds: list[str]) -> None:
        console.print(f"[bold]sluice[/] listening on {', '.join(binds)}; loading "
                      f"{', '.join(p.model for p in settings.pools)} (/health: 503 until ready)",
                      soft_wrap=True)

    def ready(binds: list[str]) -> None:
        url = binds[0].replace("0.0.0.0", "127.0.0.1")
        warming = sum(p.warmup_remaining for p in state.router.pools) if state.router else 0
        more = (f" ({warming} more step shapes compiling in the background; /health counts "
                "them down)" if warming else "")
        body = json.dumps({"model": names[0], "messages": [
            {"role": "user", "content": "What is the capital of France?"}]})
        auth = " -H 'Authorization: Bearer $KEY'" if settings.tenants else ""
        console.print(
            f"[bold green]ready[/] on {url} serving {', '.join(names)}{more}\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d '{body}'\n"
            f"  or: sluice chat --url {url}    (Ctrl-C here drains and stops)",
            soft_wrap=True)  # one line per command, so it can be copied

    trio.run(lambda: run_server(state, lambda: load_pools(settings), on_listening=listening,
                                on_ready=ready))
    console.print("sluice: stopped")
    return 0


def follow(settings: Settings) -> int:
    """A multi-host replica's process other than 0: load its shards, then run the device
    calls process 0 sends until it stops (0) or is gone (1)."""
    from .loading import run_follower

    status = run_follower(settings)
    why = ("the leader stopped", "the leader is gone", "a device call failed")[status]
    _console().print(f"sluice: follower stopped ({why})")
    if status:  # skip jax.distributed's exit handshake: its coordinator may be gone
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def generate(settings: Settings, prompt: str, *, max_tokens: int, temperature: float,
             raw: bool) -> int:
    from scheduler.api import ErrorEvent, FinishEvent, GenerateRequest, TokenEvent
    from scheduler.protocol import SamplingParams

    from .loading import build_pool

    def encode(tok) -> list[int]:
        if raw:
            return tok.encode(prompt, True)
        return tok.encode_chat([{"role": "user", "content": prompt}])

    # Only what this one answer needs is compiled: seconds, not the server's warm-up.
    pool = build_pool(settings.pools[0], warmup="essential",
                      first_prompts=lambda tok: [len(encode(tok))])
    tok = pool.tokenizer
    ids = encode(tok)
    max_tokens = max(1, min(max_tokens, pool.max_context - len(ids)))
    status = 0

    async def run() -> None:
        nonlocal status
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            _, handle = pool.submit(GenerateRequest(
                ids, max_tokens, SamplingParams(temperature=temperature)))
            async for ev in handle.events:
                if isinstance(ev, TokenEvent):
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                elif isinstance(ev, FinishEvent):
                    sys.stdout.write("\n")
                    _console().print(
                        f"[dim]{ev.completion_tokens} tokens, finish_reason={ev.finish_reason}, "
                        f"ttft {ev.ttft_s or 0:.2f}s, total {ev.e2e_s:.2f}s[/]")
                elif isinstance(ev, ErrorEvent):
                    _console().print(f"[red]error:[/] {ev.message}")
                    status = 1
            nursery.cancel_scope.cancel()

    trio.run(run)
    return status
