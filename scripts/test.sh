#!/usr/bin/env bash
# The one test command (README): formatting, lints, every test — over the tcp transport and
# over NIXL. Installs what it needs: libclang (bindgen, for the NIXL bindings) and the NIXL
# libraries from PyPI (cached outside the repo by scripts/install-nixl.sh), a Prometheus server
# (scripts/install-prometheus.sh), an etcd server (scripts/install-etcd.sh), the OpenAI Python
# SDK, and for python/ maturin, pytest and vLLM in virtual environments cached outside the repo
# (scripts/test-python.sh), and for the real-serving test a CPU vLLM (scripts/real-vllm/install.sh,
# cached outside the repo as well).
#
# NIXL tests must run: if NIXL cannot be installed the run fails, loudly. Set
# KVLEASE_SKIP_NIXL=1 to run everything else on a machine that cannot have NIXL, and
# KVLEASE_SKIP_REAL_VLLM=1 to skip the real `vllm serve` test (scripts/test-real-vllm.sh: about
# 8 minutes and 8 GB of memory).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)

echo "== SPEC coverage: every SPEC id named by a test (or allow-listed as not implemented)"
scripts/spec-coverage.sh

# vLLM's environment (~9 GB, cached by version) is mostly a download: on a fresh machine it is
# fetched in the background while the Rust side builds and runs; scripts/test-python.sh waits.
vllm_pid=
if [ "${KVLEASE_SKIP_VLLM:-0}" != 1 ]; then
    vllm_log=$(mktemp)
    echo "== install vLLM in the background (scripts/install-vllm.sh, log $vllm_log)"
    scripts/install-vllm.sh >"$vllm_log" 2>&1 &
    vllm_pid=$!
fi
# The CPU vLLM that serves (scripts/test-real-vllm.sh), fetched in the background too.
real_pid=
if [ "${KVLEASE_SKIP_REAL_VLLM:-0}" != 1 ]; then
    real_log=$(mktemp)
    echo "== install CPU vLLM for the real-serving test in the background (scripts/real-vllm/install.sh, log $real_log)"
    scripts/real-vllm/install.sh >"$real_log" 2>&1 &
    real_pid=$!
fi
# Stopped with the script, whatever ends it (a failed step under `set -e` included).
trap 'for p in $vllm_pid $real_pid; do kill "$p" 2>/dev/null || true; done' EXIT

if [ "${KVLEASE_SKIP_NIXL:-0}" = 1 ]; then
    echo "!!!!!!!! KVLEASE_SKIP_NIXL=1: the NIXL transport is NOT tested in this run !!!!!!!!"
    features=()
else
    echo "== install NIXL (libclang, the nixl-cu12 wheel)"
    NIXL_LIB_DIR=$(scripts/install-nixl.sh | tail -n 1)
    export LD_LIBRARY_PATH="$NIXL_LIB_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export UCX_TLS=tcp KVLEASE_REQUIRE_NIXL=1
    features=(--all-features)
fi

if [ "${KVLEASE_SKIP_HOSTS:-0}" = 1 ]; then
    echo "!!!!!!!! KVLEASE_SKIP_HOSTS=1: the multi-host tests (tests/hosts.rs) are NOT run !!!!!!!!"
else
    # tests/hosts.rs makes network namespaces as hosts and cuts the wire between them with
    # nftables (RELIABILITY.md): it needs root, iproute2 (ip, tc) and nftables.
    echo "== multi-host tests: root, iproute2 and nftables"
    if [ "$(id -u)" != 0 ]; then
        echo "error: the multi-host tests need root (network namespaces); KVLEASE_SKIP_HOSTS=1 skips them" >&2
        exit 1
    fi
    missing=()
    command -v ip >/dev/null && command -v tc >/dev/null || missing+=(iproute2)
    command -v nft >/dev/null || missing+=(nftables)
    if [ "${#missing[@]}" -gt 0 ]; then
        apt-get -o DPkg::Lock::Timeout=600 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${missing[@]}" >/dev/null
    fi
    export KVLEASE_REQUIRE_HOSTS=1
fi

echo "== fetch a Prometheus server (tests/observability.rs scrapes P and D with it)"
KVLEASE_PROMETHEUS=$(scripts/install-prometheus.sh | tail -n 1)
export KVLEASE_PROMETHEUS

echo "== fetch an etcd server (tests/membership.rs runs engines and the proxy with it)"
KVLEASE_ETCD=$(scripts/install-etcd.sh | tail -n 1)
export KVLEASE_ETCD

echo "== install the OpenAI Python SDK (tests/vllm_sdk.rs drives kvlease with it)"
if ! python3 -c "import openai" 2>/dev/null; then
    python3 -m pip install --disable-pip-version-check --quiet openai
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets "${features[@]}" --quiet -- -D warnings

echo "== cargo test (everything but the NIXL tests)"
cargo test --workspace "${features[@]}" -- --skip nixl

if [ "${#features[@]}" -gt 0 ]; then
    # NIXL agents are driven one test at a time (see NIXL.md: one agent pair per process).
    echo "== cargo test: NIXL transport, engine and end to end (UCX over TCP, one test at a time)"
    cargo test --workspace "${features[@]}" nixl -- --test-threads=1
fi

if [ -n "$vllm_pid" ]; then
    echo "== wait for the vLLM install"
    if ! wait "$vllm_pid"; then
        cat "$vllm_log" >&2
        echo "error: scripts/install-vllm.sh failed" >&2
        exit 1
    fi
    vllm_pid=
fi

echo "== Python: the kvlease package (python/) and the vLLM connector (scripts/test-python.sh)"
scripts/test-python.sh

if [ "${KVLEASE_SKIP_REAL_VLLM:-0}" = 1 ]; then
    echo "!!!!!!!! KVLEASE_SKIP_REAL_VLLM=1: real vllm serve engines are NOT tested in this run !!!!!!!!"
else
    echo "== wait for the CPU vLLM install"
    if ! wait "$real_pid"; then
        cat "$real_log" >&2
        echo "error: scripts/real-vllm/install.sh failed" >&2
        exit 1
    fi
    real_pid=
    # Real `vllm serve` P and D, stock NixlConnector and KvleaseConnector, answers checked
    # against one instance, then the fault cases (RELIABILITY.md, "Inside real vLLM"). The
    # kvlease binary is the one cargo test built. A wrong answer fails the run, and so does a
    # healthy request of kvlease's that ends in an error (issue 25).
    echo "== real vLLM serving: scripts/test-real-vllm.sh --faults"
    KVLEASE_BIN="${CARGO_TARGET_DIR:-$PWD/target}/debug/kvlease" scripts/test-real-vllm.sh --faults
fi

echo "== all tests passed in $(( $(date +%s) - started )) s"
