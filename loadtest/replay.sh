#!/usr/bin/env bash
# Replay of one completed key on Redis + Postgres, beside the peer
# (loadtest/README.md, "replay.sh"): the gateway (2 workers) in front of
# nginx, `oha -c 50` repeating one key, alternating over the rounds with
# idempotent-proxy-server (when installed; Redis only) on the same nginx and
# Redis, and with the gateway on SQLite (the in-process fast layer) for
# reference. BEFORE_BIN=PATH measures another build's `idemgate` in the same
# rounds. Writes loadtest/results/replay.md. Only 127.0.0.1 is targeted.
#
#   loadtest/replay.sh [SECONDS] [ROUNDS]      # defaults 5 3
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-5}
ROUNDS=${2:-3}
REV=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!loadtest/results' || echo -dirty)
if [ -n "${IDEMGATE_BIN_DIR:-}" ]; then
  BIN=$IDEMGATE_BIN_DIR
else
  cargo build --profile dist --features jemalloc -q --bins
  BIN=target/dist
fi
command -v nginx >/dev/null || { echo "nginx is needed (loadtest/run.sh installs it)" >&2; exit 1; }
command -v oha >/dev/null || { echo "oha is needed (loadtest/run.sh installs it)" >&2; exit 1; }
PEER=${IDEMGATE_PEER:-$(command -v idempotent-proxy-server || true)}
[ -n "$PEER" ] || echo "peer: idempotent-proxy-server not installed; its rows are skipped (IDEMGATE_PEER names it)"
PG_URL=${IDEMGATE_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
scripts/services.sh >/dev/null
WORK=$(mktemp -d /tmp/idemgate-replay.XXXX)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_up() { for _ in $(seq 100); do curl -s -o /dev/null "$1" && return 0; sleep 0.1; done; echo "not up: $1" >&2; exit 1; }
pids=()
RUN_ID=$(date +%s%N)
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for s in after before; do psql -q "$PG_URL" -c "DROP SCHEMA IF EXISTS replay_${s}_$RUN_ID CASCADE" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

UP=$(free_port)
cat > "$WORK/nginx.conf" <<NGINX
worker_processes 1;
daemon off;
error_log $WORK/nginx-error.log warn;
pid $WORK/nginx.pid;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $WORK/b; proxy_temp_path $WORK/p; fastcgi_temp_path $WORK/f;
  uwsgi_temp_path $WORK/u; scgi_temp_path $WORK/s;
  server { listen 127.0.0.1:$UP; location / { default_type application/json; return 201 '{"ok":true}'; } }
}
NGINX
setsid nginx -c "$WORK/nginx.conf" >"$WORK/nginx.out" 2>&1 & pids+=($!)

# One gateway: name, binary, [store] lines. Sets PORT_<name>.
gateway() {
  local name=$1 bin=$2 store=$3 port admin
  port=$(free_port); admin=$(free_port)
  cat > "$WORK/$name.toml" <<TOML
[server]
listen = "127.0.0.1:$port"
admin_listen = "127.0.0.1:$admin"
worker_threads = 2
[store]
$store
[[upstreams]]
name = "static"
url = "http://127.0.0.1:$UP"
timeout = "5s"
[[routes]]
name = "key"
methods = ["POST"]
path_prefix = "/key/"
upstream = "static"
idempotency = "key"
TOML
  IDEMGATE_LOG=warn setsid "$bin" serve --config "$WORK/$name.toml" >"$WORK/$name.log" 2>&1 & pids+=($!)
  wait_up "http://127.0.0.1:$admin/healthz"
  printf -v "PORT_${name//-/_}" %s "$port"
}
redis_pg() { # a schema and a Redis prefix of the run's own, per gateway
  local schema="replay_$1_$RUN_ID"
  psql -q "$PG_URL" -c "CREATE SCHEMA $schema"
  printf 'database_url = "%s?options[search_path]=%s"\nredis_url = "redis://127.0.0.1:6379/"\nredis_prefix = "replay-%s-%s:"' \
    "$PG_URL" "$schema" "$1" "$RUN_ID"
}
gateway after "$BIN/idemgate" "$(redis_pg after)"
[ -n "${BEFORE_BIN:-}" ] && gateway before "$BEFORE_BIN" "$(redis_pg before)"
gateway sqlite "$BIN/idemgate" "database_url = \"sqlite://$WORK/records.db\""
if [ -n "$PEER" ]; then
  PORT_peer=$(free_port)
  mkdir -p "$WORK/peer"
  cat > "$WORK/peer/.env" <<ENV
SERVER_ADDR=127.0.0.1:$PORT_peer
REDIS_URL=redis://127.0.0.1:6379/
REQUEST_TIMEOUT=30000
LOG_LEVEL=warn
URL_UP=http://127.0.0.1:$UP/key/peer
ENV
  (cd "$WORK/peer" && exec setsid "$PEER" >/dev/null 2>"$WORK/peer/stderr") & pids+=($!)
  wait_up "http://127.0.0.1:$PORT_peer/"
fi

# One replay run: name, URL. The key is completed first (the peer keeps
# its answer for REQUEST_TIMEOUT only, so each run stores it afresh).
replay() {
  local key="replay-$1-$(date +%s%N)"
  curl -s -o /dev/null -X POST -H "Idempotency-Key: $key" -d '{"a":1}' "$2"
  oha -z "${SECS}s" -c 50 --no-tui --output-format json -m POST \
      -H "Idempotency-Key: $key" -d '{"a":1}' "$2" 2>/dev/null |
    python3 -c "
import json,sys
d=json.load(sys.stdin); ok=sum(v for k,v in d['statusCodeDistribution'].items() if int(k)<500)
bad=sum(v for k,v in d['statusCodeDistribution'].items() if int(k)>=500)
print('$1', ok/d['summary']['total'], (d['latencyPercentiles']['p50'] or 0)*1000, (d['latencyPercentiles']['p99'] or 0)*1000, bad)" >> "$WORK/rows"
}

: > "$WORK/rows"
for round in $(seq "$ROUNDS"); do
  # Reverse order on even rounds: a drift in the machine falls on all alike.
  targets=(after ${BEFORE_BIN:+before} sqlite ${PEER:+peer})
  [ $((round % 2)) = 0 ] && targets=(${PEER:+peer} sqlite ${BEFORE_BIN:+before} after)
  for t in "${targets[@]}"; do
    case $t in
      after) replay idemgate-redis-pg "http://127.0.0.1:$PORT_after/key/r" ;;
      before) replay idemgate-redis-pg-before "http://127.0.0.1:$PORT_before/key/r" ;;
      sqlite) replay idemgate-sqlite "http://127.0.0.1:$PORT_sqlite/key/r" ;;
      peer) replay peer-redis "http://127.0.0.1:$PORT_peer/URL_UP" ;;
    esac
  done
done

python3 - "$WORK/rows" "$SECS" "$ROUNDS" "$REV" "${BEFORE_BIN:+1}" <<'PY' | tee loadtest/results/replay.md
import statistics, sys, time
rows, secs, rounds, rev, before = sys.argv[1:]
runs = {}
for line in open(rows):
    name, rps, p50, p99, bad = line.split()
    runs.setdefault(name, []).append((float(rps), float(p50), float(p99), int(bad)))
print(f"# Replay of one key, beside the peer ({time.strftime('%Y-%m-%d')}, {rev})\n")
print(f"`loadtest/replay.sh {secs} {rounds}`{' with `BEFORE_BIN`' if before else ''}: medians of {rounds} alternating rounds of {secs} s, `oha -c 50` repeating one completed key; each gateway has 2 workers and sits in front of nginx. Every round's req/s in brackets; 5xx answers are counted, not in req/s.\n")
base = "peer-redis" if "peer-redis" in runs else "idemgate-redis-pg"
med = lambda name: statistics.median(x[0] for x in runs[name])
print("| target | req/s | p50 ms | p99 ms | 5xx | ratio |")
print("|---|---|---|---|---|---|")
for name in ("idemgate-redis-pg", "idemgate-redis-pg-before", "idemgate-sqlite", "peer-redis"):
    if name not in runs:
        continue
    r = runs[name]
    each = ", ".join(f"{x[0]:,.0f}" for x in r)
    print(f"| {name} | {med(name):,.0f} ({each}) | {statistics.median(x[1] for x in r):.2f} | {statistics.median(x[2] for x in r):.2f} | {sum(x[3] for x in r)} | {med(name) / med(base):.2f}× {base} |")
PY
