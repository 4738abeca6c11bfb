#!/usr/bin/env bash
# What one request costs, party by party: for each scenario, the CPU (user +
# system, from /proc) that every process spends per answered request —
# Idemgate or the reference beside it (nginx as a reverse proxy, or the
# Redis-only peer idempotent-proxy-server), the upstream nginx, Redis,
# Postgres, the load generator — with the machine's total, side by side in
# one run, alternating rounds. Writes loadtest/results/cost.md.
#
#   loadtest/cost.sh [SECONDS] [ROUNDS]     # defaults 5 3; about 6 minutes
#
# Scenarios: pass-through (HTTP/1.1, h2c, TLS, TLS + h2) beside nginx; a
# fresh key and a replay beside the peer (when installed: IDEMGATE_PEER or
# idempotent-proxy-server on PATH); the token flow and a callback (Idemgate
# only). An MQ message's cost by party is mq_bench's (loadtest/mq.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-5}
ROUNDS=${2:-3}
CONC=${CONC:-50}
OUT=loadtest/results/cost.md
command -v oha >/dev/null || cargo install oha --locked
command -v nginx >/dev/null || { apt-get update -qq && apt-get install -y -qq nginx-light || apt-get install -y -qq nginx; } >/dev/null
scripts/services.sh >/dev/null
if [ -n "${IDEMGATE_BIN_DIR:-}" ]; then BIN=$IDEMGATE_BIN_DIR; else
  cargo build --profile dist --features jemalloc -q --bins
  cargo build --profile dist --features jemalloc -q --example loadgen
  BIN=target/dist
fi
LOADGEN=${LOADGEN:-target/dist/examples/loadgen}
[ -x "$LOADGEN" ] || cargo build --profile dist -q --example loadgen
PEER=${IDEMGATE_PEER:-$(command -v idempotent-proxy-server || true)}
[ -n "$PEER" ] || echo "peer: idempotent-proxy-server not installed; its rows are skipped (cargo install idempotent-proxy-server --locked)"
PG_URL=${IDEMGATE_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
REV=$(git describe --always --dirty)
WORK=$(mktemp -d /tmp/idemgate-cost.XXXX)
RUN_ID=$(date +%s%N)
SCHEMA=cost_$RUN_ID
# Below the ephemeral range, so that no outgoing connection takes the
# port between this check and the server's bind.
free_port() { python3 -c '
import random, socket
while True:
    p = random.randrange(20000, 30000)
    try:
        s = socket.socket(); s.bind(("127.0.0.1", p)); print(p); break
    except OSError:
        pass'; }
wait_up() { for _ in $(seq 100); do curl -sk -o /dev/null "$1" && return 0; sleep 0.1; done; echo "not up: $1" >&2; exit 1; }
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for d in up px; do [ -f "$WORK/$d/nginx.pid" ] && kill "$(cat "$WORK/$d/nginx.pid")" 2>/dev/null || true; done
  wait 2>/dev/null || true
  psql -q "$PG_URL" -c "DROP SCHEMA IF EXISTS $SCHEMA CASCADE" 2>/dev/null || true
  redis-cli --scan --pattern "cost-$RUN_ID:*" 2>/dev/null | xargs -r -n 1000 redis-cli del >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# --- the upstream and the reference proxy (nginx) ----------------------------
UP=$(free_port); PX_H1=$(free_port); PX_H2C=$(free_port); PX_TLS=$(free_port)
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
  -subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 \
  -keyout "$WORK/tls.key" -out "$WORK/tls.pem" 2>/dev/null
nginx_conf() { # dir workers http-body
  mkdir -p "$WORK/$1"
  cat > "$WORK/$1/nginx.conf" <<EOF
worker_processes $2;
pid $WORK/$1/nginx.pid;
error_log $WORK/$1/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path $WORK/$1;
  proxy_temp_path $WORK/$1;
  $3
}
EOF
  setsid nginx -p "$WORK/$1" -c "$WORK/$1/nginx.conf"
}
nginx_conf up 1 "server { listen 127.0.0.1:$UP; location / { default_type application/json; return 201 '{\"ok\":true,\"order\":\"ord_1\"}'; } }"
# The reference: HTTP/1.1, h2c and TLS (h2 or HTTP/1.1 by ALPN), always
# HTTP/1.1 keep-alive to the upstream; two workers, as the gateway has.
LOC='location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection ""; }'
nginx_conf px 2 "upstream backend { server 127.0.0.1:$UP; keepalive 256; }
  server { listen 127.0.0.1:$PX_H1; $LOC }
  server { listen 127.0.0.1:$PX_H2C http2; $LOC }
  server { listen 127.0.0.1:$PX_TLS ssl http2; ssl_certificate $WORK/tls.pem; ssl_certificate_key $WORK/tls.key; $LOC }"
sleep 0.3

# --- the gateways: Redis + Postgres, and the same routes behind TLS ----------
psql -q "$PG_URL" -c "CREATE SCHEMA $SCHEMA"
GW_PORT=$(free_port); GW_ADMIN=$(free_port); TLS_PORT=$(free_port); TLS_ADMIN=$(free_port)
gateway_toml() { # listen admin extra-server-lines
  cat <<EOF
[server]
listen = "127.0.0.1:$1"
admin_listen = "127.0.0.1:$2"
worker_threads = 2
max_connections = 20000
$3
[store]
database_url = "$PG_URL?options[search_path]=$SCHEMA"
redis_url = "redis://127.0.0.1:6379/"
redis_prefix = "cost-$RUN_ID:"
[tokens]
secret = "loadtest-secret"
[[upstreams]]
name = "nginx"
url = "http://127.0.0.1:$UP"
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
[[routes]]
name = "tok"
methods = ["POST"]
path_prefix = "/tok/"
upstream = "nginx"
idempotency = "token"
[[routes]]
name = "mq-push"
methods = ["POST"]
path = "/mq/push"
upstream = "nginx"
kind = "callback"
business_key = ["header:X-Msg-Id"]
EOF
}
gateway_toml "$GW_PORT" "$GW_ADMIN" "" > "$WORK/gw.toml"
gateway_toml "$TLS_PORT" "$TLS_ADMIN" "[server.tls]
cert = \"$WORK/tls.pem\"
key = \"$WORK/tls.key\"" > "$WORK/tls.toml"
IDEMGATE_LOG=warn setsid "$BIN/idemgate" serve --config "$WORK/gw.toml" >"$WORK/gw.log" 2>&1 & GW=$!; pids+=($GW)
IDEMGATE_LOG=warn setsid "$BIN/idemgate" serve --config "$WORK/tls.toml" >"$WORK/tls.log" 2>&1 & GW_TLS=$!; pids+=($GW_TLS)
wait_up "http://127.0.0.1:$GW_ADMIN/healthz"
wait_up "http://127.0.0.1:$TLS_ADMIN/healthz"
if [ -n "$PEER" ]; then
  PEER_PORT=$(free_port)
  mkdir -p "$WORK/peer"
  cat > "$WORK/peer/.env" <<ENV
SERVER_ADDR=127.0.0.1:$PEER_PORT
REDIS_URL=redis://127.0.0.1:6379/
REQUEST_TIMEOUT=30000
LOG_LEVEL=warn
URL_UP=http://127.0.0.1:$UP/key/peer
ENV
  (cd "$WORK/peer" && exec setsid "$PEER" >/dev/null 2>"$WORK/peer/stderr") & PEER_PID=$!; pids+=($PEER_PID)
  wait_up "http://127.0.0.1:$PEER_PORT/"
fi

# --- CPU by party ----------------------------------------------------------
HZ=$(getconf CLK_TCK)
ticks() { # pids… → utime + stime, clock ticks (a process gone meanwhile counts 0)
  local t=0 p v
  for p in "$@"; do
    v=$(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || true)
    t=$(( t + ${v:-0} ))
  done
  echo "$t"
}
# Postgres: every process now, and what its backends that exited
# meanwhile spent (the postmaster's reaped children).
PG_MAIN=$(head -1 "$(psql -qAt "$PG_URL" -c 'SHOW data_directory')/postmaster.pid" 2>/dev/null || true)
postgres_ticks() {
  local reaped=0
  [ -n "$PG_MAIN" ] && reaped=$(awk '{print $16 + $17}' "/proc/$PG_MAIN/stat" 2>/dev/null || echo 0)
  echo $(( $(ticks $(pgrep -x postgres)) + reaped ))
}
tree() { echo "$1" $(pgrep -P "$1"); } # a master and its workers
# The load generator's CPU: this shell's reaped children (bash's `times`,
# which must run in this shell: a subshell's children start from zero).
children() { # → µs, in the variable named $1
  times > "$WORK/times"
  printf -v "$1" %s "$(awk 'NR == 2 { split($1, u, /m|s/); split($2, s, /m|s/); printf "%d", (u[1] * 60 + u[2] + s[1] * 60 + s[2]) * 1e6 }' "$WORK/times")"
}
snapshot() { # the server measured → "gateway ref up redis pg machine"
  local server=$1
  echo "$(ticks $server) $(ticks $(tree "$(cat "$WORK/up/nginx.pid")")) $(ticks $(pgrep -x redis-server)) \
$(postgres_ticks) $(awk '/^cpu / {print $2 + $3 + $4 + $7 + $8}' /proc/stat)"
}
# One measurement: scenario target server-pids tool args… Appends a row:
# scenario target req/s answered p99 server up redis pg loadgen machine (µs/request).
measure() {
  local scen=$1 target=$2 server=$3 tool=$4; shift 4
  local c0 c1 l0 l1
  c0=$(snapshot "$server"); children l0
  case $tool in
    oha) oha -z "${SECS}s" -c "$CONC" --no-tui --output-format json "$@" > "$WORK/run.json" 2>/dev/null ;;
    loadgen) "$LOADGEN" "$@" > "$WORK/run.json" ;;
  esac
  children l1; c1=$(snapshot "$server")
  python3 - "$tool" "$WORK/run.json" "$scen" "$target" "$HZ" "$l0" "$l1" $c0 $c1 <<'PY' >> "$WORK/rows"
import json, sys
tool, path, scen, target, hz, l0, l1 = sys.argv[1:8]
c = [int(x) for x in sys.argv[8:]]
d = json.load(open(path))
if tool == "oha":
    codes = d["statusCodeDistribution"]
    n = sum(v for k, v in codes.items() if int(k) < 500)
    # Requests cut off by the round's end are not errors.
    bad = sum(v for k, v in codes.items() if int(k) >= 500) + sum(
        v for k, v in d.get("errorDistribution", {}).items() if "deadline" not in k)
    p99 = (d["latencyPercentiles"]["p99"] or 0) * 1000
    secs = d["summary"]["total"]
else:
    n = sum(v for k, v in d["statuses"].items() if int(k) < 500)
    bad = sum(v for k, v in d["statuses"].items() if int(k) >= 500) + d["errors"]
    p99, secs = d["p99_ms"], d["seconds"]
n = max(n, 1)
per = lambda ticks: ticks * 1e6 / int(hz) / n
delta = [b - a for a, b in zip(c[:5], c[5:])]
loadgen = (int(l1) - int(l0)) / n
print(scen, target, round(n / secs), n, f"{p99:.2f}", bad,
      *(f"{per(x):.1f}" for x in delta[:4]), f"{loadgen:.1f}", f"{per(delta[4]):.1f}")
PY
}

# --- the runs ----------------------------------------------------------------
G="http://127.0.0.1:$GW_PORT"
T="https://127.0.0.1:$TLS_PORT"
PX="$(tree "$(cat "$WORK/px/nginx.pid")")"
# Warm up every path once (connections, prepared statements, partitions).
oha -z 1s -c 10 --no-tui "$G/pass/w" >/dev/null 2>&1
"$LOADGEN" unique "$G/key/warm" 10 1 >/dev/null
: > "$WORK/rows"
replay_key() { # url → a completed key
  local key="replay-$RUN_ID-$RANDOM"
  curl -s -o /dev/null -X POST -H "Idempotency-Key: $key" -d '{"a":1}' "$1"
  echo "$key"
}
run_target() { # scenario target
  case "$1/$2" in
    http1/nginx) measure http1 nginx "$PX" oha "http://127.0.0.1:$PX_H1/pass/x" ;;
    http1/idemgate) measure http1 idemgate "$GW" oha "$G/pass/x" ;;
    h2c/nginx) measure h2c nginx "$PX" oha --http2 "http://127.0.0.1:$PX_H2C/pass/x" ;;
    h2c/idemgate) measure h2c idemgate "$GW" oha --http2 "$G/pass/x" ;;
    tls/nginx) measure tls nginx "$PX" oha --insecure "https://127.0.0.1:$PX_TLS/pass/x" ;;
    tls/idemgate) measure tls idemgate "$GW_TLS" oha --insecure "$T/pass/x" ;;
    tls-h2/nginx) measure tls-h2 nginx "$PX" oha --insecure --http2 "https://127.0.0.1:$PX_TLS/pass/x" ;;
    tls-h2/idemgate) measure tls-h2 idemgate "$GW_TLS" oha --insecure --http2 "$T/pass/x" ;;
    fresh/idemgate) measure fresh idemgate "$GW" loadgen unique "$G/key/new" "$CONC" "$SECS" ;;
    fresh/peer) measure fresh peer "$PEER_PID" loadgen unique "http://127.0.0.1:$PEER_PORT/URL_UP" "$CONC" "$SECS" ;;
    replay/idemgate) k=$(replay_key "$G/key/r")
      measure replay idemgate "$GW" oha -m POST -H "Idempotency-Key: $k" -d '{"a":1}' "$G/key/r" ;;
    replay/peer) k=$(replay_key "http://127.0.0.1:$PEER_PORT/URL_UP")
      measure replay peer "$PEER_PID" oha -m POST -H "Idempotency-Key: $k" -d '{"a":1}' "http://127.0.0.1:$PEER_PORT/URL_UP" ;;
    token/idemgate) measure token idemgate "$GW" loadgen token "$G" /tok/x "$CONC" "$SECS" ;;
    callback/idemgate) LOADGEN_KEY_HEADER=x-msg-id measure callback idemgate "$GW" loadgen unique "$G/mq/push" "$CONC" "$SECS" ;;
  esac
}
SCENARIOS="http1:nginx,idemgate h2c:nginx,idemgate tls:nginx,idemgate tls-h2:nginx,idemgate fresh:${PEER:+peer,}idemgate replay:${PEER:+peer,}idemgate token:idemgate callback:idemgate"
for round in $(seq "$ROUNDS"); do
  for s in $SCENARIOS; do
    scen=${s%%:*}; IFS=, read -ra targets <<< "${s#*:}"
    # Reverse order on even rounds: a drift in the machine falls on both.
    [ $((round % 2)) = 0 ] && targets=($(printf '%s\n' "${targets[@]}" | tac))
    for t in "${targets[@]}"; do run_target "$scen" "$t"; done
  done
done

python3 - "$WORK/rows" "$SECS" "$ROUNDS" "$CONC" "$REV" <<'PY' | tee "$OUT"
import statistics, sys, time
rows, secs, rounds, conc, rev = sys.argv[1:]
runs = {}
for line in open(rows):
    f = line.split()
    runs.setdefault((f[0], f[1]), []).append([float(x) for x in f[2:]])
med = lambda key, i: statistics.median(r[i] for r in runs[key])
print(f"# What one request costs, by party — {time.strftime('%Y-%m-%d')} ({rev})\n")
print(f"`loadtest/cost.sh {secs} {rounds}`: medians of {rounds} alternating rounds of {secs} s at {conc} connections. "
      "CPU is user + system time from `/proc` over the round, in µs per answered request; `server` is the process measured "
      "(Idemgate, nginx as the reverse proxy, or the peer), `upstream` the nginx behind it, `loadgen` oha or loadgen. "
      "All share the machine's two cores, so only ratios within one run mean anything.\n")
names = {"http1": "pass-through, HTTP/1.1", "h2c": "pass-through, h2c", "tls": "pass-through, TLS",
         "tls-h2": "pass-through, TLS + h2", "fresh": "a fresh key per request (Redis + Postgres; the peer: Redis)",
         "replay": "replay of one completed key", "token": "token flow (fetch, then use: two requests)",
         "callback": "callback, a fresh message id per request (Redis + Postgres)"}
print("| scenario | server | req/s | p99 ms | 5xx | server µs | upstream µs | Redis µs | Postgres µs | loadgen µs | machine µs |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for scen in names:
    for target in ("nginx", "peer", "idemgate"):
        k = (scen, target)
        if k not in runs:
            continue
        print(f"| {names[scen]} | {target} | {med(k, 0):,.0f} | {med(k, 2):.2f} | {sum(r[3] for r in runs[k]):.0f} | "
              + " | ".join(f"{med(k, i):.1f}" for i in range(4, 10)) + " |")
print("\n## Ratios (Idemgate against the reference, same run)\n")
print("| scenario | req/s | server CPU per request | goal |")
print("|---|---|---|---|")
goals = {"http1": "req/s ≥ 1.0×", "h2c": "req/s ≥ 0.9×", "tls": "req/s ≥ 0.9×", "tls-h2": "req/s ≥ 0.9×",
         "fresh": "CPU ≤ 1.0× (stretch 0.5×)", "replay": "req/s ≥ 7×"}
for scen, goal in goals.items():
    ref = "peer" if scen in ("fresh", "replay") else "nginx"
    if (scen, ref) not in runs or (scen, "idemgate") not in runs:
        continue
    i, r = (scen, "idemgate"), (scen, ref)
    print(f"| {names[scen]} | {med(i, 0) / med(r, 0):.2f}× {ref} | {med(i, 4) / med(r, 4):.2f}× {ref} | {goal} |")
PY
