"""Whose numbers does each of Sluice's CPU weight forms reproduce: the f32 model's, or
llama.cpp's? The same chat prompts (Sluice's token ids, sent to llama.cpp's server as
ids) answered greedily by llama.cpp's server (`/completion`, temperature 0, EOS ignored)
and by Sluice's runner with `quantization` none (the dequantized GGUF in f32), int8
(the default) and q4_1 (the GGUF's Q4_1 / Q8_0 blocks times int8 activations, as
llama.cpp computes them): for each pair, the tokens their answers share before they part,
per question. Greedy answers part at near-ties, so a pair that computes the same numbers
shares whole answers and one that does not parts early. Prints one JSON line.

    .venv/bin/python benchmarks/experiments/llamacpp_agreement.py [--llama-url URL] [--tokens 64]

Without --llama-url it starts the llama.cpp server that benchmarks/llamacpp_vs_sluice.sh
built and cached (run that once first).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
import urllib.request
from itertools import combinations
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: int8_accuracy

from int8_accuracy import QUESTIONS, greedy, runner  # noqa: E402

from model.weights import load_model  # noqa: E402


def shared(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def llama_greedy(url: str, prompt: list[int], n: int) -> list[int]:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1,
            "ignore_eos": True, "cache_prompt": False, "return_tokens": True}
    req = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)["tokens"][:n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-url", default=None)
    ap.add_argument("--port", type=int, default=18984)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    m = load_model("embedded", progress=False)
    proc = None
    url = args.llama_url
    if url is None:
        cache = os.environ.get("SLUICE_CACHE", os.path.expanduser("~/.cache/sluice"))
        servers = glob.glob(f"{cache}/llama.cpp-*/build/bin/llama-server")
        if not servers:
            print(json.dumps({"error": "no cached llama.cpp server: run "
                                       "benchmarks/llamacpp_vs_sluice.sh once"}))
            return 1
        gguf = glob.glob(f"{cache}/*.gguf")[0]
        proc = subprocess.Popen([servers[0], "-m", gguf, "--port", str(args.port), "-np", "1",
                                 "-c", "4096", "-t", str(os.cpu_count())],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{args.port}"
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
    try:
        prompts = [m.tokenizer.encode_chat([{"role": "user", "content": q}])
                   for q in QUESTIONS]
        answers = {"llama.cpp": [llama_greedy(url, p, args.tokens) for p in prompts]}
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    for q in ("none", "int8", "q4_1"):
        r = runner(m, q)
        answers[q] = [greedy(r, p, args.tokens) for p in prompts]
        del r
    out = {"questions": len(QUESTIONS), "answer_tokens": args.tokens, "shared_tokens": {}}
    for a, b in combinations(answers, 2):
        s = [shared(x, y) for x, y in zip(answers[a], answers[b])]
        out["shared_tokens"][f"{a} / {b}"] = {"per_question": s, "total": sum(s)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
