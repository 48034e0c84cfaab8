#!/usr/bin/env bash
# Side by side, one server at a time on 127.0.0.1: fairlane in each mode and, when LLAMA_SERVER points
# at a llama.cpp `llama-server` binary, llama.cpp on the F16 and Q4_1 GGUF files. Each server gets the
# same `fairlane bench serve` run; the reports land in OUT and are printed together at the end.
#
#   LLAMA_SERVER=/path/llama-server F16_GGUF=/path/f16.gguf Q4_GGUF=/path/q4_1.gguf \
#     loadtest/serve_comparison.sh OUT_DIR [CONCURRENCY] [FAIRLANE_MODES]
#
# FAIRLANE_MODES is a comma list of dtype:quantization[:compile], default
# "float32:auto,float32:none" (the default, which keeps the model's own precision, and float32 unquantized; each
# with fairlane's default --compile). DEVICE, when set,
# is passed to fairlane as --device. PROMPT_TOKENS (default 200) sets each request's prompt length: 1500 is
# the long-prompt workload (chat histories, retrieval, agents). MODEL, when set, is fairlane's --model (a
# checkpoint folder: `fairlane bench make-checkpoint` makes the 1.1B one), and SERVE_FLAGS adds flags to
# every fairlane server; F16_GGUF may be left unset to run llama.cpp on the Q4_1 file alone. fairlane
# always compiles before it serves (--compile-wait; seconds where the artifacts are on disk), so no
# level is measured on the eager forward it serves while a first compile runs.
set -euo pipefail
out=${1:?usage: serve_comparison.sh OUT_DIR [CONCURRENCY] [FAIRLANE_MODES]}
concurrency=${2:-1,8,32,64}
modes=${3:-float32:auto,float32:none}
port=${PORT:-8123}
prompt_tokens=${PROMPT_TOKENS:-200}
# llama.cpp splits its context evenly over its 64 slots: each needs the prompt, the 128 output tokens
# and room for the chat template.
llama_ctx=$(( 64 * (prompt_tokens + 384) ))
llama_ctx=$(( llama_ctx > 65536 ? llama_ctx : 65536 ))
bin=$(dirname "$0")/../.venv/bin
mkdir -p "$out"

wait_ready() {  # the server's pid; up to 10 minutes for the model to load (llama.cpp answers 503 while loading)
  for _ in $(seq 1 600); do
    # A server that exited never answers; polling on would hand its port to the next run's server.
    kill -0 "$1" 2>/dev/null || { echo "the server exited before it was ready" >&2; return 1; }
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    sleep 1
  done
  echo "server on port $port never became ready" >&2
  return 1
}

run_one() {  # label, then the server's command line
  local label=$1; shift
  "$@" >"$out/$label.log" 2>&1 &
  local pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  if ! wait_ready "$pid"; then
    kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
    trap - EXIT
    return 0
  fi
  "$bin/fairlane" bench serve --url "http://127.0.0.1:$port" --concurrency "$concurrency" --label "$label" \
    --prompt-tokens "$prompt_tokens" --out "$out/$label.json" || true
  kill "$pid"; wait "$pid" 2>/dev/null || true
  trap - EXIT
}

reports=()
if [ -n "${LLAMA_SERVER:-}" ]; then
  pairs=("llama.cpp-Q4_1:${Q4_GGUF:?}")
  [ -n "${F16_GGUF:-}" ] && pairs=("llama.cpp-F16:$F16_GGUF" "${pairs[@]}")
  for pair in "${pairs[@]}"; do
    label=${pair%%:*}
    run_one "$label" "$LLAMA_SERVER" -m "${pair#*:}" --host 127.0.0.1 --port "$port" -t "$(nproc)" \
      -c "$llama_ctx" -np 64 -cb
    reports+=("$out/$label.json")
  done
fi
for mode in ${modes//,/ }; do
  IFS=: read -r dtype quantization compile <<<"$mode"
  label="fairlane-${mode//:/-}"
  # shellcheck disable=SC2086  # SERVE_FLAGS is a list of flags
  run_one "$label" "$bin/fairlane" serve --port "$port" --dtype "$dtype" --quantization "$quantization" \
    ${compile:+--compile "$compile"} --compile-wait ${DEVICE:+--device "$DEVICE"} ${MODEL:+--model "$MODEL"} \
    --max-num-seqs 64 ${SERVE_FLAGS:-}
  reports+=("$out/$label.json")
done
"$bin/fairlane" bench serve --compare "${reports[@]}" | tee "$out/compare.txt"
