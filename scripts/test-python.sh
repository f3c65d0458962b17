#!/usr/bin/env bash
# The Python side (issue 14): builds the `kvlease` package (python/, PyO3 + maturin, abi3) once
# as a wheel, installs it into a virtual environment cached outside the repo
# (${KVLEASE_CACHE:-~/.cache/kvlease}/py-venv, with maturin, pytest and mypy) and runs
# python/tests and mypy's stubtest on the stubs.
# Then, unless KVLEASE_SKIP_VLLM=1, installs vLLM into its own cached venv
# (scripts/install-vllm.sh, ~9 GB, ~8 min the first time) and runs python/vllm_tests there
# against real vLLM classes on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE_ROOT="${KVLEASE_CACHE:-${HOME:-/root}/.cache/kvlease}"
PYV="$CACHE_ROOT/py-venv"
started=$(date +%s)

if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    SUDO=(); [[ $(id -u) -ne 0 ]] && SUDO=(sudo)
    "${SUDO[@]}" apt-get install -y -qq --no-install-recommends python3-venv >&2 ||
        { "${SUDO[@]}" apt-get update -qq && "${SUDO[@]}" apt-get install -y -qq --no-install-recommends python3-venv; }
fi
if [[ ! -x $PYV/bin/maturin || ! -x $PYV/bin/pytest || ! -x $PYV/bin/stubtest ]]; then
    rm -rf "$PYV"
    python3 -m venv "$PYV"
    "$PYV/bin/python" -m pip install --disable-pip-version-check -q 'maturin>=1.7,<2' pytest mypy
fi

echo "== python: build the kvlease wheel (maturin, release; target dir python/target)"
# maturin's PEP 517 hook runs `maturin` from PATH.
export PATH="$PYV/bin:$PATH"
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$PYV/bin/python" -m pip wheel --disable-pip-version-check -q --no-deps --no-build-isolation ./python -w "$wheels"
wheel=$(ls "$wheels"/kvlease-*.whl)
"$PYV/bin/python" -m pip install --disable-pip-version-check -q --force-reinstall --no-deps "$wheel"

echo "== python: pytest python/tests (the bindings)"
"$PYV/bin/python" -m pytest -q -p no:cacheprovider python/tests
echo "== python: the type stubs match the module (mypy stubtest kvlease._core)"
(cd "$wheels" && "$PYV/bin/python" -m mypy.stubtest kvlease._core)
echo "== python: bindings built and tested in $(( $(date +%s) - started )) s"

if [ "${KVLEASE_SKIP_VLLM:-0}" = 1 ]; then
    echo "!!!!!!!! KVLEASE_SKIP_VLLM=1: the vLLM connector is NOT tested in this run !!!!!!!!"
    exit 0
fi
echo "== python: install vLLM (scripts/install-vllm.sh; cached by version)"
t=$(date +%s)
VENV=$(scripts/install-vllm.sh | tail -n 1)
echo "== python: vLLM environment ready in $(( $(date +%s) - t )) s"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q --force-reinstall --no-deps "$wheel"
if [ -d python/vllm_tests ]; then
    echo "== python: pytest python/vllm_tests (KvleaseConnector against real vLLM classes, CPU)"
    # test_push_router.py runs vLLM's push router against `kvlease serve` push engines: the
    # binary cargo built (scripts/test.sh builds it first).
    (VLLM_TARGET_DEVICE=cpu UCX_TLS=tcp HF_HUB_OFFLINE=1 KVLEASE_PUSH_ROUTER="$VENV/share/kvlease/disagg_proxy_pushconnector_demo.py" \
        KVLEASE_BIN="${KVLEASE_BIN:-${CARGO_TARGET_DIR:-$PWD/target}/debug/kvlease}" \
        "$VENV/bin/python" -m pytest -q -p no:cacheprovider python/vllm_tests)
fi
echo "== python: all done in $(( $(date +%s) - started )) s"
