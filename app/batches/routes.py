"""The batch endpoints: OpenAI's Files and Batch APIs, and the platform's own form.

- `POST /v1/files` (multipart `file`, `purpose=batch`), `GET /v1/files`, `GET
  /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`;
- `POST /v1/batches` either `{input_file_id, endpoint, completion_window, metadata}`
  (OpenAI) or `{"requests": [...], "completeWithin": "24h"}` (the platform's form, which
  stores its requests as an input file too), `GET /v1/batches` (`after`, `limit`),
  `GET /v1/batches/{id}`, `POST /v1/batches/{id}/cancel`.

Every file and batch belongs to the tenant whose key created it; another tenant's is a
404, as if it did not exist. A batch is stored whole, with every line validated, before
the answer: nothing is stored half.
"""

from __future__ import annotations

import json
import uuid
import msgspec
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import RequestEntityTooLarge

from ..errors import APIError, bad_request, not_found, rate_limited
from ..state import ServerState
from ..tenants import Tenant
from .lines import ENDPOINTS, parse_window, platform_requests, read_jsonl, validate
from .store import TERMINAL


def _json(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status=status, content_type="application/json")


def file_object(f: dict) -> dict:
    return {"id": f["id"], "object": "file", "bytes": f["bytes"], "created_at": f["created_at"],
            "filename": f["filename"], "purpose": f["purpose"], "status": "processed"}


def batch_object(b: dict, progress: dict | None) -> dict:
    errors = json.loads(b["errors"]) if b["errors"] else None
    out = {k: b[k] for k in ("id", "endpoint", "input_file_id", "completion_window",
                             "status", "output_file_id", "error_file_id", "created_at",
                             "in_progress_at", "expires_at", "finalizing_at",
                             "completed_at", "failed_at", "expired_at", "cancelling_at",
                             "cancelled_at")}
    done = b["completed"] + b["failed"]
    out.update(object="batch", errors={"object": "list", "data": errors} if errors else None,
               request_counts={"total": b["total"], "completed": b["completed"],
                               "failed": b["failed"]},
               metadata=json.loads(b["metadata"]) if b["metadata"] else None,
               # Sluice's own: progress, and when the batch will likely be done
               sluice={"progress": done / b["total"] if b["total"] else 1.0,
                       "tokens": b["tokens"], **(progress or {})})
    return out


def register_batch_routes(app: QuartTrio, state: ServerState) -> None:
    cfg = state.settings.batches

    def who() -> Tenant:
        tenant = state.tenants.authenticate(request.headers.get("Authorization"))
        if state.batches is None:
            raise APIError(404, "Batch jobs are off on this server ([batches] enabled).",
                           type="not_found_error", code="batches_disabled")
        return tenant

    async def own_file(file_id: str, tenant: Tenant) -> dict:
        f = await state.batches.store.file(file_id)
        if f is None or f["tenant"] != tenant.name:
            raise not_found(f"No such file: {file_id}", param="file_id", code="file_not_found")
        return f

    async def own_batch(batch_id: str, tenant: Tenant) -> dict:
        b = await state.batches.store.batch(batch_id)
        if b is None or b["tenant"] != tenant.name:
            raise not_found(f"No such batch: {batch_id}", param="batch_id",
                            code="batch_not_found")
        return b

    def answer(b: dict) -> Response:
        return _json(batch_object(b, state.batches.worker.progress(b["id"])))

    @app.post("/v1/files")
    async def upload_file() -> Response:
        tenant = who()
        try:
            form, files = await request.form, await request.files
        except RequestEntityTooLarge:
            raise APIError(413, f"The file is larger than this server's limit of "
                           f"{cfg.max_file_bytes} bytes ([batches] max_file_bytes).",
                           param="file", code="file_too_large") from None
        purpose = form.get("purpose")
        if purpose != "batch":
            raise bad_request(f"`purpose` must be \"batch\" (the only one this server "
                              f"accepts); got {purpose!r}.", param="purpose",
                              code="invalid_purpose")
        upload = files.get("file")
        if upload is None:
            raise bad_request("Send the JSONL file as the multipart field `file`.",
                              param="file")
        content = upload.read()
        if not content.strip():
            raise bad_request("The file is empty.", param="file", code="empty_file")
        f = await state.batches.store.add_file(f"file-{uuid.uuid4().hex}", tenant.name,
                                               "batch", upload.filename or "batch.jsonl",
                                               content)
        return _json(file_object(f))

    @app.get("/v1/files")
    async def list_files() -> Response:
        tenant = who()
        rows = await state.batches.store.list_files(tenant.name, request.args.get("purpose"))
        return _json({"object": "list", "data": [file_object(f) for f in rows]})

    @app.get("/v1/files/<file_id>")
    async def get_file(file_id: str) -> Response:
        return _json(file_object(await own_file(file_id, who())))

    @app.get("/v1/files/<file_id>/content")
    async def file_content(file_id: str) -> Response:
        f = await own_file(file_id, who())
        data = await state.batches.store.file_content(f["id"])
        return Response(data, content_type="application/jsonl")

    @app.delete("/v1/files/<file_id>")
    async def delete_file(file_id: str) -> Response:
        f = await own_file(file_id, who())
        await state.batches.store.delete_file(f["id"])
        return _json({"id": f["id"], "object": "file", "deleted": True})

    @app.post("/v1/batches")
    async def create_batch() -> Response:
        tenant = who()
        try:
            body = json.loads(await request.get_data(cache=False) or b"null")
        except ValueError as e:
            raise bad_request(f"The body is not valid JSON: {e}") from None
        except RecursionError:
            raise bad_request("The body is nested too deeply.") from None
        if not isinstance(body, dict):
            raise bad_request("The body must be a JSON object.")
        store = state.batches.store
        if "requests" in body:  # the platform's form
            unknown = sorted(set(body) - {"requests", "completeWithin", "metadata"})
            if unknown:
                raise bad_request(f"Unknown field(s) {unknown}.", param=unknown[0])
            window = body.get("completeWithin", "24h")
            window_s = parse_window(window, cfg.max_window_s, "completeWithin")
            items = platform_requests(body["requests"], cfg.max_requests)
            endpoint = "/v1/chat/completions"
            jsonl = b"".join(json.dumps(
                {"custom_id": it["custom_id"], "method": "POST", "url": endpoint,
                 "body": it["body"]}).encode() + b"\n" for it in items if isinstance(it, dict))
            f = await store.add_file(f"file-{uuid.uuid4().hex}", tenant.name, "batch",
                                     "requests.jsonl", jsonl)
            input_id = f["id"]
        else:
            unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window",
                                          "metadata"})
            if unknown:
                raise bad_request(f"Unknown field(s) {unknown}.", param=unknown[0])
            endpoint = body.get("endpoint")
            if endpoint not in ENDPOINTS:
                raise bad_request(f"`endpoint` must be one of {sorted(ENDPOINTS)}; got "
                                  f"{endpoint!r}.", param="endpoint", code="invalid_endpoint")
            window = body.get("completion_window", "24h")
            window_s = parse_window(window, cfg.max_window_s)
            input_id = body.get("input_file_id")
            if not isinstance(input_id, str):
                raise bad_request("`input_file_id` is required.", param="input_file_id")
            f = await own_file(input_id, tenant)
            if f["purpose"] != "batch":
                raise bad_request(f"File {input_id} has purpose {f['purpose']!r}, not "
                                  "\"batch\".", param="input_file_id", code="invalid_purpose")
            items = read_jsonl(await store.file_content(input_id), endpoint, cfg.max_requests)
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and all(
                isinstance(v, str) for v in metadata.values()) and len(metadata) <= 16):
            raise bad_request("`metadata` must be an object of at most 16 string values.",
                              param="metadata")
        lines = await validate(state, tenant, items)
        cost = sum(ln.cost for ln in lines)
        quota = tenant.config.max_batch_tokens or cfg.max_pending_tokens
        pending = await store.pending_tokens(tenant.name)
        if pending + cost > quota:
            raise rate_limited(
                f"Tenant `{tenant.name}` has {pending} batch tokens pending; this batch "
                f"needs {cost} more, over its limit of {quota}. Retry once some are done.",
                60.0, code="batch_quota")
        b = await store.add_batch(f"batch_{uuid.uuid4().hex}", tenant.name, endpoint,
                                  input_id, str(window), window_s, metadata, lines)
        state.batches.worker.poke()
        return answer(b)

    @app.get("/v1/batches")
    async def list_batches() -> Response:
        tenant = who()
        try:
            limit = int(request.args.get("limit", 20))
        except ValueError:
            raise bad_request("`limit` must be an integer.", param="limit") from None
        if not 1 <= limit <= 100:
            raise bad_request("`limit` must be between 1 and 100.", param="limit")
        rows = await state.batches.store.list_batches(tenant.name, request.args.get("after"),
                                                      limit + 1)
        data = [batch_object(b, state.batches.worker.progress(b["id"])) for b in rows[:limit]]
        return _json({"object": "list", "data": data,
                      "first_id": data[0]["id"] if data else None,
                      "last_id": data[-1]["id"] if data else None,
                      "has_more": len(rows) > limit})

    @app.get("/v1/batches/<batch_id>")
    async def get_batch(batch_id: str) -> Response:
        return answer(await own_batch(batch_id, who()))

    @app.post("/v1/batches/<batch_id>/cancel")
    async def cancel_batch(batch_id: str) -> Response:
        b = await own_batch(batch_id, who())
        if b["status"] in TERMINAL or b["status"] == "finalizing":
            raise APIError(409, f"Batch {batch_id} is {b['status']}: it cannot be "
                           "cancelled.", code="batch_not_cancellable")
        if b["status"] != "cancelling":
            await state.batches.store.set_status(batch_id, "cancelling")
            state.batches.worker.poke()
        return answer(await state.batches.store.batch(batch_id))

