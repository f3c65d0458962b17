#!/usr/bin/env bash
# Install what the NIXL transport backend needs, idempotently:
#   * Debian packages for building nixl-sys (bindgen needs libclang) and unzip;
#   * the NIXL shared libraries from the PyPI wheel nixl-cu12 (no CUDA needed at
#     run time), cached OUTSIDE the repo in ${KVLEASE_CACHE:-$HOME/.cache/kvlease}/nixl.
#
# Usage:   NIXL_LIB_DIR=$(scripts/install-nixl.sh)
#          LD_LIBRARY_PATH=$NIXL_LIB_DIR UCX_TLS=tcp cargo test ...
# The last line of stdout is the absolute path of the directory holding
# libnixl_capi.so; all progress messages go to stderr.
# Never commit the wheel or anything unpacked from it.
set -euo pipefail

NIXL_WHEEL_SPEC="nixl-cu12==1.5.1"
CACHE_ROOT="${KVLEASE_CACHE:-${HOME:-/root}/.cache/kvlease}"
NIXL_DIR="$CACHE_ROOT/nixl"
UNPACK_DIR="$NIXL_DIR/unpacked-1.5.1"
STAMP="$UNPACK_DIR/.kvlease-unpacked"
LIB_SUBDIR=".nixl_cu12.mesonpy.libs"

log() { printf 'install-nixl: %s\n' "$*" >&2; }
did_work=0
die() {
    {
        printf '\n'
        printf '############################################################\n'
        printf 'install-nixl: ERROR: %s\n' "$1"
        shift
        for line in "$@"; do printf 'install-nixl:   %s\n' "$line"; done
        printf '############################################################\n'
    } >&2
    exit 1
}

# ---- 1. Debian packages ------------------------------------------------------
APT_PKGS=(libclang-dev unzip)
missing=()
for p in "${APT_PKGS[@]}"; do
    if ! dpkg -s "$p" >/dev/null 2>&1; then missing+=("$p"); fi
done
if ((${#missing[@]})); then
    if ! command -v apt-get >/dev/null 2>&1; then
        die "missing packages: ${missing[*]} and no apt-get on this machine" \
            "Install them (libclang for bindgen, unzip) by hand and re-run."
    fi
    SUDO=()
    if [[ $(id -u) -ne 0 ]]; then SUDO=(sudo); fi
    export DEBIAN_FRONTEND=noninteractive
    did_work=1
    log "installing Debian packages: ${missing[*]}"
    # apt-get update only when the package lists do not know a package we need
    # (fresh machine); if the install still fails, refresh once and retry.
    need_update=0
    for p in "${missing[@]}"; do
        if ! apt-cache policy "$p" 2>/dev/null | grep -q 'Candidate: [0-9]'; then need_update=1; fi
    done
    if ((need_update)); then
        log "apt-get update"
        "${SUDO[@]}" apt-get -o DPkg::Lock::Timeout=600 update -qq >&2 || die "apt-get update failed" \
            "Check network access to the Debian mirror, then re-run scripts/install-nixl.sh."
    fi
    if ! "${SUDO[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >&2; then
        log "apt-get install failed; refreshing package lists and retrying"
        "${SUDO[@]}" apt-get -o DPkg::Lock::Timeout=600 update -qq >&2 || true
        "${SUDO[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >&2 ||
            die "apt-get install ${missing[*]} failed" \
                "Run: apt-get update && apt-get install -y ${missing[*]}"
    fi
fi

# ---- 2. NIXL libraries from the PyPI wheel -----------------------------------
lib_dir_of() { printf '%s/%s' "$UNPACK_DIR" "$LIB_SUBDIR"; }

if [[ ! -f $STAMP || ! -f "$(lib_dir_of)/libnixl_capi.so" ]]; then
    did_work=1
    mkdir -p "$NIXL_DIR"
    wheel=$(find "$NIXL_DIR" -maxdepth 1 -name 'nixl_cu12-1.5.1-*.whl' -print -quit)
    if [[ -z $wheel ]]; then
        PIP=()
        if command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; then
            PIP=(python3 -m pip)
        elif command -v pip3 >/dev/null 2>&1; then
            PIP=(pip3)
        elif command -v pip >/dev/null 2>&1; then
            PIP=(pip)
        else
            die "no pip found: cannot download the NIXL wheel $NIXL_WHEEL_SPEC" \
                "Install pip (apt-get install -y python3-pip) and re-run scripts/install-nixl.sh."
        fi
        tmpdl=$(mktemp -d "$NIXL_DIR/.download.XXXXXX")
        trap 'rm -rf "$tmpdl"' EXIT
        log "downloading $NIXL_WHEEL_SPEC (~69 MB) into $NIXL_DIR"
        # Pin the wheel's tags so the same file is fetched whatever the local
        # Python version is (only the bundled C++ libraries are used).
        if ! "${PIP[@]}" download --no-deps --only-binary=:all: --disable-pip-version-check \
            --python-version 3.11 --implementation cp --abi cp311 \
            --platform "manylinux_2_28_$(uname -m)" \
            --progress-bar off -q "$NIXL_WHEEL_SPEC" -d "$tmpdl" >&2; then
            die "failed to download the NIXL wheel '$NIXL_WHEEL_SPEC' from PyPI" \
                "Command: ${PIP[*]} download --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_$(uname -m) $NIXL_WHEEL_SPEC -d DIR" \
                "Check network access to PyPI (and pip's index settings), then re-run" \
                "scripts/install-nixl.sh. Without it the NIXL backend is unavailable" \
                "(nixl_sys::is_stub() stays true) and NIXL tests cannot run."
        fi
        wheel=$(find "$tmpdl" -maxdepth 1 -name 'nixl_cu12-1.5.1-*.whl' -print -quit)
        [[ -n $wheel ]] || die "pip reported success but no nixl_cu12-1.5.1 wheel is in $tmpdl" \
            "Contents: $(ls -A "$tmpdl" | tr '\n' ' ')"
        mv "$wheel" "$NIXL_DIR/"
        wheel="$NIXL_DIR/$(basename "$wheel")"
        rm -rf "$tmpdl"
        trap - EXIT
    else
        log "using cached wheel $wheel"
    fi

    log "unpacking $(basename "$wheel")"
    rm -rf "$UNPACK_DIR"
    tmpun=$(mktemp -d "$NIXL_DIR/.unpack.XXXXXX")
    trap 'rm -rf "$tmpun"' EXIT
    if ! unzip -q -o "$wheel" -d "$tmpun" >&2; then
        rm -f "$wheel"
        die "failed to unzip $wheel (removed it; it was probably truncated)" \
            "Re-run scripts/install-nixl.sh to download it again."
    fi
    [[ -f "$tmpun/$LIB_SUBDIR/libnixl_capi.so" ]] ||
        die "the wheel has no $LIB_SUBDIR/libnixl_capi.so; its layout changed" \
            "Look inside $wheel and update LIB_SUBDIR in scripts/install-nixl.sh."
    chmod 755 "$tmpun"
    touch "$tmpun/.kvlease-unpacked"
    mv "$tmpun" "$UNPACK_DIR"
    trap - EXIT
fi

LIB_DIR=$(cd "$(lib_dir_of)" && pwd -P)
if ((did_work)); then log "NIXL libraries ready in $LIB_DIR"; fi
printf '%s\n' "$LIB_DIR"
