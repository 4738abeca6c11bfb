#!/usr/bin/env bash
# The MySQL store on a private MariaDB (the machine's own build, default
# durability: innodb_flush_log_at_trx_commit = 1), side by side in one run:
#
# 1. First requests against the server's own ceiling: one gateway
#    (MariaDB alone, no Redis, 2 worker threads) in front of nginx,
#    `loadgen unique` (a new key every request); then `mariadb-slap`
#    inserting one row per autocommit transaction (16 clients) on the same
#    server and cores. CPU per first request and per committed row, by
#    party, and the server's statement counters per first request.
# 2. Retention at scale: store_bench's claim + complete cycles on an empty
#    record table and on one holding LIVE live records (alternated, two
#    rounds); then a sweep retiring EXPIRED expired records alone, and
#    again beside claims at c=16.
#
# Writes loadtest/results/mariadb.md.
#   loadtest/mariadb.sh [SECONDS] [CONCURRENCY] [LIVE_ROWS] [EXPIRED_ROWS]
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-10}
CONC=${2:-50}
LIVE=${3:-10000000}
EXPIRED=${4:-1000000}
WORK=$(mktemp -d /tmp/idemgate-mariadb.XXXX)
PORT=53306
OUT=loadtest/results/mariadb.md
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$WORK/up/nginx.pid" ] && kill "$(cat "$WORK/up/nginx.pid")" 2>/dev/null || true
  [ -n "${DB_PID:-}" ] && kill -9 "$DB_PID" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
scripts/services.sh >/dev/null
# IDEMGATE_BIN_DIR: binaries built already (its examples/ beside them).
if [ -n "${IDEMGATE_BIN_DIR:-}" ]; then
  BIN=$IDEMGATE_BIN_DIR
else
  cargo build --profile dist --features jemalloc -q --bins
  cargo build --profile dist --features jemalloc -q --example loadgen --example store_bench
  BIN=target/dist
fi

# The private server: its CPU is this benchmark's alone.
chown mysql:mysql "$WORK"
mariadb-install-db --no-defaults --user=mysql --datadir="$WORK/db" \
  --auth-root-authentication-method=normal --skip-test-db >/dev/null 2>&1
setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$WORK/db" \
  --socket="$WORK/db.sock" --pid-file="$WORK/db.pid" --log-error="$WORK/db.err" \
  --port=$PORT --bind-address=127.0.0.1 --skip-name-resolve \
  --innodb-buffer-pool-size=2G --innodb-log-file-size=512M --max-connections=500 \
  >/dev/null 2>&1 &
DB_PID=$!
my() { mariadb -h127.0.0.1 -P$PORT -uroot "$@"; }
for _ in $(seq 1 100); do my -e "SELECT 1" >/dev/null 2>&1 && break; sleep 0.2; done
my -e "CREATE DATABASE bench; CREATE DATABASE scale_empty; CREATE DATABASE scale_full; CREATE DATABASE slap"
URL="mysql://root@127.0.0.1:$PORT"

command -v nginx >/dev/null || { apt-get update -qq && apt-get install -y -qq nginx-light; } >/dev/null
mkdir -p "$WORK/up"
cat > "$WORK/up/nginx.conf" <<CONF
worker_processes 1;
pid $WORK/up/nginx.pid;
error_log $WORK/up/error.log warn;
events { worker_connections 4096; }
http { access_log off; client_body_temp_path $WORK/up;
  server { listen 127.0.0.1:18681; location / { return 201 '{"ok":true}'; } } }
CONF
nginx -p "$WORK/up" -c "$WORK/up/nginx.conf"

cat > "$WORK/idemgate.toml" <<CONF
[server]
listen = "127.0.0.1:18680"
admin_listen = "127.0.0.1:18690"
worker_threads = 2
[store]
database_url = "$URL/bench"
[[upstreams]]
name = "nginx"
url = "http://127.0.0.1:18681"
[[routes]]
name = "key"
methods = ["POST"]
path_prefix = "/key/"
upstream = "nginx"
idempotency = "key"
CONF
IDEMGATE_LOG=warn setsid $BIN/idemgate serve --config "$WORK/idemgate.toml" & pids+=($!)
GW=${pids[0]}
for _ in $(seq 1 100); do curl -s -o /dev/null http://127.0.0.1:18680/ && break; sleep 0.1; done
$BIN/examples/loadgen unique http://127.0.0.1:18680/key/warm "$CONC" 2 >/dev/null

ticks() { # pids… → utime + stime
  local t=0 p
  for p in "$@"; do
    [ -r "/proc/$p/stat" ] && t=$(( t + $(awk '{print $14 + $15}' "/proc/$p/stat") ))
  done
  echo "$t"
}
cpu_all() {
  echo "gateway $(ticks "$GW")"
  echo "mariadb $(ticks "$DB_PID")"
  local ngx; ngx=$(cat "$WORK/up/nginx.pid")
  echo "nginx $(ticks "$ngx" $(pgrep -P "$ngx"))"
  echo "machine $(awk '/^cpu / {print $2 + $3 + $4 + $7 + $8}' /proc/stat)"
}
COUNTERS="'Com_insert','Com_update','Com_select','Com_delete','Com_commit','Com_begin','Handler_commit','Innodb_os_log_fsyncs','Innodb_data_fsyncs','Innodb_os_log_written','Innodb_row_lock_waits','Innodb_deadlocks'"
counters() { my -N -e "SELECT VARIABLE_NAME, VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME IN ($(echo "$COUNTERS" | tr 'a-z' 'A-Z')) ORDER BY VARIABLE_NAME"; }
per_party() { # before after n → table rows
  paste <(echo "$1") <(echo "$2") | awk -v n="$3" -v hz="$(getconf CLK_TCK)" '
    { d[$1] = $4 - $2; order[NR] = $1 }
    END { m = d["machine"]; known = 0
      for (i = 1; i <= NR; i++) { k = order[i]; if (k == "machine") continue; known += d[k]
        printf "| %s | %.0f | %.0f %% |\n", k, d[k] * 1e6 / hz / n, 100 * d[k] / m }
      printf "| the load generator and the rest | %.0f | %.0f %% |\n", (m - known) * 1e6 / hz / n, 100 * (m - known) / m
      printf "| the machine (2 cores) | %.0f | 100 %% |\n", m * 1e6 / hz / n }'
}
mariadb_us() { # before after n → the server's CPU µs per unit
  paste <(echo "$1") <(echo "$2") | awk -v n="$3" -v hz="$(getconf CLK_TCK)" '$1 == "mariadb" { printf "%.0f", ($4 - $2) * 1e6 / hz / n }'
}

echo "first requests" >&2
S0=$(counters); CPU0=$(cpu_all)
RUN=$($BIN/examples/loadgen unique http://127.0.0.1:18680/key/new "$CONC" "$SECS")
CPU1=$(cpu_all); S1=$(counters)
N=$(echo "$RUN" | python3 -c "import json,sys; d=json.load(sys.stdin); print(int(d['rps']*$SECS))")
RPS=$(echo "$RUN" | python3 -c "import json,sys; d=json.load(sys.stdin); print(f\"{d['rps']:.0f}/s, p50 {d['p50_ms']:.2f} ms, p99 {d['p99_ms']:.2f} ms\")")
kill "$GW" 2>/dev/null || true

echo "the ceiling: mariadb-slap" >&2
my slap -e "CREATE TABLE raw (k VARBINARY(64) PRIMARY KEY, v BIGINT) ENGINE = InnoDB"
SLAP_N=$(( N > 20000 ? N : 20000 ))
P0=$(counters); PB0=$(cpu_all)
SLAP_START=$(date +%s.%N)
mariadb-slap -h127.0.0.1 -P$PORT -uroot --create-schema=slap --concurrency=16 --iterations=1 \
  --number-of-queries="$SLAP_N" --query="INSERT INTO raw (k, v) VALUES (UUID(), 1)" >/dev/null
SLAP_END=$(date +%s.%N)
PB1=$(cpu_all); P1=$(counters)
ROWS=$(my -N slap -e "SELECT COUNT(*) FROM raw")
SLAP_RATE=$(python3 -c "print(round($ROWS / ($SLAP_END - $SLAP_START)))")

GW_DB=$(mariadb_us "$CPU0" "$CPU1" "$N")
SLAP_DB=$(mariadb_us "$PB0" "$PB1" "$ROWS")

# Retention at scale.
echo "filling $LIVE live records" >&2
$BIN/examples/store_bench "$URL/scale_empty" 0 ""
$BIN/examples/store_bench "$URL/scale_full" 0 ""
NOW_MS="CAST(UNIX_TIMESTAMP(UTC_TIMESTAMP(3)) * 1000 AS SIGNED)"
DAY=86400000
COLUMNS="route, idem_key, scope, fingerprint, state, epoch, lease_until, request_id, status, body, body_kept, created_at, updated_at, expires_at"
fill() { # prefix rows expiry-expression-of-seq (in chunks of a million)
  local from=1 to
  while [ "$from" -le "$2" ]; do
    to=$(( from + 999999 < $2 ? from + 999999 : $2 ))
    my scale_full -e "INSERT INTO idempotency_records ($COLUMNS)
      SELECT 'orders', CONCAT('$1-', seq), 'anon', MD5(seq), 'completed', seq, 0, CONCAT('req-', seq), 201,
             CONCAT('{\"order\":\"', seq, '\"}'), TRUE, $3 - $DAY, $3 - $DAY, $3
      FROM seq_${from}_to_${to}"
    from=$(( to + 1 ))
  done
}
start=$(date +%s)
# Live: expiries spread over the next 24 h.
fill live "$LIVE" "$NOW_MS + (seq % $DAY)"
FILL_S=$(( $(date +%s) - start ))
my scale_full -e "ANALYZE TABLE idempotency_records" >/dev/null
SIZE=$(my -N -e "SELECT CONCAT(ROUND(SUM(data_length + index_length) / 1048576), ' MiB') FROM information_schema.TABLES WHERE table_schema = 'scale_full' AND table_name = 'idempotency_records'")
echo "filled in ${FILL_S}s ($SIZE)" >&2
EMPTY_RUN=""; FULL_RUN=""
for round in 1 2; do
  EMPTY_RUN+="$($BIN/examples/store_bench "$URL/scale_empty" "$SECS" 16,64)"$'\n'
  FULL_RUN+="$($BIN/examples/store_bench "$URL/scale_full" "$SECS" 16,64)"$'\n'
done
echo "$EMPTY_RUN" >&2; echo "$FULL_RUN" >&2
# Expired three days ago, past any lease: the sweeper deletes them in
# batches along the expiry index.
echo "retiring $EXPIRED" >&2
fill past "$EXPIRED" "$NOW_MS - 3 * $DAY + (seq % 3600000)"
ALONE=$($BIN/examples/store_bench "$URL/scale_full" 0 "" sweep)
fill past "$EXPIRED" "$NOW_MS - 3 * $DAY + (seq % 3600000)"
ALONE_C16=$($BIN/examples/store_bench "$URL/scale_full" "$SECS" 16)
BESIDE=$($BIN/examples/store_bench "$URL/scale_full" "$SECS" 16 sweep)
LEFT=$(my -N scale_full -e "SELECT COUNT(*) FROM idempotency_records WHERE idem_key LIKE 'past-%'")

{
  echo "# The MySQL store on MariaDB — $(date -u +%Y-%m-%d) ($(git rev-parse --short HEAD))"
  echo
  echo "\`loadtest/mariadb.sh $SECS $CONC $LIVE $EXPIRED\` on this machine (2 cores), a private"
  echo "MariaDB $(my -N -e 'SELECT VERSION()') with default durability (\`innodb_flush_log_at_trx_commit = 1\`),"
  echo "2 GiB buffer pool. One run, side by side."
  echo
  echo "## First requests against the server's ceiling"
  echo
  echo "One gateway (MariaDB alone, 2 worker threads) in front of nginx, \`loadgen unique\` at $CONC"
  echo "connections for ${SECS}s. Rate: $RPS; $N first requests counted."
  echo
  echo "| party | CPU µs / first request | share of the machine's busy time |"
  echo "|---|---|---|"
  per_party "$CPU0" "$CPU1" "$N"
  echo
  echo "Server counters per first request:"
  echo
  echo "| counter | per request |"
  echo "|---|---|"
  paste <(echo "$S0") <(echo "$S1") | awk -v n="$N" '{ printf "| %s | %.3f |\n", $1, ($4 - $2) / n }'
  echo
  echo "The ceiling: \`mariadb-slap --concurrency=16\`, one row per autocommit \`INSERT\` into a"
  echo "two-column table, same server and cores: $ROWS rows, $SLAP_RATE rows/s."
  echo
  echo "| party | CPU µs / committed row | share of the machine's busy time |"
  echo "|---|---|---|"
  per_party "$PB0" "$PB1" "$ROWS" | grep -v '^| gateway\|^| nginx'
  echo
  echo "| counter | per row |"
  echo "|---|---|"
  paste <(echo "$P0") <(echo "$P1") | awk -v n="$ROWS" '{ printf "| %s | %.3f |\n", $1, ($4 - $2) / n }'
  echo
  echo "**The server's CPU per first request: $GW_DB µs; per committed row of the ceiling: $SLAP_DB µs"
  echo "($(python3 -c "print(f'{$GW_DB / $SLAP_DB:.2f}')")×).**"
  echo
  echo "## Retention at scale"
  echo
  echo "Filling $LIVE live records took ${FILL_S}s; the table with its indexes: $SIZE."
  echo "\`store_bench\`: the store's claim + complete cycles."
  echo
  echo '```'
  echo "empty table (two rounds, alternated with the full one):"; printf '%s' "$EMPTY_RUN"
  echo "$LIVE records:"; printf '%s' "$FULL_RUN"
  echo '```'
  echo
  echo "Retiring $EXPIRED expired records (\`DELETE … ORDER BY expires_at LIMIT 500\` per batch):"
  echo
  echo '```'
  echo "$ALONE"
  echo "claims alone, c=16, on the full table with the expired rows in place: $ALONE_C16"
  echo "claims beside the sweep, c=16: $BESIDE"
  echo "expired rows left after the sweep beside claims: $LEFT"
  echo '```'
} | tee "$OUT"
