"""The import rules of docs/architecture.md, checked on the source.

`app -> scheduler, model, config`; `model -> pallas_kernels, cpu_kernels, config,
scheduler.protocol`; `pallas_kernels -> cpu_kernels` (the CPU backend calls the native
kernels); `scheduler -> config` only; `cpu_kernels` and `config` import nothing of ours.
Beyond the arrows: the scheduler never imports JAX and only its engine (engine.py,
delivery.py) imports trio; model/, pallas_kernels/ and cpu_kernels/ import nothing of
the HTTP stack (they run on an accelerator image that has none of it, nor msgspec, which
config/ needs: model/ imports config only inside functions); app/ imports model/ (and so
JAX) only inside functions of the modules that load models, so `import app.cli` and
`sluice chat` start without JAX.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"app", "scheduler", "model", "pallas_kernels", "cpu_kernels", "config"}
HTTP = {"quart", "quart_trio", "hypercorn", "trio", "httpx", "msgspec"}


def imports(package: str) -> list[tuple[str, str, bool]]:
    """(file, imported top-level name, at module level?) for every absolute import."""
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        inner = {id(n) for f in ast.walk(tree)
                 if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            rel = str(path.relative_to(ROOT))
            out += [(rel, n, id(node) not in inner) for n in names]
    return out


def third_party(name: str) -> bool:
    top = name.split(".")[0]
    return top not in OURS and top not in sys.stdlib_module_names and top != "__future__"


@pytest.mark.parametrize("package, allowed", [
    ("scheduler", {"config", "scheduler"}),
    ("pallas_kernels", {"pallas_kernels", "cpu_kernels"}),
    ("cpu_kernels", {"cpu_kernels"}),
    ("config", {"config"}),
])
def test_packages_import_only_what_the_arrows_allow(package, allowed):
    bad = [(f, n) for f, n, _ in imports(package)
           if n.split(".")[0] in OURS and n.split(".")[0] not in allowed]
    assert not bad, bad


def test_scheduler_is_pure_policy():
    for f, n, _ in imports("scheduler"):
        top = n.split(".")[0]
        assert top in OURS or top in sys.stdlib_module_names or top == "__future__" or (
            top == "trio" and f in ("scheduler/engine.py", "scheduler/delivery.py")), (f, n)


def test_kernels_and_config_need_only_their_libraries():
    for f, n, _ in [*imports("pallas_kernels"), *imports("cpu_kernels")]:
        assert not third_party(n) or n.split(".")[0] in {"jax", "numpy"}, (f, n)
    for f, n, _ in imports("config"):
        assert not third_party(n) or n == "msgspec", (f, n)


def test_model_runs_without_the_http_stack():
    for f, n, top_level in imports("model"):
        first = n.split(".")[0]
        assert first not in HTTP and first != "app", (f, n)
        if first == "scheduler":
            assert n == "scheduler.protocol", (f, n)  # the plan/result types it implements
        if first == "config":
            assert not top_level, f"{f}: config (msgspec) only inside functions"


def test_app_imports_model_only_inside_loading_functions():
    loaders = {"app/loading.py", "app/cli.py", "app/serve.py"}
    for f, n, top_level in imports("app"):
        if n.split(".")[0] in {"model", "pallas_kernels", "cpu_kernels", "jax", "flax"}:
            assert not top_level and f in loaders, (f, n)
