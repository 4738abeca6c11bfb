#!/usr/bin/env bash
# Retention at scale (Postgres): claim + complete on an empty record table
# and on one holding 10 million live records, then retiring 1 million
# expired records row by row (as every record was swept before
# partitioning) and by partition: seconds and WAL bytes alone, then the
# claims running beside each. One run, one server, side by side;
# writes loadtest/results/scale.md.
#   loadtest/scale.sh [SECONDS] [LIVE_ROWS] [EXPIRED_ROWS]
# The tables are bulk-loaded by INSERT … SELECT on the server (no requests,
# as a COPY would); the schemas are dropped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-10}
LIVE=${2:-10000000}
EXPIRED=${3:-1000000}
URL=${IDEMGATE_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
TS=$(date +%s)
EMPTY=scale_empty_$TS
FULL=scale_full_$TS
OUT=loadtest/results/scale.md
trap 'psql -q "$URL" -c "DROP SCHEMA IF EXISTS $EMPTY CASCADE; DROP SCHEMA IF EXISTS $FULL CASCADE" >/dev/null 2>&1 || true' EXIT

cargo build --profile dist --features jemalloc --example store_bench -q
BENCH=target/dist/examples/store_bench
q() { psql -qAt "$URL" -c "SET search_path = $FULL" -c "$1"; }
lsn() { psql -qAt "$URL" -c "SELECT pg_current_wal_lsn()"; }
wal_mb() { psql -qAt "$URL" -c "SELECT round(pg_wal_lsn_diff('$2', '$1') / 1048576.0, 1)"; }
NOW_MS="(extract(epoch from clock_timestamp()) * 1000)::bigint"
DAY=86400000
COLUMNS="route, idem_key, scope, fingerprint, state, epoch, lease_until, request_id, status, body, body_kept, created_at, updated_at, expires_at"
# $1 name prefix, $2 rows, $3 expiry expression of g
fill() {
  q "INSERT INTO idempotency_records ($COLUMNS)
     SELECT 'orders', '$1-' || g, 'anon', md5(g::text), 'completed', g, 0, 'req-' || g, 201,
            convert_to('{\"order\":\"' || g || '\"}', 'UTF8'), TRUE, $3 - $DAY, $3 - $DAY, $3
     FROM generate_series(1, $2) AS g"
  q "VACUUM ANALYZE idempotency_records"
}

psql -q "$URL" -c "CREATE SCHEMA $EMPTY; CREATE SCHEMA $FULL"
$BENCH "$URL?options[search_path]=$EMPTY" 0 ""
$BENCH "$URL?options[search_path]=$FULL" 0 ""
echo "filling $LIVE live records" >&2
start=$(date +%s)
# Live: expiries spread over the next 24 h (a day of traffic at a steady rate).
fill live "$LIVE" "$NOW_MS + (g % $DAY)"
FILL_S=$(( $(date +%s) - start ))
SIZE=$(q "SELECT pg_size_pretty(sum(pg_total_relation_size(c.oid))) FROM pg_class c
          JOIN pg_inherits i ON i.inhrelid = c.oid WHERE i.inhparent = 'idempotency_records'::regclass")

echo "filled in ${FILL_S}s ($SIZE); claims on the empty and the full table" >&2
# Alternated, twice: one machine's noise lands on both.
EMPTY_RUN=""; FULL_RUN=""
for round in 1 2; do
  EMPTY_RUN+="$($BENCH "$URL?options[search_path]=$EMPTY" "$SECS" 16,64)"$'\n'
  FULL_RUN+="$($BENCH "$URL?options[search_path]=$FULL" "$SECS" 16,64)"$'\n'
done
echo "$EMPTY_RUN" >&2; echo "$FULL_RUN" >&2

# A partition of expiries three days old, registered as the sweeper's own,
# holding EXPIRED records. With HELD=1 it also holds one record under a
# live lease, so the sweeper must sweep its other rows one by one (DELETE
# in batches of 500, the only way before partitioning); without, it goes
# whole (DETACH + DROP).
past_partition() {
  q "DROP TABLE IF EXISTS idempotency_records_past; DELETE FROM idempotency_partitions WHERE name = 'idempotency_records_past'"
  q "DO \$\$ DECLARE lo bigint := ($NOW_MS / $DAY - 3) * $DAY; BEGIN
       EXECUTE format('CREATE TABLE idempotency_records_past PARTITION OF idempotency_records
                       FOR VALUES FROM (%s) TO (%s) WITH (fillfactor = 70)', lo, lo + $DAY);
       INSERT INTO idempotency_partitions (name, lower_ms, upper_ms)
       VALUES ('idempotency_records_past', lo, lo + $DAY);
     END \$\$"
  fill "past$1" "$EXPIRED" "($NOW_MS / $DAY - 3) * $DAY + (g % $DAY)"
  if [ "$1" = 1 ]; then
    q "INSERT INTO idempotency_records ($COLUMNS)
       VALUES ('orders', 'held', 'anon', 'fp', 'in_flight', 1, $NOW_MS + 3600000, 'req', NULL,
               NULL, FALSE, ($NOW_MS / $DAY - 3) * $DAY, ($NOW_MS / $DAY - 3) * $DAY,
               ($NOW_MS / $DAY - 3) * $DAY + 1)"
  fi
  psql -q "$URL" -c "CHECKPOINT"
}
# $1 held (1: row by row, 0: whole) → alone, WAL MiB, beside claims (tab-separated)
retire() {
  local a b alone beside
  past_partition "$1" >&2
  a=$(lsn); alone=$($BENCH "$URL?options[search_path]=$FULL" 0 "" sweep); b=$(lsn)
  past_partition "$1" >&2
  beside=$($BENCH "$URL?options[search_path]=$FULL" "$SECS" 16 sweep)
  printf '%s\t%s\t%s\n' "$alone" "$(wal_mb "$a" "$b")" "$beside"
}
echo "row by row" >&2
IFS=$'\t' read -r ROWS_ALONE ROWS_WAL ROWS_BESIDE <<< "$(retire 1)"
echo "whole partition" >&2
IFS=$'\t' read -r PART_ALONE PART_WAL PART_BESIDE <<< "$(retire 0)"

{
  echo "# Retention at scale — $(date -u +%Y-%m-%d) ($(git rev-parse --short HEAD))"
  echo
  echo "\`loadtest/scale.sh $SECS $LIVE $EXPIRED\` on this machine (2 cores, Postgres $(psql -qAt "$URL" -c 'SHOW server_version')),"
  echo "one run. Claims are the store's claim + complete cycles (\`store_bench\`), the gateway's defaults"
  echo "(24 h retention, one partition a day)."
  echo
  echo "Filling $LIVE live records took ${FILL_S}s; the table with its indexes: $SIZE."
  echo
  echo "## Claims: empty table vs $LIVE records"
  echo
  echo '```'
  echo "empty table (two rounds, alternated with the full one):"; printf '%s' "$EMPTY_RUN"
  echo "$LIVE records:"; printf '%s' "$FULL_RUN"
  echo '```'
  echo
  echo "## Retiring $EXPIRED expired records"
  echo
  echo "| how | alone | WAL | beside claims at c=16 |"
  echo "|---|---|---|---|"
  echo "| row by row (DELETE, batches of 500; one live lease keeps the partition) | ${ROWS_ALONE#sweep alone: } | ${ROWS_WAL} MiB | $ROWS_BESIDE |"
  echo "| whole partition (DETACH + DROP) | ${PART_ALONE#sweep alone: } | ${PART_WAL} MiB | $PART_BESIDE |"
} | tee "$OUT"
