"""SSE rendering and coalescing, without HTTP: what piled up goes out in one write."""

from __future__ import annotations

import msgspec
import trio

from app.completions import Admitted
from app.guardrails import Guardrails
from app.state import Flight, ServerState
from app.streaming import sse_body, sse_data
from app.tenants import Tenants
from config.settings import Settings
from scheduler.api import ErrorEvent, FinishEvent, TokenEvent
from tests.app.harness import FakeTokenizer


class StubPool:
    name = "p"
    model_name = "m"
    tokenizer = FakeTokenizer()

    def __init__(self) -> None:
        self.finished: list[str] = []

    def finish(self, replica: int, request_id: str) -> None:
        self.finished.append(request_id)


class Handle:
    def __init__(self, events) -> None:
        self.request_id = "r1"
        self.events = events


def admitted(kind: str, events, include_usage: bool = True) -> tuple[Admitted, StubPool]:
    state = ServerState(Settings(), Tenants([]), Guardrails(Settings().guardrails))
    pool = StubPool()
    tenant = state.tenants.anonymous
    lease = state.tenants.admit(tenant, 10)
    flight = Flight(state, pool, lease, prompt_tokens=3)  # type: ignore[arg-type]
    state.add_flight(flight)
    flight.submitted(0, Handle(events))
    adm = Admitted(flight, kind, "id-1", 123, "m", True, include_usage, False, None, tenant,
                   trio.current_time())
    return adm, pool


def finish(n: int) -> FinishEvent:
    return FinishEvent("length", 3, n, 0, 0.1, 0.0, 0.2)


async def test_tokens_that_piled_up_go_out_in_one_write():
    send, recv = trio.open_memory_channel(100)
    for t in "abcde":
        send.send_nowait(TokenEvent(t, (1,)))
    send.send_nowait(finish(5))
    adm, pool = admitted("chat", recv)
    writes = [w async for w in sse_body(adm, None, coalesce=True)]
    assert len(writes) == 2  # the role chunk, then everything else at once
    events = [e[6:] for e in writes[1].decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    content, fin, usage = (msgspec.json.decode(e) for e in events[:-1])
    assert content["choices"][0]["delta"] == {"content": "abcde"}
    assert fin["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length",
                                 "logprobs": None}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert pool.finished == ["r1"] and adm.flight.closed and not adm.flight.state.flights
    assert adm.flight.generated == 5


async def test_without_coalescing_one_write_per_event():
    send, recv = trio.open_memory_channel(100)
    for t in "abc":
        send.send_nowait(TokenEvent(t, (1,)))
    send.send_nowait(finish(3))
    adm, _ = admitted("completion", recv, include_usage=False)
    writes = [w async for w in sse_body(adm, None, coalesce=False)]
    assert len(writes) == 4  # no role chunk for completions; 3 tokens; finish + [DONE]
    assert writes[-1].endswith(b"data: [DONE]\n\n")


async def test_error_event_and_closed_channel_end_the_stream_cleanly():
    send, recv = trio.open_memory_channel(100)
    send.send_nowait(TokenEvent("a", (1,)))
    send.send_nowait(ErrorEvent("boom"))
    adm, pool = admitted("chat", recv)
    body = b"".join([w async for w in sse_body(adm, None, coalesce=True)]).decode()
    assert '"error":{"message":"boom","type":"server_error"' in body
    assert body.endswith("data: [DONE]\n\n") and pool.finished == ["r1"]

    send, recv = trio.open_memory_channel(100)
    send.close()  # the engine went away without a final event
    adm, pool = admitted("chat", recv)
    body = b"".join([w async for w in sse_body(adm, None, coalesce=True)]).decode()
    assert "without finishing" in body and body.endswith("data: [DONE]\n\n")


async def test_client_gone_mid_stream_closes_the_flight():
    send, recv = trio.open_memory_channel(100)
    send.send_nowait(TokenEvent("a", (1,)))
    adm, pool = admitted("chat", recv)
    gen = sse_body(adm, None, coalesce=True)
    await gen.__anext__()  # role
    await gen.__anext__()  # "a"; now parked at a yield, as when the client stops reading
    await gen.aclose()  # what the server does on disconnect (GeneratorExit at the yield)
    assert pool.finished == ["r1"] and adm.flight.closed


def test_an_event_stays_one_line_for_splitlines_readers():
    """Text with NEL, LINE SEPARATOR or PARAGRAPH SEPARATOR (a random model's tokens can
    be any of them) must not end the line for readers that split like str.splitlines():
    httpx's iter_lines (seen cutting an event in a CI run) and our chat CLI."""
    from httpx._decoders import LineDecoder

    text = "a\x85b\u2028c\u2029d\ne\x0bf\u00e9"
    event = sse_data({"choices": [{"delta": {"content": text}}]})
    decoder = LineDecoder()
    lines = decoder.decode(event.decode()) + decoder.flush()
    data = [line for line in lines if line]
    assert len(data) == 1 and data[0].startswith("data: ")
    assert msgspec.json.decode(data[0][6:])["choices"][0]["delta"]["content"] == text
