#!/usr/bin/env bash
# Where a request's CPU goes, in instructions, Idemgate beside the reference.
# Both run under valgrind's callgrind (one worker each); after a warm-up, the
# requests are counted and the user-space instructions per request are
# printed with Idemgate's heaviest functions (inclusive). Instruction counts
# do not depend on what else the machine is doing, so two builds can be
# compared run to run (timings on a shared 2-core machine cannot). Kernel
# time is not counted (loadtest/cost.sh counts it, by party).
#
#   loadtest/profile.sh [REQUESTS]      # default 20000; about 2 minutes
#   PROTO=h2c loadtest/profile.sh       # pass-through over h2c (prior knowledge)
#   SCENARIO=fresh loadtest/profile.sh  # a fresh key per request, Redis + Postgres
#   SCENARIO=replay loadtest/profile.sh # one completed key, Redis + Postgres
#
# Pass-through is compared with nginx as the reverse proxy; a fresh key and
# a replay with the Redis-only peer, idempotent-proxy-server (IDEMGATE_PEER
# or on PATH; skipped when missing), both in front of the same nginx.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-20000}
PROTO=${PROTO:-http1}
SCENARIO=${SCENARIO:-pass}
case $SCENARIO in pass | fresh | replay) ;; *) echo "SCENARIO is pass, fresh or replay" >&2; exit 2 ;; esac
PG_URL=${IDEMGATE_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
PEER=${IDEMGATE_PEER:-$(command -v idempotent-proxy-server || true)}
case $PROTO in
  http1) OHA_PROTO=(); CURL_PROTO=(); NGINX_LISTEN=18382 ;;
  h2c) OHA_PROTO=(--http2); CURL_PROTO=(--http2-prior-knowledge); NGINX_LISTEN="18382 http2" ;;
  *) echo "PROTO is http1 or h2c" >&2; exit 2 ;;
esac
WORK=$(mktemp -d /tmp/idemgate-profile.XXXX)
command -v oha >/dev/null || cargo install oha --locked
command -v nginx >/dev/null || { apt-get update -qq && apt-get install -y -qq nginx-light || apt-get install -y -qq nginx; }
command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind; }
# IDEMGATE_BIN_DIR: profile another build (e.g. the previous commit's).
BIN=${IDEMGATE_BIN_DIR:-target/dist}
[ -n "${IDEMGATE_BIN_DIR:-}" ] || cargo build --profile dist --features jemalloc -q --bins
[ -n "${IDEMGATE_BIN_DIR:-}" ] || cargo build --profile dist --features jemalloc -q --example loadgen
LOADGEN=${LOADGEN:-target/dist/examples/loadgen}
[ -x "$LOADGEN" ] || cargo build --profile dist -q --example loadgen
SCHEMA=profile_$(date +%s%N)
BIN=$(cd "$BIN" && pwd); LOADGEN=$(realpath "$LOADGEN")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$WORK/up/nginx.pid" ] && kill "$(cat "$WORK/up/nginx.pid")" 2>/dev/null || true
  if [ "$SCENARIO" != pass ]; then
    psql -q "$PG_URL" -c "DROP SCHEMA IF EXISTS $SCHEMA CASCADE" 2>/dev/null || true
    redis-cli --scan --pattern "$SCHEMA:*" 2>/dev/null | xargs -r -n 1000 redis-cli del >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

mkdir -p "$WORK/up" "$WORK/px"
cat > "$WORK/up/nginx.conf" <<EOF
worker_processes 1;
pid $WORK/up/nginx.pid;
error_log $WORK/up/error.log warn;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 1000000; client_body_temp_path $WORK/up;
  server { listen 127.0.0.1:18381; location / { default_type application/json; return 200 "{\"ok\":true,\"order\":\"ord_1\"}"; } } }
EOF
nginx -p "$WORK/up" -c "$WORK/up/nginx.conf"
cat > "$WORK/px/nginx.conf" <<EOF
worker_processes 1;
master_process off;
daemon off;
pid $WORK/px/nginx.pid;
error_log $WORK/px/error.log warn;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 1000000; client_body_temp_path $WORK/px; proxy_temp_path $WORK/px;
  upstream backend { server 127.0.0.1:18381; keepalive 256; }
  server { listen 127.0.0.1:$NGINX_LISTEN; location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection ""; } } }
EOF
STORE="database_url = \"sqlite://$WORK/idemgate.db\""
if [ "$SCENARIO" != pass ]; then
  scripts/services.sh >/dev/null
  psql -q "$PG_URL" -c "CREATE SCHEMA $SCHEMA"
  STORE="database_url = \"$PG_URL?options[search_path]=$SCHEMA\"
redis_url = \"redis://127.0.0.1:6379/\"
redis_prefix = \"$SCHEMA:\""
fi
cat > "$WORK/idemgate.toml" <<EOF
[server]
listen = "127.0.0.1:18380"
admin_listen = "127.0.0.1:18390"
worker_threads = 1
[store]
$STORE
[[upstreams]]
name = "nginx"
url = "http://127.0.0.1:18381"
[[routes]]
name = "pass"
methods = ["GET"]
path_prefix = "/pass/"
upstream = "nginx"
[[routes]]
name = "key"
methods = ["POST"]
path_prefix = "/key/"
upstream = "nginx"
idempotency = "key"
EOF
# The peer reads its settings from a .env file in its working directory.
mkdir -p "$WORK/peer"
cat > "$WORK/peer/.env" <<EOF
SERVER_ADDR=127.0.0.1:18383
REDIS_URL=redis://127.0.0.1:6379/
REQUEST_TIMEOUT=30000
LOG_LEVEL=warn
URL_UP=http://127.0.0.1:18381/key/peer
EOF

# One scenario's load on one server: base URL, count, path. Prints the
# requests answered.
load() {
  local base=$1 n=$2 path=$3
  case $SCENARIO in
    pass) oha -n "$n" -c 10 --no-tui "${OHA_PROTO[@]}" "$base/pass/x" >/dev/null 2>&1; echo "$n" ;;
    fresh) # loadgen is bounded in time: about n requests at callgrind's pace
      "$LOADGEN" unique "$base$path" 10 "$(( n / 400 + 1 ))" | python3 -c "import json,sys; print(json.load(sys.stdin)['requests'])" ;;
    replay) oha -n "$n" -c 10 --no-tui -m POST -H "Idempotency-Key: profile-$SCHEMA" -d '{"a":1}' "$base$path" >/dev/null 2>&1; echo "$n" ;;
  esac
}
measure() { # name port path command…
  local name=$1 port=$2 path=$3; shift 3
  (cd "$WORK/peer" && IDEMGATE_LOG=warn exec valgrind --tool=callgrind --callgrind-out-file="$WORK/$name.out" "$@" >"$WORK/$name.log" 2>&1) &
  local vp=$!; pids+=($vp)
  for _ in $(seq 1 100); do curl -s "${CURL_PROTO[@]}" -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.3; done
  load "http://127.0.0.1:$port" 2000 "$path" >/dev/null   # warm-up (and the replay's key)
  callgrind_control -z "$vp" >/dev/null 2>&1
  load "http://127.0.0.1:$port" "$N" "$path" > "$WORK/$name.count"
  callgrind_control -d "$vp" >/dev/null 2>&1   # → $name.out.1
  sleep 1; kill "$vp" 2>/dev/null || true
  wait "$vp" 2>/dev/null || true
}
per_request() { # name → instructions per request
  callgrind_annotate "$WORK/$1.out.1" 2>/dev/null | awk -v n="$(cat "$WORK/$1.count")" '/PROGRAM TOTALS/ {x=$1; gsub(",","",x); printf "%.0f", x/n; exit}'
}
measure idemgate 18380 /key/p "$BIN/idemgate" serve --config "$WORK/idemgate.toml"
if [ "$SCENARIO" = pass ]; then
  REF=nginx
  measure nginx 18382 / nginx -p "$WORK/px" -c "$WORK/px/nginx.conf"
elif [ -n "$PEER" ]; then
  REF=peer
  measure peer 18383 /URL_UP "$PEER"
else
  REF=
  echo "peer: idempotent-proxy-server not installed; only Idemgate is profiled"
fi
# KEEP=DIR keeps the callgrind files (callgrind_annotate --tree=caller …).
if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP"; cp "$WORK"/*.out.1 "$KEEP"/; fi
IG=$(per_request idemgate)
what=$SCENARIO; [ "$SCENARIO" = pass ] && what="pass-through, $PROTO"
echo "user-space instructions per request ($what, $(cat "$WORK/idemgate.count") requests, one worker):"
echo "  idemgate $IG"
if [ -n "$REF" ]; then
  RF=$(per_request "$REF")
  echo "  $REF $RF"
  python3 -c "print(f'  ratio    {$IG/$RF:.2f}x $REF')"
fi
echo
echo "idemgate, heaviest functions (inclusive instructions per request):"
callgrind_annotate --inclusive=yes "$WORK/idemgate.out.1" 2>/dev/null \
  | grep -E '^ *[0-9,]+ ' | grep -v -E 'inlined|/rustc/|PROGRAM TOTALS' \
  | awk -v n="$(cat "$WORK/idemgate.count")" '{x=$1; gsub(",","",x); v=x/n; if (v >= 400) {$1=""; $2=""; sub(/^ +/, ""); sub(/ \[.*$/, ""); sub(/^.*index.crates.io-[0-9a-f]+\//, ""); printf "  %7.0f  %s\n", v, substr($0,1,140)}}' \
  | head -"${TOP:-40}" || true
