#!/usr/bin/env bash
# What structured outputs and log probabilities cost: one fairlane server, the same `fairlane bench serve`
# requests three ways one after another (plain; response_format json_schema; logprobs with top_logprobs 5),
# then plain once more, at 1 and 16 streams by default, and the reports side by side (ratios to the first
# plain run). The second plain run shows how far the server drifted over the run (memory, caches):
# a variant is only slower than plain if it is slower than both plain runs.
#
#   loadtest/surface_cost.sh OUT_DIR [CONCURRENCY] [-- fairlane serve options...]
set -euo pipefail
out=${1:?usage: surface_cost.sh OUT_DIR [CONCURRENCY] [-- serve options]}
concurrency=${2:-1,16}
shift $(( $# >= 2 ? 2 : 1 )); [ "${1:-}" = "--" ] && shift
port=${PORT:-8124}
bin=$(dirname "$0")/../.venv/bin
mkdir -p "$out"
schema='{"type":"object","properties":{"title":{"type":"string"},"facts":{"type":"array","items":{"type":"string"}}},"required":["title","facts"]}'
"$bin/fairlane" serve --port "$port" --max-num-seqs 64 "$@" >"$out/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
run() {  # label, seed (distinct prompts, so no run finds another's in the prefix cache), extra body
  "$bin/fairlane" bench serve --url "http://127.0.0.1:$port" --concurrency "$concurrency" --label "$1" \
    --seed "$2" --extra-body "$3" --out "$out/$1.json"
}
run plain 1 '{}'
run json_schema 2 "{\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"facts\",\"schema\":$schema}}}"
run logprobs 3 '{"logprobs":true,"top_logprobs":5}'
run plain-again 4 '{}'
"$bin/fairlane" bench serve --compare "$out/plain.json" "$out/json_schema.json" "$out/logprobs.json" \
  "$out/plain-again.json" | tee "$out/compare.txt"
