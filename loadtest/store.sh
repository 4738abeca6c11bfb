#!/usr/bin/env bash
# The store benchmark (issue #3): claim+complete cycles through SqlStore
# against Postgres, beside pgbench running a one-line INSERT … ON CONFLICT DO
# NOTHING on the same server, in one run. Prints both and the ratio.
#   loadtest/store.sh [SECONDS]        (needs Postgres on 127.0.0.1:5432)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER=${1:-5}
URL=${IDEMGATE_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
SCHEMA=bench_$(date +%s)
psql -q "$URL" -c "CREATE SCHEMA $SCHEMA; CREATE TABLE $SCHEMA.raw (k text PRIMARY KEY, v bigint)"
cat > /tmp/idemgate-pgbench.sql <<SQL
\set k random(1, 1000000000)
INSERT INTO $SCHEMA.raw (k, v) VALUES (:client_id || '-' || :k, 1) ON CONFLICT DO NOTHING;
SQL
cargo build --profile dist --features jemalloc --example store_bench -q
echo "== pgbench: one-line INSERT … ON CONFLICT DO NOTHING, 16 clients, ${SECONDS_PER}s"
RAW=$(pgbench -n -h 127.0.0.1 -U postgres -c 16 -j 2 -T "$SECONDS_PER" -f /tmp/idemgate-pgbench.sql test 2>/dev/null \
  | awk '/^tps = / {print int($3)}')
echo "raw inserts: ${RAW}/s"
echo "== idemgate store: claim (INSERT…RETURNING) + complete (UPDATE … WHERE epoch), ${SECONDS_PER}s per level"
OUT=$(target/dist/examples/store_bench "$URL?options[search_path]=$SCHEMA" "$SECONDS_PER" 4,16,64)
echo "$OUT"
BEST=$(echo "$OUT" | awk -F': ' '{sub("/s","",$2); if ($2+0>m+0) m=$2+0} END {print int(m)}')
echo "== ratio (best store cycles / raw inserts): $(awk -v a="$BEST" -v b="$RAW" 'BEGIN {printf "%.2f", a/b}')"
psql -q "$URL" -c "DROP SCHEMA $SCHEMA CASCADE"
