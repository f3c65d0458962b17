#!/usr/bin/env bash
# Install vLLM and NIXL's Python packages into a virtual environment cached OUTSIDE the repo,
# keyed by version: ${KVLEASE_CACHE:-$HOME/.cache/kvlease}/vllm-0.33.0 (about 9 GB; issue 14).
# The vLLM connector tests (python/vllm_tests/) run in it, on CPU: vLLM's connector classes
# construct without a GPU (VLLM_TARGET_DEVICE=cpu, UCX_TLS=tcp, CPU KV buffers).
#
# vLLM's push-mode router (examples/disaggregated/disaggregated_serving/
# disagg_proxy_pushconnector_demo.py, Apache-2.0) is not in any wheel: it is taken from the sdist
# of the same release on PyPI (checked against the index's sha256) into $VENV/share/kvlease/,
# unchanged, licence header included (python/vllm_tests/test_push_router.py runs it against
# kvlease's push engines). It is not copied into this repository.
#
# Usage:   VENV=$(scripts/install-vllm.sh)   # the last line of stdout is the venv's path
# Idempotent: a stamp file marks a complete install; a half-done one is removed and redone.
set -euo pipefail

VLLM_VERSION=0.33.0
PKGS=("vllm==$VLLM_VERSION" "nixl==1.5.1" "nixl-cu13==1.5.1")
CACHE_ROOT="${KVLEASE_CACHE:-${HOME:-/root}/.cache/kvlease}"
VENV="$CACHE_ROOT/vllm-$VLLM_VERSION"
STAMP="$VENV/.kvlease-installed"

log() { printf 'install-vllm: %s\n' "$*" >&2; }
die() { printf '\ninstall-vllm: ERROR: %s\n' "$*" >&2; exit 1; }

PUSH_ROUTER="$VENV/share/kvlease/disagg_proxy_pushconnector_demo.py"

source "$(dirname "$0")/lib/sdist.sh"
fetch_push_router() {
    [[ -f $PUSH_ROUTER ]] && return 0
    log "fetching vLLM's push router from the vllm==$VLLM_VERSION sdist on PyPI"
    fetch_sdist_member "$VENV/bin/python" "$VLLM_VERSION" \
        examples/disaggregated/disaggregated_serving/disagg_proxy_pushconnector_demo.py "$PUSH_ROUTER" >&2 ||
        die "could not fetch vLLM's push router"
}

if [[ -f $STAMP && -x $VENV/bin/python ]]; then
    fetch_push_router
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
log "pip install ${PKGS[*]} (about 9 GB; minutes)"
# --no-cache-dir: the venv is the cache; a second copy of the wheels in pip's cache would
# double the disk used.
"$VENV/bin/python" -m pip install --disable-pip-version-check --no-cache-dir --progress-bar off -q \
    "${PKGS[@]}" pytest >&2 || { rm -rf "$VENV"; die "pip install ${PKGS[*]} failed"; }
fetch_push_router
touch "$STAMP"
log "installed in $(( $(date +%s) - started )) s, $(du -sh "$VENV" | cut -f1)"
printf '%s\n' "$VENV"
