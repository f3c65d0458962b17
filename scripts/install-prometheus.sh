#!/usr/bin/env bash
# Fetch a Prometheus server for the observability test (crates/kvlease/tests/observability.rs),
# idempotently: Debian's `prometheus` package is downloaded (not installed: no service is set up
# or started) and its binary unpacked into ${KVLEASE_CACHE:-$HOME/.cache/kvlease}/prometheus.
#
# Usage:   KVLEASE_PROMETHEUS=$(scripts/install-prometheus.sh)
# The last line of stdout is the binary's absolute path; progress goes to stderr.
set -euo pipefail
# shellcheck source=lib/debian-binary.sh
source "$(dirname "$0")/lib/debian-binary.sh"
debian_binary install-prometheus prometheus prometheus usr/bin/prometheus
