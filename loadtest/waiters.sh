#!/usr/bin/env bash
# Waiters across instances (docs/semantics.md, "Waiting duplicates", loadtest/README.md): two real gateway
# processes on one Postgres, the demo upstream holding the first request of
# each round for DELAY_MS, DUPLICATES waiting copies on the other instance;
# how long after the first client's answer each waiter gets its own. Run
# once with Postgres LISTEN/NOTIFY, once with Redis pub/sub; then the same
# two gateways on MariaDB, which has no such channel: without Redis (the
# safety poll) and with Redis pub/sub. Writes
# loadtest/results/waiters.md. Only 127.0.0.1 is targeted.
#
#   loadtest/waiters.sh [ROUNDS] [DUPLICATES] [DELAY_MS]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-20}
DUPLICATES=${2:-20}
DELAY_MS=${3:-1000}
PG_URL=${IDEMGATE_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
# A server URL without a database: each run gets a database of its own.
MY_URL=${IDEMGATE_BENCH_MYSQL_URL:-mysql://root@127.0.0.1:3306}
my() { mariadb -h127.0.0.1 -P"${MY_URL##*:}" -uroot "$@"; }
WORK=$(mktemp -d /tmp/idemgate-waiters.XXXX)
SCHEMA="bench_waiters_$$"
scripts/services.sh >/dev/null
if [ -n "${IDEMGATE_BIN_DIR:-}" ]; then
  BIN=$IDEMGATE_BIN_DIR
else
  cargo build --profile dist --features jemalloc -q --bins
  cargo build --profile dist --features jemalloc -q --example waiters_bench
  BIN=target/dist
fi
EXAMPLE=${WAITERS_BENCH:-target/dist/examples/waiters_bench}

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  psql -q "$PG_URL" -c "DROP SCHEMA IF EXISTS $SCHEMA CASCADE" 2>/dev/null || true
  my -e "DROP DATABASE IF EXISTS $SCHEMA" 2>/dev/null || true
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_up() { for _ in $(seq 100); do curl -sf "$1" >/dev/null && return 0; sleep 0.1; done; echo "not up: $1" >&2; exit 1; }

UP=$(free_port)
"$BIN/demo-upstream" "127.0.0.1:$UP" >"$WORK/upstream.log" 2>&1 & pids+=($!)
wait_up "http://127.0.0.1:$UP/healthz"

run() { # name redis_url [mariadb]
  local db
  if [ "${3:-}" = mariadb ]; then
    my -e "DROP DATABASE IF EXISTS $SCHEMA; CREATE DATABASE $SCHEMA"
    db="$MY_URL/$SCHEMA"
  else
    psql -q "$PG_URL" -c "DROP SCHEMA IF EXISTS $SCHEMA CASCADE; CREATE SCHEMA $SCHEMA"
    db="$PG_URL?options[search_path]=$SCHEMA"
  fi
  curl -s -X POST "http://127.0.0.1:$UP/reset" >/dev/null
  local urls=() gw=()
  for i in a b; do
    local port admin
    port=$(free_port); admin=$(free_port)
    cat > "$WORK/$i.toml" <<TOML
[server]
listen = "127.0.0.1:$port"
admin_listen = "127.0.0.1:$admin"
[store]
database_url = "$db"
redis_url = "$2"
redis_prefix = "bench-$$-$1:"
[[upstreams]]
name = "demo"
url = "http://127.0.0.1:$UP"
timeout = "5s"
[[routes]]
name = "actions"
methods = ["POST"]
path_prefix = "/actions/"
upstream = "demo"
idempotency = "key"
on_concurrent = "wait"
TOML
    IDEMGATE_LOG=warn "$BIN/idemgate" serve --config "$WORK/$i.toml" >"$WORK/$i-$1.log" 2>&1 &
    gw+=($!); pids+=($!)
    wait_up "http://127.0.0.1:$admin/healthz"
    urls+=("http://127.0.0.1:$port")
  done
  local line
  line=$("$EXAMPLE" "${urls[0]}" "${urls[1]}" "http://127.0.0.1:$UP" "$ROUNDS" "$DUPLICATES" "$DELAY_MS")
  echo "$1 $line"
  for p in "${gw[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  echo "$line" | python3 -c '
import json, sys
d = json.load(sys.stdin)
l = d["lag_ms"]
print("| %s | %d | %s | %s | %s | %s | %d / %d | %s | %s |" % (sys.argv[1], d["waiters"], l["min"], l["median"], l["p90"], l["max"], d["executions"], d["rounds"], d["peak_copies"], json.dumps(d["statuses"])))
' "$1" >>"$WORK/table.md"
}

run postgres-notify ""
run redis-pubsub "redis://127.0.0.1:6379/"
run mariadb-poll "" mariadb
run mariadb-redis-pubsub "redis://127.0.0.1:6379/" mariadb

{
  echo "# Waiters across two instances ($(date -u +%Y-%m-%d), $(git rev-parse --short HEAD))"
  echo
  echo "\`loadtest/waiters.sh $ROUNDS $DUPLICATES $DELAY_MS\`: per round, the first request on instance A held ${DELAY_MS} ms by the upstream, $DUPLICATES duplicates waiting on instance B. Lag = a waiter's answer after the first client's."
  echo
  echo "| channel | waiters | lag min ms | median | p90 | max | executions / rounds | peak copies | statuses |"
  echo "|---|---|---|---|---|---|---|---|---|"
  cat "$WORK/table.md"
} | tee loadtest/results/waiters.md
