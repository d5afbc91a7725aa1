"""A real server on an ephemeral port inside the test's nursery, on the real Engine with the
fake runner and a tiny fake tokenizer (Quart's test client hangs after disconnects).

The fake model: token t is the letter ``a + t % 26``; the runner's `succ_rule` makes the
next token the last one + 1, and EOS ends a stream, so a prompt whose last token is
``EOS - k`` finishes with "stop" after exactly k tokens. `fake_tokenizer.encode` maps a
character to its code point (mod the vocabulary), so a completion prompt ending in
``chr(EOS - k)`` is such a prompt. Chat prompts end with a fixed marker token, so chat
answers always run to max_tokens ("length") unless a stop string ends them.
"""

from __future__ import annotations

import hashlib
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import AsyncIterator, Sequence

import httpx
import trio

from app.guardrails import Guardrails
from app.pools import Pool
from app.server import run_server
from app.state import Phase, ServerState
from app.tenants import Tenants
from config.settings import (BatchConfig, PoolConfig, SchedulerConfig, ServerConfig, Settings,
                             TenantConfig)
from scheduler.engine import Engine
from tests.scheduler.fake_runner import FakeDetokenizer, FakeRunner, succ_rule

VOCAB = 1000
EOS = 999
CHAT_MARKER = 500  # the chat "template" ends with this token: answers start at 501
MODEL = "fake-model"


class FakeTokenizer(FakeDetokenizer):
    eos_token_ids = frozenset({EOS})

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return self.text(ids)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        ids = []
        for m in messages:
            if m["role"] == "assistant" and m["content"] == "refuse-template":
                raise ValueError("template refuses this conversation")
            ids += self.encode(f"<{m['role']}>{m['content']}")
        return ids + [CHAT_MARKER]


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def settings(*, max_waiting: int = 64, max_running: int = 16, max_streams: int = 512,
             tenants: Sequence[TenantConfig] = (), replicas: int = 1, drain_grace_s: float = 5.0,
             pool: dict | None = None, admin_key: str | None = None,
             data_dir: str | None = None, console: bool = True, **extra) -> Settings:
    sched = SchedulerConfig(max_waiting=max_waiting, max_running=max_running,
                            max_step_tokens=128, kv_reserve_pages=2)
    pool_cfg = PoolConfig(name="test", model="fake", served_model_names=[MODEL, "fake-alias"],
                      replicas=replicas, scheduler=sched, **(pool or {}))
    server = ServerConfig(host="127.0.0.1", port=0, max_body_bytes=64 * 1024,
                          max_streams=max_streams, drain_grace_s=drain_grace_s,
                          admin_api_key_sha256=sha(admin_key) if admin_key else None,
                          console=console)
    # Batch jobs only for the tests that give the store a directory of their own.
    batches = BatchConfig(enabled=data_dir is not None, data_dir=data_dir)
    return Settings(server=server, pools=[pool_cfg], tenants=list(tenants), batches=batches,
                    **extra)


def read_fake_adapter(name: str, path: str):
    """The fake runner's adapters: any existing directory; the name sets the offset it
    adds to every token (tests/scheduler/fake_runner.py `adapter_offset`)."""
    if not Path(path).is_dir():
        raise ValueError(f"{path}: no such adapter directory")
    return SimpleNamespace(name=name, path=path, rank=8, targets=("q_proj", "v_proj"))


def fake_pool(cfg: PoolConfig, *, step_delay_s: float = 0.0, num_pages: int = 600,
              max_context: int = 2048) -> Pool:
    tok = FakeTokenizer()
    engines = []
    for i in range(cfg.replicas):
        runner = FakeRunner(page_size=4, num_pages=num_pages, max_context=max_context,
                            vocab=VOCAB, eos=[EOS], rule=succ_rule(VOCAB),
                            adapter_slots=cfg.max_loras)
        if step_delay_s:  # runs in the engine's worker thread, like a real step
            runner.on_step = lambda plan: time.sleep(step_delay_s)
        engines.append(Engine(runner, tok, cfg.scheduler, name=f"{cfg.name}/{i}"))
    pool = Pool(cfg, tok, engines, max_context=max_context, vocab_size=VOCAB,
                adapter_reader=read_fake_adapter if cfg.max_loras else None)
    for a in cfg.adapters:
        pool.adapters.load_blocking(a.name, a.path)
    return pool


@dataclass
class Server:
    url: str
    state: ServerState
    pool: Pool
    cancel: trio.CancelScope

    def client(self, **kw) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=kw.pop("timeout", 30), **kw)

    def openai(self, api_key: str = "anything", **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                                  **kw)

    def pages_in_use(self) -> int:
        return sum(s.kv_pages_in_use for s in self.pool.stats())

    async def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no request is in flight and every engine is empty."""
        with trio.fail_after(timeout):
            while self.state.flights or any(s.running or s.waiting for s in self.pool.stats()):
                await trio.sleep(0.01)
            await trio.sleep(0.05)  # one more engine iteration applies pending aborts


@asynccontextmanager
async def serve(cfg: Settings | None = None, *, guard: Guardrails | None = None,
                **pool_kw) -> AsyncIterator[Server]:
    cfg = cfg or settings()
    state = ServerState(cfg, Tenants(list(cfg.tenants)), guard or Guardrails(cfg.guardrails))
    pool = fake_pool(cfg.pools[0], **pool_kw)

    async def load() -> list[Pool]:
        return [pool]

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(run_server, state, load, handle_signals=False))
        while state.phase is Phase.LOADING:
            await trio.sleep(0.001)
        yield Server(binds[0], state, pool, nursery.cancel_scope)
        nursery.cancel_scope.cancel()


def assert_error(r: httpx.Response, status: int, *, type: str | None = None,
                 code: str | None = None, param: str | None = None) -> dict:
    """The response is `status` with the OpenAI error shape; returns the error object."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if type is not None:
        assert err["type"] == type, err
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]
