"""llguidance (what Sluice uses, app/grammar.py) against xgrammar on this model's tokenizer:
per new JSON schema, the time to compile it and compute the first token mask; then the
time of each further mask along a valid answer (the per-token cost paid in every step).
Prints one JSON line.

xgrammar needs torch and transformers, which Sluice's own venv does not carry: run this in
GuideLLM's venv (benchmarks/guidellm_vs_bench.sh says how to make one) with llguidance added,
from the repository root:

    .venv/bin/sluice export-tokenizer embedded /tmp/tok
    /opt/guidellm/bin/pip install llguidance
    PYTHONPATH=. /opt/guidellm/bin/python benchmarks/experiments/grammar_engines.py --tokenizer /tmp/tok
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import tokenizers

from app.grammar import JSON_DEFAULTS, Grammars, json_schema_grammar

_spec = importlib.util.spec_from_file_location(
    "grammar_compile", Path(__file__).with_name("grammar_compile.py"))
_gc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gc)  # the same schemas as the in-service compile benchmark


class _Tok:  # what app.grammar.Grammars reads of model.tokenizer.Tokenizer
    def __init__(self, path: Path) -> None:
        self.hf = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        self.eos_token_ids = frozenset({self.hf.token_to_id(cfg["eos_token"])})


def instance(schema: dict) -> str:
    """A valid answer to `schema(...)`, in the no-free-whitespace form both engines take."""
    values = {"string": "Paris", "integer": 42, "number": 3.5, "boolean": True}
    obj = {k: values[p["type"]] for k, p in schema["properties"].items() if k != "items"}
    obj["items"] = [{"name": "bread", "qty": 2}, {"name": "cheese", "qty": 1}]
    return json.dumps(obj, separators=(",", ":"))


def ms(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": round(1e3 * statistics.median(xs), 4),
            "p99_ms": round(1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], 4)}


def walk(name: str, new, fill, accept, schemas: list[dict], answers: list[list[int]]):
    """Per schema: time `new(schema)` + the first `fill(m)`; then along its answer,
    `accept(m, token)` (untimed) and each next `fill(m)` (timed)."""
    first, masks = [], []
    for s, ids in zip(schemas, answers):
        t0 = time.perf_counter()
        m = new(s)
        fill(m)
        first.append(time.perf_counter() - t0)
        for i, t in enumerate(ids):
            if not accept(m, t):
                raise RuntimeError(f"{name} refused token {i} of a valid answer")
            t0 = time.perf_counter()
            fill(m)
            masks.append(time.perf_counter() - t0)
    return first, masks


def run_llguidance(tok: _Tok, vocab: int, schemas: list[dict], answers: list[list[int]]):
    t0 = time.perf_counter()
    grammars = Grammars(tok, vocab)
    grammars._ll_tokenizer()
    setup = time.perf_counter() - t0
    row = np.zeros((vocab + 31) // 32, np.int32)
    return (setup, *walk("llguidance", lambda s: grammars.constraint(json_schema_grammar(s)),
                         lambda c: c.fill(row), lambda c, t: c.accept(t), schemas, answers))


def run_xgrammar(path: Path, vocab: int, schemas: list[dict], answers: list[list[int]]):
    import transformers
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(
        transformers.AutoTokenizer.from_pretrained(str(path)), vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    return (setup, *walk(
        "xgrammar", lambda s: xgr.GrammarMatcher(compiler.compile_json_schema(
            json.dumps(s), any_whitespace=False, separators=(",", ":"))),
        lambda m: m.fill_next_token_bitmask(bitmask), lambda m, t: m.accept_token(t),
        schemas, answers))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, required=True,
                    help="a directory from `sluice export-tokenizer`")
    ap.add_argument("--n", type=int, default=20, help="distinct schemas (default 20)")
    ap.add_argument("--vocab", type=int, default=49152, help="the model's vocabulary")
    args = ap.parse_args(argv)
    tok = _Tok(args.tokenizer)
    schemas = [_gc.schema(i, "bench") for i in range(args.n)]
    answers = [tok.hf.encode(instance(s), add_special_tokens=False).ids for s in schemas]
    out = {"schemas": args.n, "answer_tokens": sum(map(len, answers)),
           "json_defaults": JSON_DEFAULTS}
    for name, fn in [("llguidance", lambda: run_llguidance(tok, args.vocab, schemas, answers)),
                     ("xgrammar", lambda: run_xgrammar(args.tokenizer, args.vocab, schemas,
                                                       answers))]:
        setup, first, masks = fn()
        out[name] = {"tokenizer_setup_s": round(setup, 3),
                     "new_schema_to_first_mask": ms(first), "mask_per_token": ms(masks)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
