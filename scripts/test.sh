#!/usr/bin/env bash
# The one test command (README): formatting, lints, every test. Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --quiet -- -D warnings

echo "== cargo test"
cargo test --workspace --quiet 2>&1 | tee /tmp/kvlease-test.log
