#!/usr/bin/env bash
# The test command (README: "Run the tests"). Starts PostgreSQL, MariaDB,
# Redis, RabbitMQ and NATS when they are installed but down, then runs every test
# of the workspace. Without them the embedded-store tests still run and each
# service test prints "SKIPPED (no Postgres|MariaDB|Redis|RabbitMQ|NATS): <test
# name>"; with CI=true a missing service fails the run instead.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
# Headless Chromium for the dashboard test.
scripts/browser.sh
# tests/suite/library.rs starts the example app as a process.
cargo build -p idemgate --example orders
# Every crate's unit tests, the end-to-end suite (tests/suite), the
# examples and load generators built as tests.
cargo test --workspace --all-targets "$@"
# The key, token and callback suites once more with every request over
# HTTP/2 (h2c, one connection per client): the semantics must not depend
# on the protocol (tests/suite/support/mod.rs, HTTP2_ENV).
IDEMGATE_TEST_HTTP2=1 cargo test --test suite "$@" -- key_routes:: token_routes:: callback_routes::
# Every end-to-end suite that runs on Postgres once more on MariaDB (the
# MySQL store; tests/suite/support/services.rs, shared_sql).
IDEMGATE_TEST_SQL=mariadb cargo test --test suite "$@" -- after_answer:: claim_life:: \
  edges:: faults:: grpc:: ingress:: key_routes:: library:: operations:: redis_cluster:: \
  reloads:: store_faults:: consumers::
# The READMEs' quick starts (the repository's and the library crate's)
# and every crate's documentation examples.
exec cargo test --workspace --doc "$@"
