#!/usr/bin/env bash
# Bounded under abuse (loadtest/README.md, docs/semantics.md, rule 10): each abusive
# client beside a steady legitimate one, against one gateway (SQLite, the
# in-process fast layer, a descriptor limit of 1,024 as systemd sets by
# default) in front of the demo upstream. Per scenario: the peak of
# upstream requests in flight, the gateway's peak descriptors and RSS, the
# legitimate client's p99 and errors, beside a quiet run. Writes
# loadtest/results/abuse-$STORE.md. Only 127.0.0.1 is targeted.
#
#   loadtest/abuse.sh [SECONDS_PER_SCENARIO] [LEGIT_RATE]
#
# ONLY=hangup|resets|slowloris|atcap|big: the quiet run and that abuse only (with
# LEGIT_TRACE=FILE, the legitimate client's requests beside it); BIG_COUNT: how many
# one-megabyte answers (600; RSS must not grow with it). MEMORY_LAYER_BYTES,
# MAX_STORED_BODY_BYTES: the store's keys of those names (a small
# max_stored_body_bytes separates the cost of storing answers from the
# cost of carrying them). NOFILE: the descriptor limit. With nginx on PATH
# (loadtest/run.sh installs it), the quiet run and the big answers are
# also measured through nginx in front of the same demo upstream: what
# carrying the answers costs a proxy that stores nothing. NGINX=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
# The build measured: the commit, "-dirty" when code (not these results)
# differs from it.
REV=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!loadtest/results' || echo -dirty)
SECS=${1:-10}
RATE=${2:-100}
NOFILE=${NOFILE:-1024}
# STORE=postgres: Postgres + Redis instead of SQLite + the in-process layer.
STORE=${STORE:-sqlite}
PG_URL=${IDEMGATE_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
SCHEMA="bench_abuse_$$"
WORK=$(mktemp -d /tmp/idemgate-abuse.XXXX)
if [ -n "${IDEMGATE_BIN_DIR:-}" ]; then
  BIN=$IDEMGATE_BIN_DIR
else
  cargo build --profile dist --features jemalloc -q --bins
  cargo build --profile dist --features jemalloc -q --example abuse_bench
  BIN=target/dist
fi
CLIENT=${ABUSE_BENCH:-target/dist/examples/abuse_bench}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_up() { for _ in $(seq 100); do curl -sf "$1" >/dev/null && return 0; sleep 0.1; done; echo "not up: $1" >&2; exit 1; }
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ "$STORE" = postgres ] && psql -q "$PG_URL" -c "DROP SCHEMA IF EXISTS $SCHEMA CASCADE" 2>/dev/null || true
  # The SQLite file holds every big answer (600 MB a run). KEEP_WORK=1
  # keeps it, and the logs, for a look.
  wait 2>/dev/null || true
  [ -n "${KEEP_WORK:-}" ] && echo "kept $WORK" >&2 || rm -rf "$WORK"
}
trap cleanup EXIT

UP=$(free_port); GW=$(free_port); ADMIN=$(free_port)
if [ "$STORE" = postgres ]; then
  scripts/services.sh >/dev/null
  psql -q "$PG_URL" -c "CREATE SCHEMA $SCHEMA"
fi
"$BIN/demo-upstream" "127.0.0.1:$UP" >"$WORK/upstream.log" 2>&1 & pids+=($!)
wait_up "http://127.0.0.1:$UP/healthz"
cat > "$WORK/idemgate.toml" <<TOML
[server]
listen = "127.0.0.1:$GW"
admin_listen = "127.0.0.1:$ADMIN"
worker_threads = 2
header_read_timeout = "5s"
[store]
$(if [ "$STORE" = postgres ]; then
  echo "database_url = \"$PG_URL?options[search_path]=$SCHEMA\""
  echo "redis_url = \"redis://127.0.0.1:6379/\""
  echo "redis_prefix = \"bench-abuse-$$:\""
else
  echo "database_url = \"sqlite://$WORK/records.db\""
fi)
memory_layer_bytes = ${MEMORY_LAYER_BYTES:-67108864}
max_stored_body_bytes = ${MAX_STORED_BODY_BYTES:-1048576}
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
TOML
sh -c "ulimit -n $NOFILE && exec env IDEMGATE_LOG=warn $BIN/idemgate serve --config $WORK/idemgate.toml" \
  >"$WORK/gateway.log" 2>&1 &
GPID=$!; pids+=($GPID)
wait_up "http://127.0.0.1:$ADMIN/healthz"

# Samples the gateway's RSS and descriptors every 200 ms into $WORK/samples.
sample() {
  : > "$WORK/samples"
  while kill -0 "$GPID" 2>/dev/null; do
    # RSS less what the allocator already gave back with MADV_FREE (the
    # kernel counts it until it needs the memory).
    rss=$(awk '/^Rss:/ {r=$2} /^LazyFree:/ {l=$2} END {print r-l}' "/proc/$GPID/smaps_rollup")
    fds=$(ls "/proc/$GPID/fd" 2>/dev/null | wc -l)
    echo "$rss $fds" >> "$WORK/samples"
    sleep 0.2
  done
}

# Busy and total jiffies of the whole machine (all cores).
cpu() { awk '/^cpu / {busy=$2+$3+$4+$7+$8; total=busy+$5+$6; print busy, total}' /proc/stat; }

# The legitimate client against 127.0.0.1:$1 and, half a second in, the
# abuse command that follows (none: a quiet run); the abuser's summary
# goes to ABUSE.
beside() {
  local port=$1; shift
  "$CLIENT" legit "http://127.0.0.1:$port/actions/legit" "$RATE" "$SECS" > "$WORK/legit.json" &
  local legit=$!
  sleep 0.5
  ABUSE='{}'
  if [ $# -gt 0 ]; then ABUSE=$("$@" 2>/dev/null || echo '{}'); fi
  wait "$legit"
}

scenario() { # name abuse-command...
  local name=$1; shift
  curl -s -X POST "http://127.0.0.1:$UP/reset" >/dev/null
  local cpu_before; cpu_before=$(cpu)
  sample & local sampler=$!
  beside "$GW" "$@"
  local abuse=$ABUSE
  local cpu_after; cpu_after=$(cpu)
  local busy; busy=$(echo "$cpu_before $cpu_after" | awk '{printf "%.0f", 100*($3-$1)/($4-$2)}')
  # Let what the abuse left behind finish (and the allocator return what
  # it freed: jemalloc decays dirty pages after 10 s), then the residue.
  sleep 12
  kill "$sampler" 2>/dev/null || true; wait "$sampler" 2>/dev/null || true
  local peak; peak=$(curl -s "http://127.0.0.1:$UP/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["peak_running"])')
  python3 - "$name" "$peak" "$WORK/samples" "$WORK/legit.json" "$abuse" "$busy" >> "$WORK/table.md" <<'PY'
import json, sys
name, peak, samples, legit, abuse, busy = sys.argv[1:]
rows = [tuple(map(int, l.split())) for l in open(samples) if l.strip()]
rss = max(r[0] for r in rows) / 1024 if rows else 0
end_rss = rows[-1][0] / 1024 if rows else 0
fds = max(r[1] for r in rows) if rows else 0
l = json.load(open(legit))
print(f"| {name} | {peak} | {fds} | {rss:.0f} / {end_rss:.0f} | {l['p50_ms']} | {l['p99_ms']} | {l['errors']} / {l['ok'] + l['errors']} | {busy}% | {abuse} |")
PY
}

scenario "quiet"
# The legitimate client and an abuse through nginx (which stores nothing)
# in front of the same upstream: name, port, abuse-command...
nginx_scenario() {
  local name=$1 port=$2; shift 2
  beside "$port" "$@"
  sleep 2
  python3 - "$name" "$WORK/legit.json" "$ABUSE" >> "$WORK/nginx.md" <<'PY'
import json, sys
name, legit, abuse = sys.argv[1:]
l = json.load(open(legit))
print(f"| {name} | {l['p50_ms']} | {l['p99_ms']} | {l['errors']} / {l['ok'] + l['errors']} | {abuse} |")
PY
}

# Whether the abuse named $1 runs (ONLY unset: all of them).
wanted() { [ -z "${ONLY:-}" ] || [ "$ONLY" = "$1" ]; }
! wanted hangup || scenario "hang-up storm (3,000)" "$CLIENT" hangup "127.0.0.1:$GW" 3000 500
! wanted resets || scenario "HEADERS+RST flood (600, one h2c connection)" "$CLIENT" resets "127.0.0.1:$GW" 600 2000
! wanted slowloris || scenario "slow-loris HTTP/1.1 (300 connections)" "$CLIENT" slowloris "127.0.0.1:$GW" 300 "$SECS" h1
! wanted slowloris || scenario "slow-loris h2c (300 connections)" "$CLIENT" slowloris "127.0.0.1:$GW" 300 "$SECS" h2
# The connection cap filled by claims whose clients left (5 s each, more
# than max_connections of them), then 100 newcomers: each is answered at
# once (503 connections-exhausted) instead of waiting in the backlog.
! wanted atcap || scenario "newcomers at the connection cap (${ATCAP_FILL:-1200} claims, 100 newcomers)" "$CLIENT" atcap "127.0.0.1:$GW" "${ATCAP_FILL:-1200}" 5000 100
# Last: the allocator keeps some of what it held for the others to see.
! wanted big || scenario "big answers (${BIG_COUNT:-600} × 1 MB)" "$CLIENT" big "http://127.0.0.1:$GW/actions/big" "${BIG_COUNT:-600}" 1000000

if wanted big && [ "${NGINX:-1}" != 0 ] && command -v nginx >/dev/null; then
  NGX=$(free_port)
  mkdir -p "$WORK/nginx"
  cat > "$WORK/nginx/nginx.conf" <<NGINX
worker_processes 2;
daemon off;
error_log $WORK/nginx/error.log warn;
pid $WORK/nginx/nginx.pid;
events { worker_connections 1024; multi_accept off; }
http {
  access_log off;
  client_body_temp_path $WORK/nginx/body; proxy_temp_path $WORK/nginx/proxy;
  fastcgi_temp_path $WORK/nginx/f; uwsgi_temp_path $WORK/nginx/u; scgi_temp_path $WORK/nginx/s;
  upstream demo { server 127.0.0.1:$UP; keepalive 64; }
  server {
    listen 127.0.0.1:$NGX;
    location / { proxy_pass http://demo; proxy_http_version 1.1; proxy_set_header Connection ""; }
  }
}
NGINX
  nginx -c "$WORK/nginx/nginx.conf" >"$WORK/nginx/out.log" 2>&1 & pids+=($!)
  wait_up "http://127.0.0.1:$NGX/healthz"
  nginx_scenario "quiet" "$NGX"
  nginx_scenario "big answers (${BIG_COUNT:-600} × 1 MB)" "$NGX" "$CLIENT" big "http://127.0.0.1:$NGX/actions/big" "${BIG_COUNT:-600}" 1000000
fi

{
  echo "# Abuse beside a legitimate client ($(date -u +%Y-%m-%d), $REV)"
  echo
  echo "\`STORE=$STORE loadtest/abuse.sh $SECS $RATE\`: one gateway (2 workers, $([ "$STORE" = postgres ] && echo "Postgres + Redis" || echo "SQLite + the in-process fast layer"), \`ulimit -n $NOFILE\`) in front of the demo upstream; a legitimate client sends $RATE fresh-key POSTs a second for $SECS s on 16 connections kept from before each abuser starts. Peak in flight = the upstream's most requests at once; RSS (less lazily freed pages) peak / 12 s after the scenario (its residue finished, freed memory decayed), MiB."
  echo
  echo "| scenario | peak upstream in flight | peak descriptors | RSS MiB peak / end | legit p50 ms | legit p99 ms | legit errors | machine CPU busy | abuser |"
  echo "|---|---|---|---|---|---|---|---|---|"
  cat "$WORK/table.md"
  if [ -s "$WORK/nginx.md" ]; then
    echo
    echo "The same legitimate client through nginx (2 workers, upstream keep-alive; it stores nothing) in front of the same demo upstream:"
    echo
    echo "| scenario | legit p50 ms | legit p99 ms | legit errors | abuser |"
    echo "|---|---|---|---|---|"
    cat "$WORK/nginx.md"
  fi
} | tee "loadtest/results/abuse-$STORE.md"
{ grep -c "Too many open files" "$WORK/gateway.log" || true; } | sed "s/^/EMFILE lines in the gateway log: /"
