"""The benchmark scripts that drive benchmarks/polite_load.py's `Load` themselves (flood.py,
slo_sweep.py) build its options from its own parser, so an option added there reaches
them (an option added without them once broke both)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import flood  # noqa: E402
import polite_load  # noqa: E402
import slo_sweep  # noqa: E402


def test_options_are_the_parsers_defaults_with_overrides():
    args = polite_load.options("http://127.0.0.1:1", concurrency=3, seed=7)
    assert (args.concurrency, args.seed, args.workload) == (3, 7, "shared-prefix")
    with pytest.raises(TypeError):
        polite_load.options("http://127.0.0.1:1", no_such_option=1)
    load = polite_load.Load(args)
    body = load.body(0, "m")
    assert body["messages"][0]["role"] == "system" and body["stream"] is True
    repeat = polite_load.Load(polite_load.options("http://x", workload="repeat")).body(1, "m")
    assert repeat["messages"][0]["role"] == "user"


def test_flood_and_the_sweep_build_their_load_from_those_options():
    for script in (flood, slo_sweep):
        source = Path(script.__file__).read_text()
        assert "options(" in source and "argparse.Namespace(url" not in source
