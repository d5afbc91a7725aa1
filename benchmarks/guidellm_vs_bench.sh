#!/usr/bin/env bash
# GuideLLM 0.8.1 and `sluice bench` against one default server, same load: the
# shared-prefix customer (a 2,000-token system prompt, a 65-token question, 256-token
# answers with ignore_eos, greedy), 16 streams started over 20 s, 48 measured requests
# after 2 warm-up ones. `sluice bench` runs before and after GuideLLM (this machine's
# speed drifts over minutes). GuideLLM counts tokens with the server's own tokenizer,
# exported by `sluice export-tokenizer`, and runs offline; one GuideLLM request alone
# first caches its prefix (COLD=1: not, the server meets GuideLLM's prefix cold).
#
# GuideLLM needs torch, transformers and datasets, so it lives in a venv of its own:
#   python3 -m venv /opt/guidellm && /opt/guidellm/bin/pip install guidellm==0.8.1
#   GUIDELLM=/opt/guidellm/bin/guidellm benchmarks/guidellm_vs_bench.sh OUT_DIR [PORT]
# Prints one JSON object comparing the three runs (benchmarks/guidellm_compare.py).
set -eu
cd "$(dirname "$0")/.."
OUT=${1:?OUT_DIR}; PORT=${2:-18970}
GUIDELLM=${GUIDELLM:-guidellm}
mkdir -p "$OUT"
. benchmarks/serve_ready.sh
serve_ready "$OUT" "$PORT"
URL="http://127.0.0.1:$PORT"
MODEL=$(curl -s "$URL/v1/models" | .venv/bin/python -c \
  'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
.venv/bin/sluice export-tokenizer "${SLUICE_MODEL:-embedded}" "$OUT/tokenizer" > /dev/null

.venv/bin/python - "$OUT" "$URL" "$MODEL" <<'PY'
import json, sys
out, url, model = sys.argv[1:]
scenario = {"spec": {
    "backend": {"kind": "openai_http", "target": url, "model": model,
                "request_format": "/v1/chat/completions",
                "extras": {"body": {"temperature": 0}}},
    "profile": {"kind": "concurrent", "streams": [16], "rampup_duration": 20,
                "warmup": {"value": 2, "mode": "requests"}},
    "data": [{"kind": "synthetic_text", "prefix_tokens": 2000, "prefix_count": 1,
              "prompt_tokens": 65, "output_tokens": 256}],
    "tokenizer": {"kind": "huggingface_auto", "model": f"{out}/tokenizer"},
    "constraints": [{"kind": "max_requests", "count": 50}],
    "outputs": [{"kind": "json", "path": f"{out}/guidellm.json"}],
}}
json.dump(scenario, open(f"{out}/scenario.json", "w"), indent=1)
# One request of the same synthetic data first, alone: GuideLLM's prefix (same seed, same
# text) is then cached, as `sluice bench --warmup-requests` has its system prompt cached.
# Without it the 2,000-token prefix is computed while the first streams arrive, the ones
# that wait for it start (and, with fixed-length answers, keep finishing) together, and
# TTFT measures those bursts (docs/benchmarks.md, "GuideLLM").
warm = json.loads(json.dumps(scenario))
warm["spec"].update(profile={"kind": "synchronous"},
                    constraints=[{"kind": "max_requests", "count": 1}],
                    outputs=[{"kind": "json", "path": f"{out}/guidellm-warm.json"}])
json.dump(warm, open(f"{out}/scenario-warm.json", "w"), indent=1)
PY

BENCH=".venv/bin/sluice bench --url $URL --workload shared-prefix --concurrency 16 \
  --ramp-up 20 --warmup-requests 2 --requests 48 --max-tokens 256 --ignore-eos \
  --no-progress"
$BENCH --label bench-before --out "$OUT/bench-before" | tail -1 > "$OUT/bench-before.json"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ -z "${COLD:-}" ]; then
  "$GUIDELLM" run --scenario "$OUT/scenario-warm.json" --disable-progress \
    > "$OUT/guidellm-warm.log" 2>&1
fi
"$GUIDELLM" run --scenario "$OUT/scenario.json" --disable-progress > "$OUT/guidellm.log" 2>&1
$BENCH --label bench-after --out "$OUT/bench-after" | tail -1 > "$OUT/bench-after.json"
.venv/bin/python benchmarks/guidellm_compare.py "$OUT"
