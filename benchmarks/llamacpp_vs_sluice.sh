#!/usr/bin/env bash
# llama.cpp's server against Sluice on this machine, same GGUF (the embedded
# SmolLM2-135M-Instruct Q4_1), same load generator (`sluice bench`, clients that honour
# Retry-After), one server at a time. llama.cpp is built from PyPI's llama-cpp-python
# sdist (its vendored llama.cpp; CMake, CPU only), cached under ~/.cache/sluice, and run in
# its best CPU configuration as measured for issue 20 (`-np 16 -c 65536 -fa off -t NPROC`).
# Workloads: shared-prefix (2,000-token system prompt, prefix warmed) at 16 streams, 48
# requests; long-interference (a 6,000-token prompt among 4 short streams); one stream of
# short prompts; "polite": shared-prefix at 16 streams again, from an independent client
# that waits out every 429 and counts TTFT from a request's first send
# (benchmarks/polite_load.py: 48 requests after 16 of warm-up; OUT/polite-*.json). Sluice
# runs with its default config plus SLUICE_SERVE_ARGS (e.g. "--quantization int8").
# WORKLOADS picks some of the four (llama.cpp 0.3.36 never finished shared-prefix here
# while it ran with -kvu, now only for long-interference: below), and "repeat": answers that repeat the prompt
# (polite_load.py --workload repeat, greedy, 160 tokens) at 1 and 4 streams, each server
# with and without speculative decoding: llama.cpp with LLAMA_SPEC_ARGS (default
# "--spec-type ngram-simple --spec-draft-n-max 4", its prompt lookup), Sluice with its
# default (n-gram) and with --speculative off (OUT/repeat-<server>-c<N>.json).
# EMBEDDED picks the embedded model both serve (default smollm2-135m; gemma3-270m: the
# Q4_K_M Gemma 3, which Sluice serves as `--model embedded:gemma3-270m`).
# Prints JSON lines (benchmarks/compare_bench.py).
#   benchmarks/llamacpp_vs_sluice.sh OUT_DIR [PORT]
#   EMBEDDED=gemma3-270m WORKLOADS="single polite" benchmarks/llamacpp_vs_sluice.sh OUT
set -eu
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:?OUT_DIR}"); PORT=${2:-18985}
mkdir -p "$OUT"
CACHE=${SLUICE_CACHE:-$HOME/.cache/sluice}
EMBEDDED=${EMBEDDED:-smollm2-135m}
GGUF=$(.venv/bin/sluice fetch "$EMBEDDED" | tail -1)
case "$EMBEDDED" in
  smollm2-135m) ALIAS=smollm2-135m-instruct; MODEL_ARGS="";;
  *) ALIAS=$EMBEDDED; MODEL_ARGS="--model embedded:$EMBEDDED";;
esac
THREADS=$(nproc)

# -- llama.cpp's server, built once ------------------------------------------------------
SERVER=$(ls "$CACHE"/llama.cpp-*/build/bin/llama-server 2>/dev/null | head -1 || true)
if [ -z "$SERVER" ]; then  # (a half-built tree from an interrupted run is rebuilt)
  rm -rf "$CACHE"/llama.cpp-*
  mkdir -p "$CACHE/sdist"
  .venv/bin/pip download --no-deps --no-binary :all: llama-cpp-python -d "$CACHE/sdist" -q
  SDIST=$(ls "$CACHE"/sdist/llama_cpp_python-*.tar.gz | tail -1)
  VER=$(basename "$SDIST" .tar.gz | sed 's/llama_cpp_python-//')
  SRC="$CACHE/llama.cpp-$VER"
  rm -rf "$SRC.tmp" && mkdir -p "$SRC.tmp"
  tar -xzf "$SDIST" -C "$SRC.tmp" --strip-components=3 "llama_cpp_python-$VER/vendor/llama.cpp"
  mv "$SRC.tmp" "$SRC"
  # Without AMX: llama.cpp 0.3.36's AMX kernel (tinygemm_kernel_amx) dies with SIGILL on
  # the first matmul on a Sapphire Rapids machine (2026-12-02); where the CPU has no AMX
  # these flags change nothing.
  NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON > "$OUT/llama-build.log" 2>&1
  cmake --build "$SRC/build" --target llama-server -j "$THREADS" >> "$OUT/llama-build.log" 2>&1
  SERVER="$SRC/build/bin/llama-server"
fi

URL="http://127.0.0.1:$PORT"
# Words per token, measured once against Sluice's /tokenize (llama.cpp's differs).
WPT=${WPT:-0.8767}
bench() {  # label, then `sluice bench` flags
  local label=$1; shift
  .venv/bin/sluice bench --url "$URL" --label "$label" --words-per-token "$WPT" \
    --no-progress --out "$OUT/$label" "$@" | tail -1 > "$OUT/$label.json"
}
WORKLOADS=${WORKLOADS:-shared-prefix long-interference single}
workloads() {  # prefix: llama / sluice
  case " $WORKLOADS " in *" polite "*)
    .venv/bin/python benchmarks/polite_load.py "$URL" --concurrency 16 --requests 48 \
      --warmup-requests 16 > "$OUT/polite-$1.json";; esac
  case " $WORKLOADS " in *" shared-prefix "*)
    bench "$1-shared-prefix" --workload shared-prefix --concurrency 16 --ramp-up 20 \
      --warmup-requests 2 --requests 48;; esac
  case " $WORKLOADS " in *" long-interference "*)
    bench "$1-long-interference" --workload long-interference;; esac
  case " $WORKLOADS " in *" single "*)
    bench "$1-single" --workload shared-prefix --system-tokens 30 --concurrency 1 \
      --warmup-requests 1 --requests 10;; esac
  repeat "$1"
}
repeat() {  # label: the repeat workload at 1 and 4 streams
  case " $WORKLOADS " in *" repeat "*)
    for c in 1 4; do
      .venv/bin/python benchmarks/polite_load.py "$URL" --workload repeat --concurrency "$c" \
        --requests $((4 * c)) --warmup-requests "$c" --max-tokens 160 > "$OUT/repeat-$1-c$c.json"
    done;; esac
}
LLAMA_SPEC_ARGS=${LLAMA_SPEC_ARGS:---spec-type ngram-simple --spec-draft-n-max 4}

# -kvu: one KV buffer for all slots (this llama.cpp splits -c over -np slots otherwise:
# 4,096 tokens each, too few for the 6,000-token prompt; the first run, 2026-12-02). Only
# for long-interference: with it every slot's attention spans the whole 65,536-token
# buffer, and 16 shared-prefix streams crawl at ~0.15 tok/s a slot (never finishing).
KVU=""
case " $WORKLOADS " in *" long-interference "*) KVU="-kvu";; esac
# shellcheck disable=SC2086
"$SERVER" -m "$GGUF" --port "$PORT" -np 16 -c 65536 $KVU -fa off -t "$THREADS" \
  --alias "$ALIAS" > "$OUT/llama-server.log" 2>&1 &
LPID=$!
trap 'kill $LPID 2>/dev/null || true' EXIT
until curl -sf "$URL/health" > /dev/null; do sleep 1; done
workloads llama
ps -o rss= -p $LPID | awk '{print $1 * 1024}' > "$OUT/llama-rss-bytes"
kill $LPID; wait $LPID 2>/dev/null || true
case " $WORKLOADS " in *" repeat "*)  # llama.cpp with its own speculative decoding
  # shellcheck disable=SC2086
  "$SERVER" -m "$GGUF" --port "$PORT" -np 16 -c 65536 $KVU -fa off -t "$THREADS" \
    --alias "$ALIAS" $LLAMA_SPEC_ARGS > "$OUT/llama-spec-server.log" 2>&1 &
  LPID=$!
  until curl -sf "$URL/health" > /dev/null; do sleep 1; done
  repeat llama-spec
  kill $LPID; wait $LPID 2>/dev/null || true;; esac

. benchmarks/serve_ready.sh
serve_ready "$OUT" "$PORT" $MODEL_ARGS ${SLUICE_SERVE_ARGS:-}
workloads sluice
ps -o rss= -p $PID | awk '{print $1 * 1024}' > "$OUT/sluice-rss-bytes"
case " $WORKLOADS " in *" repeat "*)  # Sluice without speculative decoding
  kill -INT "$PID"; wait "$PID" 2>/dev/null || true
  mkdir -p "$OUT/no-spec"
  # shellcheck disable=SC2086
  serve_ready "$OUT/no-spec" "$PORT" $MODEL_ARGS ${SLUICE_SERVE_ARGS:-} --speculative off
  repeat sluice-off;; esac
if ls "$OUT"/llama-*.json > /dev/null 2>&1; then
  .venv/bin/python benchmarks/compare_bench.py "$OUT"/llama-*.json "$OUT"/sluice-*.json
fi
if [ -f "$OUT/polite-sluice.json" ]; then cat "$OUT"/polite-llama.json "$OUT"/polite-sluice.json; fi
if ls "$OUT"/repeat-*.json > /dev/null 2>&1; then
  for f in "$OUT"/repeat-*.json; do
    printf '{"run": "%s", "result": %s}\n' "$(basename "$f" .json)" "$(cat "$f")"
  done
fi
