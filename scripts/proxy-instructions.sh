#!/usr/bin/env bash
# Instructions a request costs `kvlease proxy` in user space (issue 27), counted by callgrind:
# a figure that, unlike CPU time on a shared machine, does not move with the machine's load, so
# two builds compare in one line each. P and D are real `kvlease serve` processes (zero
# compute); the proxy runs under `valgrind --tool=callgrind`, its instrumentation switched on only
# for the measured load (after a warm-up), and the total is divided by the requests. The kernel's
# share (the socket writes, about a quarter of the proxy's CPU here) is not counted.
#
#   scripts/proxy-instructions.sh                        # release build, 1000 requests, c=16
#   STREAM=--stream N=2000 scripts/proxy-instructions.sh
#   KVLEASE_BIN=path PROXY_BIN=other/kvlease scripts/proxy-instructions.sh   # another proxy build
#
# Needs valgrind (apt-get install -y valgrind).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null && command -v callgrind_control >/dev/null ||
  { echo "error: valgrind is needed (apt-get install -y valgrind)" >&2; exit 1; }
N=${N:-1000}
source scripts/lib/procs.sh
build_kvlease --quiet
PROXY_BIN=${PROXY_BIN:-$BIN}
export KVLEASE_TRANSFER_SECRET="instr-$$-$RANDOM"
launch p serve --host 127.0.0.1 --port 0 --prefill-ms-per-token 0 --decode-ms-per-token 0 --engine-id instr-p
launch d serve --host 127.0.0.1 --port 0 --prefill-ms-per-token 0 --decode-ms-per-token 0 --engine-id instr-d
P=$(url_of p "kvlease serve listening on ")
D=$(url_of d "kvlease serve listening on ")
p_hp=${P#http://} d_hp=${D#http://}
out=$WORK/callgrind.out
LAUNCH_BIN=valgrind launch proxy --tool=callgrind --instr-atstart=no --callgrind-out-file="$out" "$PROXY_BIN" proxy \
  --host 127.0.0.1 --port 0 --prefiller-hosts "${p_hp%:*}" --prefiller-ports "${p_hp##*:}" \
  --decoder-hosts "${d_hp%:*}" --decoder-ports "${d_hp##*:}"
for _ in $(seq 600); do grep -q "listening on" "$WORK/proxy.out" 2>/dev/null && break; sleep 0.1; done
PROXY=$(url_of proxy "kvlease proxy listening on ")
load() { "$BIN" load --url "$PROXY" --requests "$1" --concurrency 16 --max-tokens 8 --prompt-words 32 --timeout-secs 60 --max-run-secs 600 ${STREAM:-}; }
load 200 >/dev/null
callgrind_control -i on "${PID[proxy]}" >/dev/null 2>&1
load "$N" >/dev/null
callgrind_control -i off "${PID[proxy]}" >/dev/null 2>&1
callgrind_control -d "${PID[proxy]}" >/dev/null 2>&1
for _ in $(seq 100); do ls "$out".* >/dev/null 2>&1 && break; sleep 0.1; done
total=$(awk '/^totals:/ { print $2; exit }' "$(ls -t "$out".* | head -n 1)")
echo "kvlease proxy ${STREAM:-(not streamed)}: $((total / N)) instructions a request (user space; $N requests at concurrency 16, max_tokens 8)"
