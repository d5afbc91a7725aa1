"""Fuzz every endpoint described by /openapi.json with schemathesis: no 5xx, no hang, no
response outside the spec, invalid data refused. The server runs in this test's nursery
and schemathesis in a subprocess against it.

Not checked: `positive_data_acceptance` (schema-valid bodies must get 2xx), because some
rules span fields and are not in the schema (e.g. `top_logprobs` needs `logprobs`).
"""

from __future__ import annotations

import re
import sys

import pytest
import trio

from tests.app.harness import serve, settings

pytest.importorskip("schemathesis", reason="schemathesis is not installed (a dev dependency)")

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance,negative_data_rejection,unsupported_method")


async def test_schemathesis_finds_nothing(tmp_path):
    cfg = settings(admin_key="admin", pool={"max_loras": 2})  # the adapter endpoints too
    async with serve(cfg, max_context=256) as srv:
        cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{srv.url}/openapi.json",
               "-H", "Authorization: Bearer admin",
               "--checks", CHECKS, "--max-examples", "25", "--seed", "1", "--no-color",
               "--generation-database", "none", "--workers", "2", "--request-timeout", "10"]
        with trio.fail_after(300):
            done = await trio.run_process(cmd, check=False, capture_stdout=True,
                                          capture_stderr=True, cwd=tmp_path)
        out = done.stdout.decode(errors="replace")
        assert done.returncode == 0, out[-8000:] + done.stderr.decode(errors="replace")[-2000:]
        # Every generated case passed. (Warnings are expected: random adapter paths are
        # mostly refused, and unloading adapters that do not exist answers 404.)
        assert re.search(r"(\d+) generated, \1 passed", out), out[-4000:]
        assert "failure" not in out.rsplit("\n", 2)[-2], out[-4000:]
        await srv.wait_idle()
        assert srv.pages_in_use() == 0
        async with srv.client() as http:
            assert (await http.get("/health")).status_code == 200
