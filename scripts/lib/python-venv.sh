# Sourced by the install scripts: makes sure `python3 -m venv` works, installing Debian's
# python3-venv when the module is missing. Needs the caller's `log` and `die`.
ensure_python_venv() {
    command -v python3 >/dev/null || die "no python3 on this machine"
    if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
        # Debian's python3 ships venv/ensurepip separately.
        command -v apt-get >/dev/null || die "python3 has no venv module and there is no apt-get"
        local sudo=()
        [[ $(id -u) -ne 0 ]] && sudo=(sudo)
        log "installing python3-venv"
        "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends python3-venv >&2 ||
            { "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 update -qq >&2 && "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends python3-venv >&2; } ||
            die "apt-get install python3-venv failed"
    fi
}
