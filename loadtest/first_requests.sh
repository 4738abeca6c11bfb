#!/usr/bin/env bash
# Where a first request's time goes (issue: first requests past the
# one-row ceiling): a private Postgres with pg_stat_statements, the shared
# Redis, one gateway (Redis + Postgres) in front of nginx, and `loadgen`
# sending a new key every request. Prints, per first request: Postgres
# statements by kind (calls, rows, mean ms), commits, WAL bytes and Redis
# commands; and the rate. Then the peer (idempotent-proxy-server, when on
# PATH or in IDEMGATE_PEER) under the same load, with its CPU per request
# by party. Then, on the same Postgres and cores, the
# yardstick — pgbench inserting one row per transaction (16 clients, as
# run.sh) — with its CPU per insert by party. Writes
# loadtest/results/first-requests.md.
#   loadtest/first_requests.sh [SECONDS] [CONCURRENCY]
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-10}
CONC=${2:-50}
PGBIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
WORK=$(mktemp -d /tmp/idemgate-first.XXXX)
PORT=55432
OUT=loadtest/results/first-requests.md
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$WORK/up/nginx.pid" ] && kill "$(cat "$WORK/up/nginx.pid")" 2>/dev/null || true
  su postgres -c "$PGBIN/pg_ctl -D $WORK/pg -m immediate stop" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT
scripts/services.sh >/dev/null
cargo build --profile dist --features jemalloc -q --bins
cargo build --profile dist --features jemalloc -q --example loadgen
BIN=target/dist

# A private Postgres (the shared one must not be restarted to preload the
# extension), with the shared server's durability: fsync on every commit.
chown postgres "$WORK"
su postgres -c "$PGBIN/initdb -D $WORK/pg -A trust -U postgres" >/dev/null
cat >> "$WORK/pg/postgresql.conf" <<CONF
port = $PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$WORK'
shared_preload_libraries = 'pg_stat_statements'
pg_stat_statements.track = all
max_connections = 200
CONF
su postgres -c "$PGBIN/pg_ctl -D $WORK/pg -l $WORK/pg.log -w start" >/dev/null
PG="postgres://postgres@127.0.0.1:$PORT/postgres"
psql -q "$PG" -c "CREATE EXTENSION pg_stat_statements"

command -v nginx >/dev/null || { apt-get update -qq && apt-get install -y -qq nginx-light || apt-get install -y -qq nginx; } >/dev/null
mkdir -p "$WORK/up"
cat > "$WORK/up/nginx.conf" <<CONF
worker_processes 1;
pid $WORK/up/nginx.pid;
error_log $WORK/up/error.log warn;
events { worker_connections 4096; }
http { access_log off; client_body_temp_path $WORK/up;
  server { listen 127.0.0.1:18581; location / { return 201 '{"ok":true}'; } } }
CONF
nginx -p "$WORK/up" -c "$WORK/up/nginx.conf"

PREFIX="first-$(date +%s):"
cat > "$WORK/idemgate.toml" <<CONF
[server]
listen = "127.0.0.1:18580"
admin_listen = "127.0.0.1:18590"
worker_threads = 2
[store]
database_url = "$PG"
redis_url = "redis://127.0.0.1:6379/"
redis_prefix = "$PREFIX"
[[upstreams]]
name = "nginx"
url = "http://127.0.0.1:18581"
[[routes]]
name = "key"
methods = ["POST"]
path_prefix = "/key/"
upstream = "nginx"
idempotency = "key"
CONF
IDEMGATE_LOG=warn setsid $BIN/idemgate serve --config "$WORK/idemgate.toml" & pids+=($!)
for _ in $(seq 1 100); do curl -s -o /dev/null http://127.0.0.1:18580/ && break; sleep 0.1; done
# Warm up (connections, prepared statements, partitions), then count.
$BIN/examples/loadgen unique http://127.0.0.1:18580/key/warm "$CONC" 2 >/dev/null
psql -q "$PG" -c "SELECT pg_stat_statements_reset()" -c "SELECT pg_stat_reset()" >/dev/null
redis-cli CONFIG RESETSTAT >/dev/null
# CPU time (clock ticks) of each party: the gateway, Postgres (postmaster
# and its backends), Redis, nginx, and the whole machine.
GW=${pids[0]}
PGMAIN=$(head -1 "$WORK/pg/postmaster.pid")
ticks() { # pids… → utime + stime
  local t=0 p
  for p in "$@"; do
    [ -r "/proc/$p/stat" ] && t=$(( t + $(awk '{print $14 + $15}' "/proc/$p/stat") ))
  done
  echo "$t"
}
# Backends that exited (pgbench's, at its end) count in the postmaster's
# reaped children's time.
reaped() { awk '{print $16 + $17}' "/proc/$1/stat"; }
cpu_all() {
  echo "gateway $(ticks "$GW")"
  echo "postgres $(( $(ticks "$PGMAIN" $(pgrep -P "$PGMAIN")) + $(reaped "$PGMAIN") ))"
  echo "redis $(ticks $(pgrep -x redis-server))"
  local ngx; ngx=$(cat "$WORK/up/nginx.pid")
  echo "nginx $(ticks "$ngx" $(pgrep -P "$ngx"))"
  echo "machine $(awk '/^cpu / {print $2 + $3 + $4 + $7 + $8}' /proc/stat)"
}
CPU0=$(cpu_all)
WAL0=$(psql -qAt "$PG" -c "SELECT pg_current_wal_lsn()")
RUN=$($BIN/examples/loadgen unique http://127.0.0.1:18580/key/new "$CONC" "$SECS")
WAL1=$(psql -qAt "$PG" -c "SELECT pg_current_wal_lsn()")
CPU1=$(cpu_all)
N=$(echo "$RUN" | python3 -c "import json,sys; d=json.load(sys.stdin); print(int(d['rps']*$SECS))")
RPS=$(echo "$RUN" | python3 -c "import json,sys; d=json.load(sys.stdin); print(f\"{d['rps']:.0f}/s, p50 {d['p50_ms']:.2f} ms, p99 {d['p99_ms']:.2f} ms\")")
{
  echo "# First requests, where the time goes — $(date -u +%Y-%m-%d) ($(git rev-parse --short HEAD))"
  echo
  echo "\`loadtest/first_requests.sh $SECS $CONC\`: one gateway (Redis + Postgres, 2 worker threads) in front of"
  echo "nginx, \`loadgen unique\` (a new key every request) at $CONC connections for ${SECS}s, on the 2 cores"
  echo "that also run Postgres (private, pg_stat_statements), Redis, nginx and the load generator."
  echo
  echo "Rate: $RPS; $N first requests counted."
  echo
  echo "## CPU, per first request"
  echo
  echo "| party | CPU µs / request | share of the machine's busy time |"
  echo "|---|---|---|"
  paste <(echo "$CPU0") <(echo "$CPU1") | awk -v n="$N" -v hz="$(getconf CLK_TCK)" '
    { d[$1] = $4 - $2; order[NR] = $1 }
    END { m = d["machine"]; known = 0
      for (i = 1; i <= NR; i++) { k = order[i]; if (k == "machine") continue; known += d[k]
        printf "| %s | %.0f | %.0f %% |\n", k, d[k] * 1e6 / hz / n, 100 * d[k] / m }
      printf "| the load generator and the rest | %.0f | %.0f %% |\n", (m - known) * 1e6 / hz / n, 100 * (m - known) / m
      printf "| the machine (2 cores) | %.0f | 100 %% |\n", m * 1e6 / hz / n }'
  echo
  echo "## Postgres, per first request"
  echo
  echo "| statement | calls / request | rows / call | mean ms | share of statement time |"
  echo "|---|---|---|---|---|"
  psql -qAt -F '|' "$PG" -c "
    WITH s AS (SELECT regexp_replace(left(query, 70), '\s+', ' ', 'g') AS q, calls, rows, total_exec_time, mean_exec_time
               FROM pg_stat_statements WHERE calls > 0),
         t AS (SELECT sum(total_exec_time) AS all_ms FROM s)
    SELECT '| \`' || q || '…\`', round(calls::numeric / $N, 3), round(rows::numeric / calls, 1),
           round(mean_exec_time::numeric, 3), round((100 * total_exec_time / all_ms)::numeric, 1) || ' % |'
    FROM s, t WHERE calls::numeric / $N >= 0.001 ORDER BY total_exec_time DESC LIMIT 12" | sed 's/|$//'
  echo
  echo "Commits per request: $(psql -qAt "$PG" -c "SELECT round(xact_commit::numeric / $N, 3) FROM pg_stat_database WHERE datname = 'postgres'")."
  echo "WAL per request: $(psql -qAt "$PG" -c "SELECT round(pg_wal_lsn_diff('$WAL1', '$WAL0') / $N) ") bytes."
  echo
  echo "## Redis, per first request"
  echo
  echo "| command | calls / request | µs per call |"
  echo "|---|---|---|"
  redis-cli INFO commandstats | tr -d '\r' | grep '^cmdstat_' | grep -v -E 'cmdstat_(info|config)' \
    | sed -E 's/cmdstat_([^:]+):calls=([0-9]+),usec=[0-9]+,usec_per_call=([0-9.]+).*/\1 \2 \3/' \
    | awk -v n="$N" '{ if ($2 / n >= 0.001) printf "| %s | %.3f | %s |\n", $1, $2 / n, $3 }'
} | tee "$OUT"

# The peer (idempotent-proxy-server, Redis only), when installed: the same
# load on the same nginx and Redis, with the CPU of each party per request.
# What a fresh key costs it, against what the gateway's costs, is the
# account of the ratio run.sh measures beside it.
kill "${pids[0]}" 2>/dev/null || true
PEER=${IDEMGATE_PEER:-$(command -v idempotent-proxy-server || true)}
if [ -n "$PEER" ]; then
  mkdir -p "$WORK/peer"
  cat > "$WORK/peer/.env" <<CONF
SERVER_ADDR=127.0.0.1:18582
REDIS_URL=redis://127.0.0.1:6379/
REQUEST_TIMEOUT=30000
LOG_LEVEL=warn
URL_UP=http://127.0.0.1:18581/key/peer
CONF
  (cd "$WORK/peer" && exec setsid "$PEER" >/dev/null 2>"$WORK/peer/stderr") & pids+=($!)
  PEER_PID=$!
  for _ in $(seq 1 100); do curl -s -o /dev/null http://127.0.0.1:18582/ && break; sleep 0.1; done
  $BIN/examples/loadgen unique http://127.0.0.1:18582/URL_UP "$CONC" 2 >/dev/null
  GW=$PEER_PID
  PP0=$(cpu_all)
  PEER_RUN=$($BIN/examples/loadgen unique http://127.0.0.1:18582/URL_UP "$CONC" "$SECS")
  PP1=$(cpu_all)
  kill "$PEER_PID" 2>/dev/null || true
  PN=$(echo "$PEER_RUN" | python3 -c "import json,sys; d=json.load(sys.stdin); print(int(d['rps']*$SECS))")
  PRPS=$(echo "$PEER_RUN" | python3 -c "import json,sys; d=json.load(sys.stdin); print(f\"{d['rps']:.0f}/s, p50 {d['p50_ms']:.2f} ms, p99 {d['p99_ms']:.2f} ms\")")
  {
    echo
    echo "## Beside the peer: idempotent-proxy-server, a fresh key per request, same load"
    echo
    echo "Its claims and answers in Redis only (nothing durable). Rate: $PRPS. CPU per request:"
    echo
    echo "| party | CPU µs / request |"
    echo "|---|---|"
    paste <(echo "$PP0") <(echo "$PP1") | awk -v n="$PN" -v hz="$(getconf CLK_TCK)" '
      { d[$1] = $4 - $2; order[NR] = $1 }
      END { known = 0
        for (i = 1; i <= NR; i++) { k = order[i]; if (k == "machine" || k == "postgres") continue; known += d[k]
          printf "| %s | %.0f |\n", (k == "gateway" ? "the peer" : k), d[k] * 1e6 / hz / n }
        printf "| the load generator and the rest | %.0f |\n", (d["machine"] - known - d["postgres"]) * 1e6 / hz / n
        printf "| the machine (2 cores) | %.0f |\n", d["machine"] * 1e6 / hz / n }'
  } | tee -a "$OUT"
else
  echo "peer: idempotent-proxy-server not installed; its section is skipped (IDEMGATE_PEER names it)"
fi

# The yardstick on the same Postgres: one row per transaction, fsync'd.
psql -q "$PG" -c "CREATE TABLE raw (k text PRIMARY KEY, v bigint)"
cat > "$WORK/pgbench.sql" <<'SQL'
\set k random(1, 1000000000)
INSERT INTO raw (k, v) VALUES (:client_id || '-' || :k, 1) ON CONFLICT DO NOTHING;
SQL
PB0=$(cpu_all)
BENCH=$("$PGBIN/pgbench" -n -h 127.0.0.1 -p "$PORT" -U postgres -c 16 -j 2 -T "$SECS" -f "$WORK/pgbench.sql" postgres 2>/dev/null)
PB1=$(cpu_all)
TPS=$(echo "$BENCH" | awk '/^tps = / {printf "%.0f", $3}')
TX=$(( TPS * SECS ))
{
  echo
  echo "## The yardstick: pgbench, one row per transaction, same Postgres and cores"
  echo
  echo "\`pgbench -c 16 -j 2 -T $SECS\`: $TPS inserts/s. CPU per insert:"
  echo
  echo "| party | CPU µs / insert |"
  echo "|---|---|"
  paste <(echo "$PB0") <(echo "$PB1") | awk -v n="$TX" -v hz="$(getconf CLK_TCK)" '
    { d[$1] = $4 - $2 }
    END { printf "| postgres | %.0f |\n", d["postgres"] * 1e6 / hz / n
      printf "| pgbench and the rest | %.0f |\n", (d["machine"] - d["postgres"] - d["gateway"] - d["redis"] - d["nginx"]) * 1e6 / hz / n
      printf "| the machine (2 cores) | %.0f |\n", d["machine"] * 1e6 / hz / n }'
} | tee -a "$OUT"
