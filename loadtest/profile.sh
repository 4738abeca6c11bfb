#!/usr/bin/env bash
# Where a pass-through request's CPU goes, in instructions, Idemgate beside
# nginx. Both run one worker under valgrind's callgrind in front of the same
# nginx upstream; after a warm-up, N requests (oha -c 10) are counted and the
# user-space instructions per request are printed with Idemgate's heaviest
# functions (inclusive). Instruction counts do not depend on what else the
# machine is doing, so two builds can be compared run to run (timings on a
# shared 2-core machine cannot). Kernel time is not counted: on this path it
# is the same for both (the same four socket calls per request).
#
#   loadtest/profile.sh [REQUESTS]     # default 20000; about 2 minutes
#   PROTO=h2c loadtest/profile.sh      # the same over h2c (prior knowledge)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-20000}
PROTO=${PROTO:-http1}
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
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$WORK/up/nginx.pid" ] && kill "$(cat "$WORK/up/nginx.pid")" 2>/dev/null || true
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
cat > "$WORK/idemgate.toml" <<EOF
[server]
listen = "127.0.0.1:18380"
admin_listen = "127.0.0.1:18390"
worker_threads = 1
[store]
database_url = "sqlite://$WORK/idemgate.db"
[[upstreams]]
name = "nginx"
url = "http://127.0.0.1:18381"
[[routes]]
name = "pass"
methods = ["GET"]
path_prefix = "/pass/"
upstream = "nginx"
EOF

measure() { # name port command…
  local name=$1 port=$2; shift 2
  IDEMGATE_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$WORK/$name.out" "$@" >"$WORK/$name.log" 2>&1 &
  local vp=$!; pids+=($vp)
  for _ in $(seq 1 100); do curl -s "${CURL_PROTO[@]}" -o /dev/null "http://127.0.0.1:$port/pass/x" && break; sleep 0.3; done
  oha -n 2000 -c 10 --no-tui "${OHA_PROTO[@]}" "http://127.0.0.1:$port/pass/x" >/dev/null 2>&1   # warm-up
  callgrind_control -z "$vp" >/dev/null 2>&1
  oha -n "$N" -c 10 --no-tui "${OHA_PROTO[@]}" "http://127.0.0.1:$port/pass/x" >/dev/null 2>&1
  callgrind_control -d "$vp" >/dev/null 2>&1   # → $name.out.1
  sleep 1; kill "$vp"; wait "$vp" 2>/dev/null || true
}
per_request() { # callgrind file → instructions per request
  callgrind_annotate "$1" 2>/dev/null | awk -v n="$N" '/PROGRAM TOTALS/ {x=$1; gsub(",","",x); printf "%.0f", x/n; exit}'
}
measure idemgate 18380 $BIN/idemgate serve --config "$WORK/idemgate.toml"
measure nginx 18382 nginx -p "$WORK/px" -c "$WORK/px/nginx.conf"
IG=$(per_request "$WORK/idemgate.out.1")
NG=$(per_request "$WORK/nginx.out.1")
echo "user-space instructions per pass-through request ($PROTO, $N requests, one worker):"
echo "  idemgate $IG"
echo "  nginx    $NG"
python3 -c "print(f'  ratio    {$IG/$NG:.2f}x nginx')"
echo
echo "idemgate, heaviest functions (inclusive instructions per request):"
callgrind_annotate --inclusive=yes "$WORK/idemgate.out.1" 2>/dev/null \
  | grep -E '^ *[0-9,]+ ' | grep -v -E 'inlined|/rustc/|PROGRAM TOTALS' \
  | awk -v n="$N" '{x=$1; gsub(",","",x); v=x/n; if (v >= 400) {$1=""; $2=""; sub(/^ +/, ""); sub(/ \[.*$/, ""); sub(/^.*index.crates.io-[0-9a-f]+\//, ""); printf "  %7.0f  %s\n", v, substr($0,1,140)}}' \
  | head -40
