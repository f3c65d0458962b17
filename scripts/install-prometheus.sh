#!/usr/bin/env bash
# Fetch a Prometheus server for the observability test (crates/kvlease/tests/observability.rs),
# idempotently: Debian's `prometheus` package is downloaded (not installed: no service is set up
# or started) and its binary unpacked into ${KVLEASE_CACHE:-$HOME/.cache/kvlease}/prometheus.
#
# Usage:   KVLEASE_PROMETHEUS=$(scripts/install-prometheus.sh)
# The last line of stdout is the binary's absolute path; progress goes to stderr.
set -euo pipefail

CACHE_ROOT="${KVLEASE_CACHE:-${HOME:-/root}/.cache/kvlease}"
DIR="$CACHE_ROOT/prometheus"
BIN="$DIR/usr/bin/prometheus"

log() { printf 'install-prometheus: %s\n' "$*" >&2; }
die() { printf '\ninstall-prometheus: ERROR: %s\n' "$*" >&2; exit 1; }

if [[ ! -x $BIN ]]; then
    command -v apt-get >/dev/null 2>&1 || die "no apt-get: install Prometheus by hand and set KVLEASE_PROMETHEUS to its binary"
    mkdir -p "$DIR"
    tmp=$(mktemp -d "$DIR/.download.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    log "downloading Debian's prometheus package"
    if ! (cd "$tmp" && apt-get download prometheus >&2 2>/dev/null); then
        log "apt-get update"
        apt-get update -qq >&2 || die "apt-get update failed: check access to the Debian mirror"
        (cd "$tmp" && apt-get download prometheus >&2) || die "apt-get download prometheus failed"
    fi
    deb=$(find "$tmp" -maxdepth 1 -name 'prometheus_*.deb' -print -quit)
    [[ -n $deb ]] || die "apt-get download left no prometheus_*.deb"
    dpkg-deb -x "$deb" "$tmp/x" || die "dpkg-deb -x $deb failed"
    [[ -x $tmp/x/usr/bin/prometheus ]] || die "the package holds no usr/bin/prometheus"
    mkdir -p "$DIR/usr/bin"
    mv "$tmp/x/usr/bin/prometheus" "$BIN"
    log "Prometheus ready: $("$BIN" --version 2>&1 | head -n 1)"
fi
printf '%s\n' "$BIN"
