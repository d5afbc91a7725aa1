"""docs/architecture.md stays true: every name its request walk cites imports, and every
file or folder the document names exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
PACKAGES = ("app", "scheduler", "model", "pallas_kernels", "cpu_kernels", "config")


def walk() -> str:
    return DOC.split("## The request walk", 1)[1].split("\n## ", 1)[0]


def resolve(dotted: str):
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_request_walk_names_real_functions_in_at_most_twelve_hops():
    text = walk()
    hops = re.findall(r"^\d+\. ", text, re.M)
    assert 5 <= len(hops) <= 12, len(hops)
    names = {n for n in re.findall(r"`([a-z_]+(?:\.[A-Za-z_]+)+)`", text)
             if n.split(".")[0] in PACKAGES}
    assert len(names) >= 20, sorted(names)
    for name in sorted(names):
        assert callable(resolve(name)), name


def test_every_path_the_document_names_exists():
    paths = set(re.findall(r"\b((?:%s|docs|tests|benchmarks)/[\w/.-]*\w)" % "|".join(PACKAGES),
                           DOC))
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, missing


def test_every_script_the_docs_cite_exists():
    """README.md, docs/*.md and the benchmark READMEs name scripts where they are now
    (the lab history, docs/history/, keeps the paths of its day)."""
    docs = [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
            *sorted((ROOT / "docs").glob("*.md"))]
    cited = {p for doc in docs
             for p in re.findall(r"\bbenchmarks/[\w/.-]*\.(?:py|sh)\b", doc.read_text())}
    assert cited
    missing = sorted(p for p in cited if not (ROOT / p).exists())
    assert not missing, missing
    experiments = ROOT / "benchmarks" / "experiments"
    listed = re.findall(r"^\| `([\w.]+\.(?:py|sh))` \|", (experiments / "README.md").read_text(),
                        re.M)
    assert sorted(listed) == sorted(p.name for p in experiments.iterdir()
                                    if p.suffix in (".py", ".sh"))
