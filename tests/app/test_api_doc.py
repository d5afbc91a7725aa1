"""docs/api.md against /openapi.json: every endpoint the spec describes and every request
parameter of the completion endpoints has its row, so the page cannot fall behind the
Structs that decode requests."""

from __future__ import annotations

import json
from pathlib import Path

from app.openapi import openapi_spec

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _rows() -> list[str]:
    return [line for line in DOC.read_text().splitlines() if line.startswith("| ")]


def test_every_endpoint_has_a_row():
    spec = json.loads(openapi_spec())
    rows = "\n".join(_rows())
    missing = [f"{method.upper()} {path}" for path, ops in spec["paths"].items()
               for method in ops if f"{method.upper()} {path}`" not in rows]
    assert not missing, missing


def test_every_completion_parameter_has_a_row():
    components = json.loads(openapi_spec())["components"]["schemas"]
    rows = "\n".join(_rows())
    missing = []
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        for name in components[request]["properties"]:
            if f"`{name}`" not in rows and f"`{name}." not in rows:
                missing.append(f"{request}.{name}")
    for name in components["StreamOptions"]["properties"]:
        if f"`stream_options.{name}`" not in rows:
            missing.append(f"StreamOptions.{name}")
    assert not missing, missing


def test_every_responses_parameter_has_a_row():
    components = json.loads(openapi_spec())["components"]["schemas"]
    text = DOC.read_text()
    section = text.split("## Responses", 1)[1].split("\n## ", 1)[0]
    rows = "\n".join(line for line in section.splitlines() if line.startswith("| "))
    missing = [name for name in components["ResponsesRequest"]["properties"]
               if f"`{name}`" not in rows]
    assert not missing, missing
