#!/usr/bin/env bash
# The test command (README: "Run the tests"). Starts PostgreSQL and Redis
# when they are installed but down, then runs every test. Without them the
# embedded-store tests still run and each service test prints
# "SKIPPED (no Postgres|Redis): <test name>"; with CI=true a missing service
# fails the run instead.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
# tests/library.rs starts the example app as a process.
cargo build --example orders
cargo test --all-targets "$@"
# The key, token and callback suites once more with every request over
# HTTP/2 (h2c, one connection per client): the semantics must not depend
# on the protocol (tests/support/mod.rs, HTTP2_ENV).
IDEMGATE_TEST_HTTP2=1 cargo test --test key_routes --test token_routes --test callback_routes "$@"
# The library's quick start (src/library.rs) is a doc test.
exec cargo test --doc "$@"
