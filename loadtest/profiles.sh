#!/usr/bin/env bash
# The two build profiles side by side in one run (loadtest/README.md):
# `release` (opt-level 1, no LTO, 16 codegen units, the system allocator: the
# README's first command) and
# `dist` (fat LTO, one codegen unit: the Dockerfile, deployments and every
# other load test). Both gateways front the same nginx upstream on SQLite;
# oha alternates between them, round by round, for HTTP/1.1 pass-through,
# h2c pass-through, a replayed key, and fresh keys (loadgen). Writes
# loadtest/results/profiles.md.
#
#   loadtest/profiles.sh [SECONDS_PER_MEASUREMENT] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-5}
ROUNDS=${2:-3}
CONC=${CONC:-50}
WORK=$(mktemp -d /tmp/idemgate-profiles.XXXX)
command -v oha >/dev/null || cargo install oha --locked
command -v nginx >/dev/null || { apt-get update -qq && apt-get install -y -qq nginx-light || apt-get install -y -qq nginx; }
cargo build --release -q --bins
cargo build --profile dist --features jemalloc -q --bins
cargo build --profile dist --features jemalloc -q --example loadgen
REV=$(git rev-parse --short HEAD)

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$WORK/up/nginx.pid" ] && kill "$(cat "$WORK/up/nginx.pid")" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

mkdir -p "$WORK/up"
printf '%s\n' "worker_processes 2;" "pid $WORK/up/nginx.pid;" "error_log $WORK/up/error.log warn;" \
  "events { worker_connections 8192; }" \
  "http { access_log off; keepalive_requests 1000000; client_body_temp_path $WORK/up;" \
  "  server { listen 127.0.0.1:18081; location / { default_type application/json; return 200 '{\"ok\":true}'; } } }" \
  > "$WORK/up/nginx.conf"
nginx -p "$WORK/up" -c "$WORK/up/nginx.conf"

gateway() { # profile port admin-port
  printf '%s\n' "[server]" "listen = \"127.0.0.1:$2\"" "admin_listen = \"127.0.0.1:$3\"" "max_connections = 20000" \
    "[store]" "database_url = \"sqlite://$WORK/$1.db\"" \
    "[[upstreams]]" "name = \"nginx\"" "url = \"http://127.0.0.1:18081\"" \
    "[[routes]]" "name = \"pass\"" "methods = [\"GET\"]" "path_prefix = \"/pass/\"" "upstream = \"nginx\"" \
    "[[routes]]" "name = \"key\"" "methods = [\"POST\"]" "path_prefix = \"/key/\"" "upstream = \"nginx\"" \
    "idempotency = \"key\"" > "$WORK/$1.toml"
  IDEMGATE_LOG=warn setsid "target/$1/idemgate" serve --config "$WORK/$1.toml" & pids+=($!)
}
gateway release 18380 18390
gateway dist 18480 18490
for port in 18380 18480; do
  for _ in $(seq 1 100); do curl -s -o /dev/null "http://127.0.0.1:$port/pass/x" && break; sleep 0.1; done
done

RES="$WORK/results.jsonl"
: > "$RES"
oha_run() { # scenario profile url [oha args...]
  local scenario=$1 profile=$2 url=$3; shift 3
  oha -z "${SECS}s" -c "$CONC" --no-tui --output-format json "$@" "$url" 2>/dev/null | python3 -c "
import json,sys
d=json.load(sys.stdin); ok=sum(v for k,v in d['statusCodeDistribution'].items() if int(k)<500)
print(json.dumps({'scenario':'$scenario','profile':'$profile','rps':ok/d['summary']['total'],
  'p99_ms':(d['latencyPercentiles']['p99'] or 0)*1000}))" >> "$RES"
}
fresh_run() { # profile port
  target/dist/examples/loadgen unique "http://127.0.0.1:$2/key/f" "$CONC" "$SECS" | python3 -c "
import json,sys
d=json.loads(sys.stdin.read()); print(json.dumps({'scenario':'fresh keys (SQLite)','profile':'$1','rps':d['rps'],'p99_ms':d.get('p99_ms',0)}))" >> "$RES"
}
for r in $(seq 1 "$ROUNDS"); do
  order="release dist"; (( r % 2 )) || order="dist release"
  for p in $order; do
    port=18380; [ "$p" = dist ] && port=18480
    oha_run "pass-through HTTP/1.1" "$p" "http://127.0.0.1:$port/pass/x"
    oha_run "pass-through h2c" "$p" "http://127.0.0.1:$port/pass/x" --http2
    oha_run "replay" "$p" "http://127.0.0.1:$port/key/r" -m POST -H 'Idempotency-Key: replay-key' -d '{"a":1}'
    fresh_run "$p" "$port"
  done
done

python3 - "$RES" "$REV" "$SECS" "$ROUNDS" "$CONC" > loadtest/results/profiles.md <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rev, secs, rounds, conc = sys.argv[2:6]
print(f"# Build profiles side by side ({rev})\n")
print(f"`loadtest/profiles.sh {secs} {rounds}`: `release` (opt-level 1, no LTO, 16 codegen units, system allocator) and `dist` (opt-level 3, fat LTO, one codegen unit, jemalloc) gateways on SQLite in front of one nginx upstream, 2 workers each, `-c {conc}`, alternating every round; median of {rounds} rounds.\n")
print("| scenario | release req/s | dist req/s | dist / release | release p99 ms | dist p99 ms |")
print("|---|---|---|---|---|---|")
for scenario in dict.fromkeys(r['scenario'] for r in rows):
    med = lambda p, k: statistics.median(r[k] for r in rows if r['scenario'] == scenario and r['profile'] == p)
    rel, dist = med('release', 'rps'), med('dist', 'rps')
    print(f"| {scenario} | {rel:,.0f} | {dist:,.0f} | {dist/rel:.2f}x | {med('release','p99_ms'):.1f} | {med('dist','p99_ms'):.1f} |")
PY
cat loadtest/results/profiles.md
