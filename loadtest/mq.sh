#!/usr/bin/env bash
# The MQ link beside a bare consumer: messages per second delivered once
# through Idemgate's RabbitMQ consumer (Redis + Postgres) and through a
# consumer that forwards and acks without deduplication, same broker and
# upstream, alternating rounds. Writes loadtest/results/mq.md.
#
#   loadtest/mq.sh [MESSAGES] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh >/dev/null
cargo build --profile dist --features jemalloc -q --example mq_bench
mkdir -p loadtest/results
{
  echo "# MQ link: $(date -u +%FT%TZ), ${1:-5000} messages x ${2:-3} rounds, prefetch ${IDEMGATE_BENCH_PREFETCH:-32}"
  echo
  target/dist/examples/mq_bench "${1:-5000}" "${2:-3}"
} | tee loadtest/results/mq.md
