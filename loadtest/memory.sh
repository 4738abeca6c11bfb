#!/usr/bin/env bash
# The memory row of loadtest/run.sh on its own, quick enough to try a
# setting: a fresh TLS gateway in front of nginx, 500 HTTP/1.1 and 500 h2
# client connections under load for SECONDS, RSS idle / loaded / peak, and
# where the resident memory is (anonymous heap vs. file-backed). Extra
# environment is passed to the gateway, so allocator settings can be tried
# without a rebuild, e.g. `_RJEM_MALLOC_CONF=narenas:2 loadtest/memory.sh`.
# Only 127.0.0.1 is targeted; the load is bounded in time.
#
#   loadtest/memory.sh [SECONDS]
#
# RATE=N caps the load at N requests/s in all (half per protocol): the
# connections stay open while only a few requests are in flight, which is
# "1,000 clients" rather than "1,000 requests in flight at once".
# PLAIN=1 measures the same without TLS (HTTP/1.1 and h2c), to tell what
# TLS costs per connection. H1=N and H2=N change the 500 + 500 split, to
# tell what each protocol costs per connection. UPSTREAM_MAX=N sets
# upstreams[].max_connections.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-8}
(( SECS >= 4 )) || { echo "SECONDS must be at least 4" >&2; exit 2; }
WORK=$(mktemp -d /tmp/idemgate-memory.XXXX)
command -v oha >/dev/null || cargo install oha --locked
command -v nginx >/dev/null || { apt-get update -qq && apt-get install -y -qq nginx-light; }
if [ -n "${IDEMGATE_BIN_DIR:-}" ]; then
  BIN=$IDEMGATE_BIN_DIR
else
  cargo build --profile dist --features jemalloc -q --bins
  BIN=target/dist
fi

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$WORK/nginx.pid" ] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

cat > "$WORK/nginx.conf" <<EOF
worker_processes 2;
pid $WORK/nginx.pid;
error_log $WORK/error.log warn;
events { worker_connections 8192; }
http {
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path $WORK;
  server { listen 127.0.0.1:18581; location / { default_type application/json; return 200 "{\"ok\":true,\"order\":\"ord_1\"}"; } }
}
EOF
nginx -p "$WORK" -c "$WORK/nginx.conf"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
  -subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 \
  -keyout "$WORK/tls.key" -out "$WORK/tls.pem" 2>/dev/null
SCHEME=https
TLS_SECTION=$(printf '[server.tls]\ncert = "%s"\nkey = "%s"' "$WORK/tls.pem" "$WORK/tls.key")
if [ "${PLAIN:-0}" = 1 ]; then SCHEME=http; TLS_SECTION=; fi
cat > "$WORK/idemgate.toml" <<EOF
[server]
listen = "127.0.0.1:18580"
admin_listen = "127.0.0.1:18590"
max_connections = 20000
$TLS_SECTION
[store]
database_url = "sqlite://$WORK/idemgate.db"
[[upstreams]]
name = "nginx"
url = "http://127.0.0.1:18581"
max_connections = ${UPSTREAM_MAX:-0}
[[routes]]
name = "pass"
methods = ["GET"]
path_prefix = "/pass/"
upstream = "nginx"
EOF
IDEMGATE_LOG=warn setsid "$BIN/idemgate" serve --config "$WORK/idemgate.toml" & GW=$!; pids+=($GW)
for _ in $(seq 1 100); do curl -sk -o /dev/null $SCHEME://127.0.0.1:18580/pass/x && break; sleep 0.1; done

kib() { awk -v k="$2" '$1 == k":" {print $2}' "/proc/$1/status"; }
IDLE=$(kib $GW VmRSS)
LIMIT=()
[ -n "${RATE:-}" ] && LIMIT=(-q $((RATE / 2)))
H1=${H1:-500}; H2=${H2:-500}
O1=; O2=
(( H1 > 0 )) && { oha -z "${SECS}s" -c "$H1" "${LIMIT[@]}" --no-tui --insecure --output-format json $SCHEME://127.0.0.1:18580/pass/x >"$WORK/h1.json" 2>/dev/null & O1=$!; }
(( H2 > 0 )) && { oha -z "${SECS}s" -c "$H2" --http2 -p 1 "${LIMIT[@]}" --no-tui --insecure --output-format json $SCHEME://127.0.0.1:18580/pass/x >"$WORK/h2.json" 2>/dev/null & O2=$!; }
sleep $((SECS - 2))
LOADED=$(kib $GW VmRSS)
CONNS=$(ss -Htn state established '( sport = :18580 )' | wc -l)
UPSTREAM=$(ss -Htn state established '( dport = :18581 )' | wc -l)
ANON=$(kib $GW RssAnon)
FILE=$(kib $GW RssFile)
wait $O1 $O2 || true  # (unquoted: one may be empty)
PEAK=$(kib $GW VmHWM)
echo "client connections $CONNS, upstream connections $UPSTREAM"
python3 - "$WORK" <<'PY'
import json, os, sys
for name in ("h1", "h2"):
    path = os.path.join(sys.argv[1], name + ".json")
    if os.path.exists(path) and os.path.getsize(path):
        r = json.load(open(path))
        s = r["summary"]
        codes = r.get("statusCodeDistribution", {})
        print(f"{name}: {s['requestsPerSec']:.0f} req/s, p99 {r['latencyPercentiles']['p99'] * 1000:.1f} ms, statuses {codes}")
PY
echo "RSS idle $((IDLE / 1024)) MiB, loaded $((LOADED / 1024)) MiB (anonymous $((ANON / 1024)), file $((FILE / 1024))), peak $((PEAK / 1024)) MiB"
