#!/usr/bin/env bash
# Install vllm-router (vLLM's Rust router, Apache-2.0, a wheel on PyPI with its Python launcher)
# into a virtual environment cached OUTSIDE the repo, keyed by version:
# ${KVLEASE_CACHE:-$HOME/.cache/kvlease}/vllm-router-0.1.17 (about 130 MB, about 30 s the first
# time). scripts/bench-proxy.sh runs it as a peer of `kvlease proxy` in PD mode (issue 27).
#
# Usage:   VENV=$(scripts/install-vllm-router.sh)   # the last line of stdout is the venv's path;
#          "$VENV/bin/vllm-router" --help
# Idempotent: a stamp file marks a complete install; a half-done one is removed and redone.
set -euo pipefail

VLLM_ROUTER_VERSION=${VLLM_ROUTER_VERSION:-0.1.17}
CACHE_ROOT="${KVLEASE_CACHE:-${HOME:-/root}/.cache/kvlease}"
VENV="$CACHE_ROOT/vllm-router-$VLLM_ROUTER_VERSION"
STAMP="$VENV/.kvlease-installed"

log() { printf 'install-vllm-router: %s\n' "$*" >&2; }
die() { printf '\ninstall-vllm-router: ERROR: %s\n' "$*" >&2; exit 1; }

if [[ -f $STAMP && -x $VENV/bin/vllm-router ]]; then
    printf '%s\n' "$VENV"
    exit 0
fi

source "$(dirname "$0")/lib/python-venv.sh"
ensure_python_venv

started=$(date +%s)
rm -rf "$VENV"
mkdir -p "$CACHE_ROOT"
log "creating $VENV"
python3 -m venv "$VENV" >&2
log "pip install vllm-router==$VLLM_ROUTER_VERSION"
"$VENV/bin/python" -m pip install --disable-pip-version-check --no-cache-dir --progress-bar off -q \
    "vllm-router==$VLLM_ROUTER_VERSION" >&2 || { rm -rf "$VENV"; die "pip install vllm-router==$VLLM_ROUTER_VERSION failed"; }
[[ -x $VENV/bin/vllm-router ]] || { rm -rf "$VENV"; die "the wheel installed no vllm-router launcher"; }
touch "$STAMP"
log "installed in $(( $(date +%s) - started )) s, $(du -sh "$VENV" | cut -f1)"
printf '%s\n' "$VENV"
