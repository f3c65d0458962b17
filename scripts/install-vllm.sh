#!/usr/bin/env bash
# Install vLLM and NIXL's Python packages into a virtual environment cached OUTSIDE the repo,
# keyed by version: ${KVLEASE_CACHE:-$HOME/.cache/kvlease}/vllm-0.33.0 (about 9 GB; issue 14).
# The vLLM connector tests (python/vllm_tests/) run in it, on CPU: vLLM's connector classes
# construct without a GPU (VLLM_TARGET_DEVICE=cpu, UCX_TLS=tcp, CPU KV buffers).
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

if [[ -f $STAMP && -x $VENV/bin/python ]]; then
    printf '%s\n' "$VENV"
    exit 0
fi

command -v python3 >/dev/null || die "no python3 on this machine"
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    # Debian's python3 ships venv/ensurepip separately.
    command -v apt-get >/dev/null || die "python3 has no venv module and there is no apt-get"
    SUDO=(); [[ $(id -u) -ne 0 ]] && SUDO=(sudo)
    log "installing python3-venv"
    "${SUDO[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends python3-venv >&2 ||
        { "${SUDO[@]}" apt-get -o DPkg::Lock::Timeout=600 update -qq >&2 && "${SUDO[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends python3-venv >&2; } ||
        die "apt-get install python3-venv failed"
fi

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
touch "$STAMP"
log "installed in $(( $(date +%s) - started )) s, $(du -sh "$VENV" | cut -f1)"
printf '%s\n' "$VENV"
