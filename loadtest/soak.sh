#!/usr/bin/env bash
# Bounded soak (issue #7), not part of CI: a fixed request rate with 10%
# duplicate keys through Idemgate on a private Redis + Postgres, while the
# private Redis is killed and restarted every minute. Reports executions vs
# unique keys (the oracle: no key executed twice, no key answered 2xx lost),
# error counts, and the gateway's memory at the start, every 30 s and the end.
#
#   loadtest/soak.sh [SECONDS=600] [RATE=300]       (127.0.0.1 only)
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-600}
RATE=${2:-300}
PG_URL=${IDEMGATE_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
WORK=$(mktemp -d /tmp/idemgate-soak.XXXX)
REDIS_PORT=18379
scripts/services.sh >/dev/null
cargo build --profile dist --features jemalloc -q --bins
cargo build --profile dist --features jemalloc -q --example loadgen
BIN=target/dist
SCHEMA=soak_$(date +%s)
psql -q "$PG_URL" -c "CREATE SCHEMA $SCHEMA"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  redis-cli -p $REDIS_PORT shutdown nosave >/dev/null 2>&1 || true
  psql -q "$PG_URL" -c "DROP SCHEMA IF EXISTS $SCHEMA CASCADE" 2>/dev/null || true
}
trap cleanup EXIT
start_redis() { redis-server --port $REDIS_PORT --bind 127.0.0.1 --save "" --appendonly no --daemonize yes >/dev/null; }
start_redis
$BIN/demo-upstream 127.0.0.1:18491 >/dev/null & pids+=($!)
cat > "$WORK/idemgate.toml" <<TOML
[server]
listen = "127.0.0.1:18480"
admin_listen = "127.0.0.1:18490"
[[upstreams]]
name = "demo"
url = "http://127.0.0.1:18491"
[[routes]]
name = "soak"
methods = ["POST"]
path_prefix = "/actions/"
upstream = "demo"
idempotency = "key"
TOML
IDEMGATE_LOG=warn IDEMGATE_DATABASE_URL="$PG_URL?options[search_path]=$SCHEMA" \
  IDEMGATE_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/" $BIN/idemgate serve --config "$WORK/idemgate.toml" & GW=$!; pids+=($GW)
for _ in $(seq 1 100); do curl -s -o /dev/null http://127.0.0.1:18480/ && break; sleep 0.1; done
rss() { awk '/^VmRSS/ {print $2}' "/proc/$GW/status"; }
RSS_START=$(rss)
# The gateway's resident set every 30 s: flat is the claim (issue #6).
( while sleep 30; do rss; done ) > "$WORK/rss.txt" 2>/dev/null & pids+=($!)
# Kill and restart the private Redis every minute while the load runs.
( while sleep 60; do redis-cli -p $REDIS_PORT shutdown nosave >/dev/null 2>&1 || true; sleep 2; start_redis; done ) & pids+=($!)
echo "soak: ${SECS}s at ${RATE} req/s, 10% duplicate keys, Redis restarted every minute"
$BIN/examples/loadgen soak http://127.0.0.1:18480/actions/soak "$RATE" "$SECS" 10 > "$WORK/load.json" 2> "$WORK/keys.json"
RSS_END=$(rss)
curl -s http://127.0.0.1:18491/stats > "$WORK/stats.json"
curl -s http://127.0.0.1:18490/metrics | grep -E '^idemgate_(requests_total\{route="soak"|store_fallback_total)' > "$WORK/metrics.txt" || true
python3 - "$WORK" "$RSS_START" "$RSS_END" "$SECS" "$RATE" <<'PY'
import json, sys
work, rss0, rss1, secs, rate = sys.argv[1:]
load = json.load(open(f"{work}/load.json"))
unique = json.loads(open(f"{work}/keys.json").read().strip().splitlines()[-1])["unique_keys"]
stats = json.load(open(f"{work}/stats.json"))
per_key = stats["executions"].get("soak", {})
twice = {k: n for k, n in per_key.items() if n > 1}
print(f"# Soak: {secs}s at {rate} req/s, 10% duplicate keys, Redis killed and restarted every minute\n")
print(f"| figure | value |\n|---|---|")
print(f"| requests sent | {load['requests'] + load['errors']} |")
print(f"| unique keys | {unique} |")
print(f"| keys executed | {len(per_key)} |")
print(f"| executions | {sum(per_key.values())} |")
print(f"| keys executed more than once | {len(twice)} |")
print(f"| statuses | {load['statuses']} |")
print(f"| transport errors | {load['errors']} |")
print(f"| p50 / p99 ms | {load['p50_ms']:.1f} / {load['p99_ms']:.1f} |")
print(f"| gateway RSS start → end | {int(rss0)//1024} MiB → {int(rss1)//1024} MiB |")
series = [int(x) // 1024 for x in open(f"{work}/rss.txt").read().split() if x.isdigit()]
print(f"| gateway RSS every 30 s (MiB) | {' → '.join(map(str, series))} |")
print("\n```\n" + open(f"{work}/metrics.txt").read() + "```")
PY
