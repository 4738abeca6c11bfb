#!/usr/bin/env bash
# First requests on SQLite against SQLite's own ceiling (loadtest/README.md):
# one gateway on SQLite (2 workers) in front of nginx answering a small JSON
# body, `loadgen unique` (a new key every request) at 50 connections, beside
# the yardstick — one-row INSERT ... ON CONFLICT DO NOTHING transactions on
# a SQLite file with the gateway's pragmas (WAL, synchronous = FULL), from
# Python's sqlite3 module — alternating over the rounds. BEFORE_BIN=PATH
# measures another build's `idemgate` in the same rounds. Writes
# loadtest/results/sqlite-ceiling.md. Only 127.0.0.1 is targeted.
#
#   loadtest/sqlite_ceiling.sh [SECONDS] [ROUNDS]      # defaults 10 3
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-10}
ROUNDS=${2:-3}
REV=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!loadtest/results' || echo -dirty)
if [ -n "${IDEMGATE_BIN_DIR:-}" ]; then
  BIN=$IDEMGATE_BIN_DIR
else
  cargo build --profile dist --features jemalloc -q --bins
  cargo build --profile dist --features jemalloc -q --example loadgen
  BIN=target/dist
fi
LOADGEN=${LOADGEN:-target/dist/examples/loadgen}
command -v nginx >/dev/null || { echo "nginx is needed (loadtest/run.sh installs it)" >&2; exit 1; }
WORK=$(mktemp -d /tmp/idemgate-sqlite-ceiling.XXXX)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_up() { for _ in $(seq 100); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done; echo "not up: $1" >&2; exit 1; }
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

UP=$(free_port); GW=$(free_port); ADMIN=$(free_port)
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
cat > "$WORK/idemgate.toml" <<TOML
[server]
listen = "127.0.0.1:$GW"
admin_listen = "127.0.0.1:$ADMIN"
worker_threads = 2
[store]
database_url = "sqlite://$WORK/records.db"
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

# One gateway run: name, binary.
gateway() {
  rm -f "$WORK"/records.db*
  IDEMGATE_LOG=warn setsid "$2" serve --config "$WORK/idemgate.toml" >"$WORK/gateway.log" 2>&1 &
  local pid=$!
  wait_up "http://127.0.0.1:$ADMIN/healthz"
  "$LOADGEN" unique "http://127.0.0.1:$GW/key/new" 50 "$SECS" |
    python3 -c "import json,sys; d=json.load(sys.stdin); print('$1', d['rps'], d['p50_ms'], d['p99_ms'], d['errors'])" >> "$WORK/rows"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

# The yardstick: one row per transaction, the gateway's pragmas.
ceiling() {
  python3 - "$WORK/ceiling.db" "$SECS" >> "$WORK/rows" <<'PY'
import sqlite3, sys, time
path, secs = sys.argv[1], float(sys.argv[2])
db = sqlite3.connect(path, isolation_level=None)
db.execute("pragma journal_mode=wal")
db.execute("pragma synchronous=full")
db.execute("create table if not exists t (k text primary key, v integer)")
n, start = 0, time.time()
while time.time() - start < secs:
    db.execute("begin immediate")
    db.execute("insert into t values (?, ?) on conflict do nothing", (f"{start}-{n}", n))
    db.execute("commit")
    n += 1
print("sqlite-one-row-insert", n / (time.time() - start), 0, 0, 0)
PY
}

: > "$WORK/rows"
for round in $(seq "$ROUNDS"); do
  # Reverse order on even rounds: a drift in the machine falls on all alike.
  targets=(ceiling after ${BEFORE_BIN:+before})
  [ $((round % 2)) = 0 ] && targets=(${BEFORE_BIN:+before} after ceiling)
  for t in "${targets[@]}"; do
    case $t in
      ceiling) ceiling ;;
      after) gateway "idemgate-sqlite" "$BIN/idemgate" ;;
      before) gateway "idemgate-sqlite-before" "$BEFORE_BIN" ;;
    esac
  done
done

python3 - "$WORK/rows" "$SECS" "$ROUNDS" "$REV" "${BEFORE_BIN:+1}" <<'PY' | tee loadtest/results/sqlite-ceiling.md
import statistics, sys, time
rows, secs, rounds, rev, before = sys.argv[1:]
runs = {}
for line in open(rows):
    name, rps, p50, p99, errors = line.split()
    runs.setdefault(name, []).append((float(rps), float(p50), float(p99), int(errors)))
base = statistics.median(r[0] for r in runs["sqlite-one-row-insert"])
print(f"# First requests on SQLite against SQLite's ceiling ({time.strftime('%Y-%m-%d')}, {rev})\n")
print(f"`loadtest/sqlite_ceiling.sh {secs} {rounds}`{' with `BEFORE_BIN`' if before else ''}: medians of {rounds} alternating rounds of {secs} s; the gateway (2 workers, SQLite) in front of nginx, `loadgen unique` at 50 connections; the yardstick inserts one row per transaction into a SQLite file with the gateway's pragmas (WAL, synchronous = FULL). Every round's req/s in brackets.\n")
print("| target | req/s | p50 ms | p99 ms | errors | ratio |")
print("|---|---|---|---|---|---|")
for name in ("sqlite-one-row-insert", "idemgate-sqlite-before", "idemgate-sqlite"):
    if name not in runs:
        continue
    r = runs[name]
    rps = statistics.median(x[0] for x in r)
    each = ", ".join(f"{x[0]:,.0f}" for x in r)
    lat = (lambda i: f"{statistics.median(x[i] for x in r):.1f}" if name != "sqlite-one-row-insert" else "—")
    print(f"| {name} | {rps:,.0f} ({each}) | {lat(1)} | {lat(2)} | {sum(x[3] for x in r)} | {rps / base:.2f}× |")
PY
