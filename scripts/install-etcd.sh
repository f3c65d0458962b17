#!/usr/bin/env bash
# Fetch an etcd server for the membership test (crates/kvlease/tests/membership.rs),
# idempotently: Debian's `etcd-server` package is downloaded (not installed: no service is set up
# or started) and its binary unpacked into ${KVLEASE_CACHE:-$HOME/.cache/kvlease}/etcd.
#
# Usage:   KVLEASE_ETCD=$(scripts/install-etcd.sh)
# The last line of stdout is the binary's absolute path; progress goes to stderr.
set -euo pipefail
# shellcheck source=lib/debian-binary.sh
source "$(dirname "$0")/lib/debian-binary.sh"
debian_binary install-etcd etcd-server etcd usr/bin/etcd
