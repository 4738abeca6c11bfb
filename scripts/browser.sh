#!/usr/bin/env bash
# Installs Debian's Chromium for the dashboard test (tests/suite/operators.rs)
# when it is missing. Never fails by itself: without a browser the test says
# so by name and is skipped (or fails, with CI=true).
set -u
if command -v chromium >/dev/null 2>&1; then
  echo "browser: chromium available"
  exit 0
fi
if command -v apt-get >/dev/null 2>&1; then
  echo "browser: installing chromium"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 || true
fi
if command -v chromium >/dev/null 2>&1; then
  echo "browser: chromium available"
else
  echo "browser: chromium NOT available (the dashboard test will be skipped)"
fi
