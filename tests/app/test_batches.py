"""Batch jobs through the HTTP layer on the fake runner (tests/app/harness.py): OpenAI's
Files + Batch APIs with the official client, the platform's form, restarts on the same
store, cancel and expiry, tenants, bad input."""

from __future__ import annotations

import json

import httpx
import msgspec
import trio

from config.settings import TenantConfig

from .harness import MODEL, assert_error, serve, settings, sha


def chat_body(i: int, n: int = 4) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": n, "temperature": 0}


def jsonl(bodies: list[dict], url: str = "/v1/chat/completions") -> bytes:
    return b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url,
                                "body": b}).encode() + b"\n" for i, b in enumerate(bodies))


async def interactive(c: httpx.AsyncClient, body: dict, headers=None) -> str:
    r = await c.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


async def wait_done(c: httpx.AsyncClient, batch_id: str, headers=None, timeout=20) -> dict:
    with trio.fail_after(timeout):
        while True:
            b = (await c.get(f"/v1/batches/{batch_id}", headers=headers)).json()
            if b["status"] in ("completed", "failed", "expired", "cancelled"):
                return b
            await trio.sleep(0.05)


def lines_of(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


async def test_openai_client_round_trip_equals_interactive_answers(tmp_path):
    async with serve(settings(data_dir=str(tmp_path))) as srv, srv.client() as c:
        client = srv.openai()
        bodies = [chat_body(i, 3 + i % 4) for i in range(12)]
        bad = b'{"custom_id": "broken", "method": "POST"\n'  # malformed JSON line
        f = await client.files.create(file=("in.jsonl", jsonl(bodies) + bad), purpose="batch")
        assert f.purpose == "batch" and f.bytes > 0
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                        completion_window="24h", metadata={"team": "qa"})
        assert b.status == "validating" and b.request_counts.total == 13
        with trio.fail_after(20):
            while b.status not in ("completed", "failed", "expired", "cancelled"):
                await trio.sleep(0.05)
                b = await client.batches.retrieve(b.id)
        assert b.status == "completed" and b.metadata == {"team": "qa"}
        assert (b.request_counts.completed, b.request_counts.failed) == (12, 1)
        out = lines_of((await client.files.content(b.output_file_id)).text)
        assert sorted(x["custom_id"] for x in out) == sorted(f"c{i}" for i in range(12))
        for x in out:
            i = int(x["custom_id"][1:])
            assert x["response"]["status_code"] == 200 and x["error"] is None
            got = x["response"]["body"]["choices"][0]["message"]["content"]
            assert got == await interactive(c, bodies[i])
        errors = lines_of((await client.files.content(b.error_file_id)).text)
        assert len(errors) == 1 and "not valid JSON" in errors[0]["error"]["message"]
        page = await client.batches.list(limit=5)
        assert [x.id for x in page.data] == [b.id]
        await client.close()
        await srv.wait_idle()
        assert srv.pages_in_use() == 0
        metrics = (await c.get("/metrics")).text
        assert 'sluice:batch_requests{state="completed"} 12.0' in metrics


async def test_platform_form_and_per_request_errors(tmp_path):
    async with serve(settings(data_dir=str(tmp_path)), max_context=256) as srv, \
            srv.client() as c:
        bodies = [chat_body(0), {**chat_body(1), "custom_id": "mine"},
                  {**chat_body(2), "max_tokens": 5000},  # past the context: error line
                  {**chat_body(3), "model": "nope"}, {**chat_body(4), "stream": True}]
        r = await c.post("/v1/batches", json={"requests": bodies, "completeWithin": "90m"})
        assert r.status_code == 200, r.text
        b = await wait_done(c, r.json()["id"])
        assert b["status"] == "completed" and b["completion_window"] == "90m"
        assert b["request_counts"] == {"total": 5, "completed": 2, "failed": 3}
        out = lines_of((await c.get(f"/v1/files/{b['output_file_id']}/content")).text)
        assert {x["custom_id"] for x in out} == {"request-0", "mine"}
        errs = {x["custom_id"]: x["error"] for x in lines_of(
            (await c.get(f"/v1/files/{b['error_file_id']}/content")).text)}
        assert errs["request-2"]["code"] == "context_length_exceeded"
        assert errs["request-3"]["code"] == "model_not_found"
        assert "stream" in errs["request-4"]["message"]
        assert b["sluice"]["progress"] == 1.0


async def test_bad_input_is_refused_and_nothing_is_stored_half(tmp_path):
    tenants = [TenantConfig(name="a", api_key_sha256=sha("ka")),
               TenantConfig(name="b", api_key_sha256=sha("kb"))]
    cfg = settings(data_dir=str(tmp_path), tenants=tenants)
    ka, kb = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
    async with serve(cfg) as srv, srv.client() as c:
        up = await c.post("/v1/files", headers=ka, files={"file": ("x.jsonl", jsonl([
            chat_body(0)]))}, data={"purpose": "fine-tune"})
        assert_error(up, 400, code="invalid_purpose", param="purpose")
        up = await c.post("/v1/files", headers=ka, files={"file": ("x.jsonl", jsonl([
            chat_body(0)]))}, data={"purpose": "batch"})
        fid = up.json()["id"]
        assert_error(await c.post("/v1/batches", headers=ka, json={
            "input_file_id": fid, "endpoint": "/v1/embeddings", "completion_window": "24h"}),
            400, code="invalid_endpoint")
        assert_error(await c.post("/v1/batches", headers=ka, json={
            "input_file_id": "file-nope", "endpoint": "/v1/chat/completions"}),
            404, code="file_not_found")
        assert_error(await c.post("/v1/batches", headers=kb, json={
            "input_file_id": fid, "endpoint": "/v1/chat/completions"}),
            404, code="file_not_found")  # another tenant's file
        assert_error(await c.post("/v1/batches", headers=ka, json={
            "input_file_id": fid, "endpoint": "/v1/chat/completions",
            "completion_window": "soon"}), 400, code="invalid_completion_window")
        assert_error(await c.post("/v1/batches", headers=ka, json={"requests": []}), 400)
        assert_error(await c.post("/v1/batches", headers=ka, content=b"{nope"), 400)
        # a file of only blank lines: no batch
        up = await c.post("/v1/files", headers=ka, files={"file": ("e.jsonl", b"\n \n")},
                          data={"purpose": "batch"})
        assert_error(up, 400, code="empty_file")
        assert (await c.get("/v1/batches", headers=ka)).json()["data"] == []  # none half

        r = await c.post("/v1/batches", headers=ka, json={
            "input_file_id": fid, "endpoint": "/v1/chat/completions"})
        bid = r.json()["id"]
        assert_error(await c.get(f"/v1/batches/{bid}", headers=kb), 404,
                     code="batch_not_found")
        assert_error(await c.post(f"/v1/batches/{bid}/cancel", headers=kb), 404)
        assert (await c.get("/v1/batches", headers=kb)).json()["data"] == []
        assert_error(await c.get("/v1/batches/batch_nope", headers=ka), 404)
        b = await wait_done(c, bid, ka)
        assert_error(await c.post(f"/v1/batches/{bid}/cancel", headers=ka), 409,
                     code="batch_not_cancellable")
        assert_error(await c.get(f"/v1/files/{b['output_file_id']}/content", headers=kb), 404)
        r = await c.delete(f"/v1/files/{fid}", headers=ka)
        assert r.json()["deleted"] is True
        assert_error(await c.get(f"/v1/files/{fid}", headers=ka), 404)


async def test_cancel_and_expiry_keep_what_finished(tmp_path):
    async with serve(settings(data_dir=str(tmp_path)), step_delay_s=0.01) as srv, \
            srv.client() as c:
        r = await c.post("/v1/batches", json={
            "requests": [chat_body(i, 30) for i in range(40)], "completeWithin": "24h"})
        bid = r.json()["id"]
        with trio.fail_after(10):
            while (await c.get(f"/v1/batches/{bid}")).json()["request_counts"][
                    "completed"] < 2:
                await trio.sleep(0.02)
        r = await c.post(f"/v1/batches/{bid}/cancel")
        assert r.json()["status"] == "cancelling"
        b = await wait_done(c, bid)
        assert b["status"] == "cancelled" and b["cancelled_at"]
        done = b["request_counts"]["completed"]
        assert 2 <= done < 40
        out = lines_of((await c.get(f"/v1/files/{b['output_file_id']}/content")).text)
        assert len(out) == done

        r = await c.post("/v1/batches", json={
            "requests": [chat_body(i, 30) for i in range(40)], "completeWithin": "1s"})
        b = await wait_done(c, r.json()["id"])
        assert b["status"] == "expired" and b["request_counts"]["completed"] < 40
        await srv.wait_idle()
        assert srv.pages_in_use() == 0


async def test_a_restart_goes_on_where_the_batch_was(tmp_path):
    """The server stops in the middle of a batch (its engine's work lost); a new one on
    the same store runs what was pending, and every custom_id is in the output once."""
    bodies = [chat_body(i, 8) for i in range(30)]
    cfg = settings(data_dir=str(tmp_path))
    async with serve(cfg, step_delay_s=0.01) as srv, srv.client() as c:
        bid = (await c.post("/v1/batches", json={"requests": bodies})).json()["id"]
        with trio.fail_after(10):
            while (await c.get(f"/v1/batches/{bid}")).json()["request_counts"][
                    "completed"] < 5:
                await trio.sleep(0.01)
        srv.cancel.cancel()  # gone, mid-batch
    async with serve(cfg) as srv, srv.client() as c:
        b = await wait_done(c, bid)
        assert b["status"] == "completed"
        assert b["request_counts"] == {"total": 30, "completed": 30, "failed": 0}
        out = lines_of((await c.get(f"/v1/files/{b['output_file_id']}/content")).text)
        ids = [x["custom_id"] for x in out]
        assert sorted(ids) == sorted(f"request-{i}" for i in range(30))  # each once
        for x in out:
            body = bodies[int(x["custom_id"].split("-")[1])]
            assert x["response"]["body"]["choices"][0]["message"]["content"] == \
                await interactive(c, body)


async def test_a_second_server_on_the_same_store_refuses_to_start(tmp_path):
    from app.batches.store import StoreLocked

    cfg = settings(data_dir=str(tmp_path))
    async with serve(cfg):
        try:
            async with serve(cfg):
                raise AssertionError("two servers own one store")
        except* StoreLocked as group:
            assert "in use by another sluice server" in str(group.exceptions[0])


async def test_cli_submit_wait_results_list(tmp_path, capsys):
    from app.cli import main

    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_body(i) for i in range(5)]))
    out = tmp_path / "out.jsonl"
    async with serve(settings(data_dir=str(tmp_path / "store"))) as srv:
        def cli(*argv: str) -> int:
            return main(["batch", "--url", srv.url, *argv])

        assert await trio.to_thread.run_sync(cli, "submit", str(path), "--wait") == 0
        bid = capsys.readouterr().out.split()[0]
        assert await trio.to_thread.run_sync(cli, "results", bid, "-o", str(out)) == 0
        assert len(lines_of(out.read_text())) == 5
        assert await trio.to_thread.run_sync(cli, "list") == 0
        assert f"{bid} completed: 5 completed, 0 failed of 5" in capsys.readouterr().out
        assert await trio.to_thread.run_sync(cli, "status", "batch_nope") == 1
        assert "404: No such batch" in capsys.readouterr().err


async def test_limits_answer_with_a_clear_message(tmp_path):
    """Bytes per file (413), lines per batch (400), a tenant's pending batch tokens (429)."""
    from config.settings import BatchConfig

    tenants = [TenantConfig(name="t", api_key_sha256=sha("k"), max_batch_tokens=2_000)]
    cfg = settings(tenants=tenants)
    cfg = msgspec.structs.replace(cfg, batches=BatchConfig(
        data_dir=str(tmp_path), max_file_bytes=2_000, max_requests=5))
    key = {"Authorization": "Bearer k"}
    async with serve(cfg) as srv, srv.client() as c:
        big = jsonl([chat_body(i) for i in range(40)])
        r = await c.post("/v1/files", headers=key, files={"file": ("big.jsonl", big)},
                         data={"purpose": "batch"})
        err = assert_error(r, 413, code="file_too_large")
        assert "2000 bytes" in err["message"]
        assert r.headers["connection"] == "close"  # (the next request takes a new one)
        six = {"requests": [chat_body(i) for i in range(6)]}
        err = assert_error(await c.post("/v1/batches", headers=key, json=six), 400,
                           code="too_many_requests")
        assert "more than 5 requests" in err["message"]
        heavy = {"requests": [chat_body(i, 600) for i in range(3)]}  # ~3 x 610 tokens
        r = await c.post("/v1/batches", headers=key, json=heavy)
        assert r.status_code == 200, r.text
        err = assert_error(await c.post("/v1/batches", headers=key, json=heavy), 429,
                           code="batch_quota")
        assert "limit of 2000" in err["message"]
