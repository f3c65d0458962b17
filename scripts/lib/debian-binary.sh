# Sourced by scripts/install-prometheus.sh and scripts/install-etcd.sh: fetch one binary out of a
# Debian package, idempotently. The package is downloaded (`apt-get download`, not installed: no
# service is set up or started) and the binary unpacked into
# ${KVLEASE_CACHE:-$HOME/.cache/kvlease}/DIR.
#
#   debian_binary TOOL PACKAGE DIR PATH_IN_PACKAGE   # prints the binary's absolute path
#
# TOOL names the calling script in messages; progress goes to stderr.

debian_binary() {
    local tool=$1 package=$2 dir_name=$3 path=$4
    local cache_root="${KVLEASE_CACHE:-${HOME:-/root}/.cache/kvlease}"
    local dir="$cache_root/$dir_name"
    local bin="$dir/$path"
    log() { printf '%s: %s\n' "$tool" "$*" >&2; }
    die() { printf '\n%s: ERROR: %s\n' "$tool" "$*" >&2; exit 1; }

    if [[ ! -x $bin ]]; then
        command -v apt-get >/dev/null 2>&1 || die "no apt-get: install $package by hand and point the test's variable at its binary"
        mkdir -p "$dir"
        local tmp
        tmp=$(mktemp -d "$dir/.download.XXXXXX")
        # shellcheck disable=SC2064 # expand now: $tmp is local
        trap "rm -rf '$tmp'" EXIT
        log "downloading Debian's $package package"
        if ! (cd "$tmp" && apt-get download "$package" >&2 2>/dev/null); then
            log "apt-get update"
            apt-get -o DPkg::Lock::Timeout=600 update -qq >&2 || die "apt-get update failed: check access to the Debian mirror"
            (cd "$tmp" && apt-get download "$package" >&2) || die "apt-get download $package failed"
        fi
        local deb
        deb=$(find "$tmp" -maxdepth 1 -name "${package}_*.deb" -print -quit)
        [[ -n $deb ]] || die "apt-get download left no ${package}_*.deb"
        dpkg-deb -x "$deb" "$tmp/x" || die "dpkg-deb -x $deb failed"
        [[ -x $tmp/x/$path ]] || die "the package holds no $path"
        mkdir -p "$(dirname "$bin")"
        mv "$tmp/x/$path" "$bin"
        log "ready: $("$bin" --version 2>&1 | head -n 1)"
    fi
    printf '%s\n' "$bin"
}
