#!/usr/bin/env bash
# The load-test harness (loadtest/README.md). In one run on this machine:
# nginx as a fast upstream, nginx as a reference reverse proxy in front of
# it, Idemgate in front of the same upstream (on SQLite, and on Redis +
# Postgres), the demo upstream for the duplicate storm; then every scenario,
# alternating targets over several rounds. Prints a table and writes it to
# loadtest/results/latest.md. Only 127.0.0.1 is ever targeted; every load is
# bounded in time or count.
#
#   loadtest/run.sh [SECONDS_PER_MEASUREMENT] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-5}
ROUNDS=${2:-5}
CONC=${CONC:-50}
WORK=$(mktemp -d /tmp/idemgate-loadtest.XXXX)
PG_URL=${IDEMGATE_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
WORKERS=2   # the gateway's tokio worker threads = nginx worker_processes
SCHEMA=     # set once the gateways' Postgres schema exists

# --- tools ---------------------------------------------------------------
command -v oha >/dev/null || cargo install oha --locked
command -v nginx >/dev/null || { apt-get update -qq && apt-get install -y -qq nginx-light || apt-get install -y -qq nginx; }
# The peer, idempotent-proxy-server (Redis only), is optional: its rows are
# measured when the binary is on PATH or in IDEMGATE_PEER, and skipped
# otherwise. IDEMGATE_PEER_INSTALL=1 installs it (`cargo install
# idempotent-proxy-server --locked`, about 4 minutes on 2 cores).
if [ "${IDEMGATE_PEER_INSTALL:-0}" = 1 ] && ! command -v idempotent-proxy-server >/dev/null; then
  cargo install idempotent-proxy-server --locked
fi
PEER=${IDEMGATE_PEER:-$(command -v idempotent-proxy-server || true)}
[ -n "$PEER" ] || echo "peer: idempotent-proxy-server not installed; its rows are skipped (IDEMGATE_PEER_INSTALL=1 installs it)"
scripts/services.sh >/dev/null
# IDEMGATE_BIN_DIR: measure another build (e.g. the previous commit's,
# built in a worktree) with the same harness.
if [ -n "${IDEMGATE_BIN_DIR:-}" ]; then
  BIN=$IDEMGATE_BIN_DIR
else
  cargo build --profile dist --features jemalloc -q --bins
  cargo build --profile dist --features jemalloc -q --example loadgen
  BIN=target/dist
fi

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$WORK/up/nginx.pid" ] && kill "$(cat "$WORK/up/nginx.pid")" 2>/dev/null || true
  [ -f "$WORK/px/nginx.pid" ] && kill "$(cat "$WORK/px/nginx.pid")" 2>/dev/null || true
  [ -n "$SCHEMA" ] && psql -q "$PG_URL" -c "DROP SCHEMA IF EXISTS $SCHEMA CASCADE" 2>/dev/null || true
}
trap cleanup EXIT

# --- nginx: upstream on :18081, reference proxy on :18082 -----------------
nginx_conf() { # dir body
  mkdir -p "$WORK/$1"
  cat > "$WORK/$1/nginx.conf" <<EOF
worker_processes $WORKERS;
pid $WORK/$1/nginx.pid;
error_log $WORK/$1/error.log warn;
events { worker_connections 8192; }
http {
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path $WORK/$1;
  proxy_temp_path $WORK/$1;
  $2
}
EOF
  nginx -p "$WORK/$1" -c "$WORK/$1/nginx.conf"
}
nginx_conf up 'server { listen 127.0.0.1:18081; location / { default_type application/json; return 200 "{\"ok\":true,\"order\":\"ord_1\"}"; } }'
# A self-signed certificate for both TLS listeners (nginx's and Idemgate's).
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
  -subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 \
  -keyout "$WORK/tls.key" -out "$WORK/tls.pem" 2>/dev/null
# The reference proxy: HTTP/1.1 on :18082, h2c on :18083, TLS (h2 and
# HTTP/1.1 by ALPN) on :18443; always HTTP/1.1 keep-alive to the upstream.
PX_LOCATION='location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection ""; }'
nginx_conf px "upstream backend { server 127.0.0.1:18081; keepalive 256; }
  http2_max_requests 1000000;
  server { listen 127.0.0.1:18082; $PX_LOCATION }
  server { listen 127.0.0.1:18083 http2; $PX_LOCATION }
  server { listen 127.0.0.1:18443 ssl http2; ssl_certificate $WORK/tls.pem; ssl_certificate_key $WORK/tls.key; $PX_LOCATION }"

# Every server runs in a session of its own, as a daemon would: nginx
# detaches itself, and with the kernel's autogroup scheduling (on by default)
# a server left in this script's session would share one CPU group with the
# load generator while nginx has a group to itself, which skews the
# comparison (measured: 5-10% of throughput, and more preemptions per
# request). Started in the background of this script, a server is not a
# process-group leader, so `setsid` needs no fork and `$!` is the server.

# --- demo upstream (execution counter) on :18091 --------------------------
setsid $BIN/demo-upstream 127.0.0.1:18091 >/dev/null & pids+=($!)

# --- gateways --------------------------------------------------------------
cat > "$WORK/idemgate.toml" <<EOF
[server]
listen = "127.0.0.1:18080"
admin_listen = "127.0.0.1:18090"
max_connections = 20000
[store]
database_url = "sqlite://$WORK/idemgate.db"
[tokens]
secret = "loadtest-secret"
[[upstreams]]
name = "nginx"
url = "http://127.0.0.1:18081"
[[upstreams]]
name = "demo"
url = "http://127.0.0.1:18091"
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
name = "storm"
methods = ["POST"]
path_prefix = "/actions/storm"
upstream = "demo"
idempotency = "key"
[[routes]]
name = "storm-wait"
methods = ["POST"]
path_prefix = "/actions/wait"
upstream = "demo"
idempotency = "key"
on_concurrent = "wait"
EOF
SCHEMA=loadtest_$(date +%s)
psql -q "$PG_URL" -c "CREATE SCHEMA $SCHEMA"
IDEMGATE_LOG=warn setsid $BIN/idemgate serve --config "$WORK/idemgate.toml" & GW_SQLITE=$!; pids+=($GW_SQLITE)
IDEMGATE_LOG=warn IDEMGATE_LISTEN=127.0.0.1:18180 IDEMGATE_ADMIN_LISTEN=127.0.0.1:18190 \
  IDEMGATE_DATABASE_URL="$PG_URL?options[search_path]=$SCHEMA" IDEMGATE_REDIS_URL=redis://127.0.0.1:6379/ \
  setsid $BIN/idemgate serve --config "$WORK/idemgate.toml" & GW_PG=$!; pids+=($GW_PG)
# The same routes behind TLS (h2 and HTTP/1.1 by ALPN), on its own SQLite.
sed -e "s|127.0.0.1:18080|127.0.0.1:18480|; s|127.0.0.1:18090|127.0.0.1:18490|; s|idemgate.db|idemgate-tls.db|" \
  "$WORK/idemgate.toml" > "$WORK/idemgate-tls.toml"
printf '[server.tls]\ncert = "%s"\nkey = "%s"\n' "$WORK/tls.pem" "$WORK/tls.key" > "$WORK/tls-section.toml"
python3 - "$WORK/idemgate-tls.toml" "$WORK/tls-section.toml" <<'PY'
import sys
path, section = sys.argv[1], open(sys.argv[2]).read()
text = open(path).read().replace("[store]", section + "[store]", 1)
open(path, "w").write(text)
PY
IDEMGATE_LOG=warn setsid $BIN/idemgate serve --config "$WORK/idemgate-tls.toml" & GW_TLS=$!; pids+=($GW_TLS)
# The peer on :18280, in front of the same nginx and demo upstream, on the
# same Redis. It reads its settings from a .env file in its working
# directory; a path /URL_<NAME> is forwarded to the URL in URL_<NAME>.
# REQUEST_TIMEOUT (30 s here, 10 s by default) is its upstream timeout,
# how long a duplicate polls for the first request's answer, and how long
# it keeps that answer: the replay key is stored again before each of its
# rounds.
PEER_PORTS=
if [ -n "$PEER" ]; then
  mkdir -p "$WORK/peer"
  cat > "$WORK/peer/.env" <<EOF
SERVER_ADDR=127.0.0.1:18280
REDIS_URL=redis://127.0.0.1:6379/
REQUEST_TIMEOUT=30000
LOG_LEVEL=warn
URL_UP=http://127.0.0.1:18081/key/peer
URL_STORM=http://127.0.0.1:18091/actions/peerstorm
EOF
  (cd "$WORK/peer" && exec setsid "$PEER" >/dev/null 2>"$WORK/peer/stderr") & pids+=($!)
  PEER_PORTS=18280
fi
for port in 18080 18180 18081 18082 18091 $PEER_PORTS; do
  for _ in $(seq 1 100); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.1; done
done

# --- measuring -------------------------------------------------------------
RES="$WORK/results.jsonl"
: > "$RES"
oha_run() { # label target url [extra oha args…]
  local label=$1 target=$2 url=$3; shift 3
  oha -z "${SECS}s" -c "$CONC" --no-tui --output-format json "$@" "$url" 2>/dev/null \
    | python3 -c "
import json,sys
d=json.load(sys.stdin); ok=sum(v for k,v in d['statusCodeDistribution'].items() if int(k)<500)
print(json.dumps({'scenario':'$label','target':'$target','rps':ok/d['summary']['total'],
  'p50_ms':(d['latencyPercentiles']['p50'] or 0)*1000,'p99_ms':(d['latencyPercentiles']['p99'] or 0)*1000,
  'statuses':d['statusCodeDistribution']}))" >> "$RES"
}
gen_run() { # label target loadgen-args…
  local label=$1 target=$2; shift 2
  $BIN/examples/loadgen "$@" | python3 -c "
import json,sys
d=json.loads(sys.stdin.read()); d.update({'scenario':'$label','target':'$target'}); print(json.dumps(d))" >> "$RES"
}
# The targets of round $1, in the given order on odd rounds and reversed on
# even ones: drift in the machine's speed over a run (other tenants, CPU
# frequency) then falls on every target alike instead of on the last one.
in_order() {
  local r=$1; shift
  if (( r % 2 )); then echo "$@"; else echo "$@" | tr ' ' '\n' | tac | tr '\n' ' '; fi
}
rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
hwm_kib() { awk '/^VmHWM/ {print $2}' "/proc/$1/status"; }

echo "== pass-through ($ROUNDS rounds × ${SECS}s, -c $CONC)"
for r in $(seq 1 "$ROUNDS"); do
  for t in $(in_order "$r" upstream nginx idemgate); do
    case $t in
      upstream) oha_run pass-through upstream http://127.0.0.1:18081/pass/x ;;
      nginx) oha_run pass-through nginx http://127.0.0.1:18082/pass/x ;;
      idemgate) oha_run pass-through idemgate http://127.0.0.1:18080/pass/x ;;
    esac
  done
done

echo "== memory with 1000 connections (500 HTTP/1.1 and 500 h2, over TLS) on a fresh gateway"
for _ in $(seq 1 100); do curl -sk -o /dev/null "https://127.0.0.1:18480/pass/x" && break; sleep 0.1; done
TLS_RSS_IDLE=$(rss_kib $GW_TLS)
# First 1,000 connections carrying 2,000 requests/s (open, few requests in
# flight at once), then the same connections flat out (about 1,000
# requests in flight, each holding an upstream connection).
oha -z 6s -c 500 -q 1000 --no-tui --insecure https://127.0.0.1:18480/pass/x >/dev/null 2>&1 &
OHA1=$!
oha -z 6s -c 500 -q 1000 --http2 -p 1 --no-tui --insecure https://127.0.0.1:18480/pass/x >/dev/null 2>&1 &
OHA2=$!
sleep 4; TLS_RSS_RATED=$(rss_kib $GW_TLS)
wait $OHA1 $OHA2 || true
TLS_HWM_RATED=$(hwm_kib $GW_TLS)
oha -z 6s -c 500 --no-tui --insecure https://127.0.0.1:18480/pass/x >/dev/null 2>&1 &
OHA1=$!
oha -z 6s -c 500 --http2 -p 1 --no-tui --insecure https://127.0.0.1:18480/pass/x >/dev/null 2>&1 &
OHA2=$!
sleep 4; TLS_RSS_LOADED=$(rss_kib $GW_TLS); TLS_CONNS=$(ss -Htn state established '( sport = :18480 )' | wc -l)
TLS_UPSTREAM=$(ss -Htn state established '( dport = :18081 )' | wc -l)
wait $OHA1 $OHA2 || true
TLS_HWM=$(hwm_kib $GW_TLS)

echo "== HTTP/2 and TLS pass-through"
for r in $(seq 1 "$ROUNDS"); do
  for t in $(in_order "$r" nginx idemgate); do
    case $t in
      nginx)
        oha_run h2c nginx http://127.0.0.1:18083/pass/x --http2
        oha_run tls-http1 nginx https://127.0.0.1:18443/pass/x --insecure
        oha_run tls-h2 nginx https://127.0.0.1:18443/pass/x --insecure --http2 ;;
      idemgate)
        oha_run h2c idemgate http://127.0.0.1:18080/pass/x --http2
        oha_run tls-http1 idemgate https://127.0.0.1:18480/pass/x --insecure
        oha_run tls-h2 idemgate https://127.0.0.1:18480/pass/x --insecure --http2 ;;
    esac
  done
done

echo "== pass-through on a new connection per request (clients without keep-alive)"
for r in $(seq 1 "$ROUNDS"); do
  for t in $(in_order "$r" nginx idemgate); do
    case $t in
      nginx) oha_run new-connections nginx http://127.0.0.1:18082/pass/x --disable-keepalive ;;
      idemgate) oha_run new-connections idemgate http://127.0.0.1:18080/pass/x --disable-keepalive ;;
    esac
  done
done

echo "== replay (one key, completed)"
curl -s -o /dev/null -X POST -H 'Idempotency-Key: replay-key' -d '{"a":1}' http://127.0.0.1:18080/key/r
curl -s -o /dev/null -X POST -H 'Idempotency-Key: replay-key' -d '{"a":1}' http://127.0.0.1:18180/key/r
PEER_KEY=peer-replay-$(date +%s%N)
REPLAY_TARGETS="pass sqlite redis-pg"
[ -n "$PEER" ] && REPLAY_TARGETS="$REPLAY_TARGETS peer"
for r in $(seq 1 "$ROUNDS"); do
  for t in $(in_order "$r" $REPLAY_TARGETS); do
    case $t in
      peer)
        curl -s -o /dev/null -X POST -H "Idempotency-Key: $PEER_KEY" -d '{"a":1}' http://127.0.0.1:18280/URL_UP
        oha_run replay peer-redis http://127.0.0.1:18280/URL_UP -m POST -H "Idempotency-Key: $PEER_KEY" -d '{"a":1}' ;;
      pass) oha_run replay idemgate-pass http://127.0.0.1:18080/pass/x ;;
      sqlite) oha_run replay idemgate-sqlite http://127.0.0.1:18080/key/r -m POST -H 'Idempotency-Key: replay-key' -d '{"a":1}' ;;
      redis-pg) oha_run replay idemgate-redis-pg http://127.0.0.1:18180/key/r -m POST -H 'Idempotency-Key: replay-key' -d '{"a":1}'
        oha_run replay idemgate-redis-pg-h2c http://127.0.0.1:18180/key/r --http2 -m POST -H 'Idempotency-Key: replay-key' -d '{"a":1}' ;;
    esac
  done
done

echo "== first requests (a new key every request) and the database ceiling"
cat > "$WORK/pgbench.sql" <<SQL
\set k random(1, 1000000000)
INSERT INTO $SCHEMA.raw (k, v) VALUES (:client_id || '-' || :k, 1) ON CONFLICT DO NOTHING;
SQL
psql -q "$PG_URL" -c "CREATE TABLE $SCHEMA.raw (k text PRIMARY KEY, v bigint)"
FIRST_TARGETS="pgbench redis-pg sqlite"
[ -n "$PEER" ] && FIRST_TARGETS="$FIRST_TARGETS peer"
for r in $(seq 1 "$ROUNDS"); do
  for t in $(in_order "$r" $FIRST_TARGETS); do
    case $t in
      peer) gen_run first-requests peer-redis unique http://127.0.0.1:18280/URL_UP "$CONC" "$SECS" ;;
      pgbench)
        TPS=$(pgbench -n -h 127.0.0.1 -U postgres -c 16 -j 2 -T "$SECS" -f "$WORK/pgbench.sql" test 2>/dev/null | awk '/^tps = / {print $3}')
        echo "{\"scenario\":\"first-requests\",\"target\":\"pgbench-insert\",\"rps\":$TPS,\"p50_ms\":0,\"p99_ms\":0}" >> "$RES" ;;
      redis-pg) gen_run first-requests idemgate-redis-pg unique http://127.0.0.1:18180/key/new "$CONC" "$SECS" ;;
      sqlite) gen_run first-requests idemgate-sqlite unique http://127.0.0.1:18080/key/new "$CONC" "$SECS" ;;
    esac
  done
done

echo "== token flow (fetch a token, then use it)"
gen_run token-flow idemgate-sqlite token http://127.0.0.1:18080 /tok/order "$CONC" "$SECS"
gen_run token-flow idemgate-redis-pg token http://127.0.0.1:18180 /tok/order "$CONC" "$SECS"

echo "== duplicate storm (1000 concurrent, one key) and memory"
# The demo upstream's count of executions (it executes every call it gets).
executions() { curl -s http://127.0.0.1:18091/stats | python3 -c "import json,sys; print(json.load(sys.stdin)['total_executions'])"; }
RSS_BEFORE=$(rss_kib $GW_PG)
curl -s -X POST http://127.0.0.1:18091/reset >/dev/null
gen_run storm idemgate-redis-pg storm http://127.0.0.1:18180/actions/storm 1000
EXEC_PG=$(executions)
curl -s -X POST http://127.0.0.1:18091/reset >/dev/null
gen_run storm idemgate-sqlite storm http://127.0.0.1:18080/actions/storm 1000
EXEC_SQLITE=$(executions)
# The same storm with on_concurrent = "wait": every duplicate waits for the
# first request's outcome. Beside it, one request alone (its latency is
# the yardstick: waiters should take at most 2x it plus 10 ms).
WAIT_EXEC=()
for t in redis-pg sqlite; do
  port=$([ $t = sqlite ] && echo 18080 || echo 18180)
  curl -s -X POST http://127.0.0.1:18091/reset >/dev/null
  gen_run single idemgate-$t storm http://127.0.0.1:$port/actions/wait-single 1
  curl -s -X POST http://127.0.0.1:18091/reset >/dev/null
  gen_run storm-wait idemgate-$t storm http://127.0.0.1:$port/actions/wait 1000
  WAIT_EXEC+=("$(executions)")
done
EXEC_PG="$EXEC_PG/${WAIT_EXEC[0]}"; EXEC_SQLITE="$EXEC_SQLITE/${WAIT_EXEC[1]}"

# The peer beside Idemgate: 50 concurrent requests on one fresh key, at the
# demo upstream (which executes every call it gets); Idemgate's duplicates
# wait for the first one's answer, as the peer's do.
PEER_STORM=()
for t in idemgate-redis-pg $([ -n "$PEER" ] && echo peer-redis); do
  curl -s -X POST http://127.0.0.1:18091/reset >/dev/null
  case $t in
    idemgate-redis-pg) gen_run storm50 $t storm http://127.0.0.1:18180/actions/wait 50 ;;
    peer-redis) gen_run storm50 $t storm http://127.0.0.1:18280/URL_STORM 50 ;;
  esac
  PEER_STORM+=("$t=$(executions)")
done
RSS_AFTER=$(rss_kib $GW_PG); HWM=$(hwm_kib $GW_PG)

# --- the table ---------------------------------------------------------------
mkdir -p loadtest/results
python3 - "$RES" "$EXEC_PG" "$EXEC_SQLITE" "$RSS_BEFORE" "$RSS_AFTER" "$HWM" "$SECS" "$ROUNDS" "$CONC" \
  "$TLS_RSS_IDLE" "$TLS_RSS_LOADED" "$TLS_HWM" "$TLS_CONNS" "$TLS_RSS_RATED" "$TLS_HWM_RATED" "$TLS_UPSTREAM" \
  "${PEER_STORM[*]}" > loadtest/results/latest.md <<'PY'
import json, sys, statistics, platform, datetime
res, exec_pg, exec_sqlite, rss0, rss1, hwm, secs, rounds, conc, trss0, trss1, thwm, tconns, trated, thwmrated, tup, storm50 = sys.argv[1:]
rows = [json.loads(l) for l in open(res)]
def agg(scenario, target):
    rs = [r for r in rows if r['scenario'] == scenario and r['target'] == target]
    if not rs: return None
    return {k: statistics.median([r[k] for r in rs]) for k in ('rps', 'p50_ms', 'p99_ms')}
out = []
p = out.append
p(f"# Load test results\n\n{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {platform.node()}: 2 cores shared by the load generator, the gateway, the upstream and the databases. `loadtest/run.sh {secs} {rounds}`: medians of {rounds} alternating rounds of {secs}s, {conc} connections.\n")
def table(title, scenario, targets, base=None):
    p(f"## {title}\n\n| target | req/s | p50 ms | p99 ms | ratio |\n|---|---|---|---|---|")
    b = agg(scenario, base) if base else None
    for t in targets:
        a = agg(scenario, t)
        if not a: continue
        ratio = f"{a['rps']/b['rps']:.2f}× {base}" if b else ""
        p(f"| {t} | {a['rps']:,.0f} | {a['p50_ms']:.2f} | {a['p99_ms']:.2f} | {ratio} |")
    p("")
table("Pass-through (`idempotency = \"none\"`)", "pass-through", ["upstream", "nginx", "idemgate"], "nginx")
table("Pass-through over h2c (`oha --http2`, prior knowledge)", "h2c", ["nginx", "idemgate"], "nginx")
table("Pass-through over TLS, HTTP/1.1", "tls-http1", ["nginx", "idemgate"], "nginx")
table("Pass-through over TLS, h2 (ALPN)", "tls-h2", ["nginx", "idemgate"], "nginx")
table("Pass-through, a new connection per request (`oha --disable-keepalive`)", "new-connections", ["nginx", "idemgate"], "nginx")
table("Replay (one key, already completed)", "replay", ["idemgate-pass", "idemgate-sqlite", "idemgate-redis-pg", "idemgate-redis-pg-h2c", "peer-redis"], "idemgate-pass")
table("First requests (a new key every request; claim durable before forwarding)", "first-requests", ["pgbench-insert", "idemgate-redis-pg", "idemgate-sqlite", "peer-redis"], "pgbench-insert")
table("Beside the peer: replay (one key)", "replay", ["idemgate-redis-pg", "peer-redis"], "peer-redis")
table("Beside the peer: a fresh key per request (the peer keeps its claims in Redis only)", "first-requests", ["idemgate-redis-pg", "peer-redis"], "peer-redis")
p("## Beside the peer: 50 concurrent requests, one fresh key (upstream = demo-upstream)\n\n| target | executions | statuses | p99 ms |\n|---|---|---|---|")
for entry in storm50.split():
    t, count = entry.split("=")
    rs = [x for x in rows if x['scenario'] == 'storm50' and x['target'] == t]
    if rs:
        p(f"| {t} | {count} | {rs[-1]['statuses']} | {rs[-1]['p99_ms']:.1f} |")
p("")
table("Token flow (fetch a token, then use it; req/s = flows/s)", "token-flow", ["idemgate-sqlite", "idemgate-redis-pg"])
p("## Duplicate storm (1000 concurrent requests, one key, upstream = demo-upstream)\n\n| store | on_concurrent | executions | statuses | p99 ms | one request alone, p99 ms |\n|---|---|---|---|---|---|")
for t, e in (("idemgate-redis-pg", exec_pg), ("idemgate-sqlite", exec_sqlite)):
    reject, wait = (e.split("/") + ["?"])[:2]
    for mode, scenario, count in (("reject", "storm", reject), ("wait", "storm-wait", wait)):
        rs = [x for x in rows if x['scenario'] == scenario and x['target'] == t]
        single = [x for x in rows if x['scenario'] == 'single' and x['target'] == t]
        if not rs: continue
        alone = f"{single[-1]['p99_ms']:.1f}" if single and mode == "wait" else ""
        p(f"| {t} | {mode} | {count} | {rs[-1]['statuses']} | {rs[-1]['p99_ms']:.1f} | {alone} |")
p(f"\n## Memory (Redis + Postgres gateway)\n\nRSS before the storm {int(rss0)//1024} MiB, after {int(rss1)//1024} MiB, peak over the whole run {int(hwm)//1024} MiB.\n")
p(f"## Memory with 1000 connections (TLS gateway, 500 HTTP/1.1 + 500 h2)\n\n{tconns} connections established; RSS idle {int(trss0)//1024} MiB; at 2,000 requests/s loaded {int(trated)//1024} MiB, peak {int(thwmrated)//1024} MiB; flat out (about 1,000 requests in flight, {tup} upstream connections) loaded {int(trss1)//1024} MiB, peak {int(thwm)//1024} MiB.\n")
print("\n".join(out))
PY
cat loadtest/results/latest.md
