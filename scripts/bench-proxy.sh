#!/usr/bin/env bash
# What disaggregation costs on one machine: requests/s of one engine alone (a) against
# requests/s through the proxy (b: P leg, D leg, KV pull over TCP, lease granted and released),
# both measured in the same run with `kvlease load`, and the ratio b/a. The synthetic model does
# no compute (--prefill-ms-per-token 0 --decode-ms-per-token 0), so this measures the serving
# machinery, not a model. Afterwards P must hold no lease and every lease must be `transferred`.
#
#   scripts/bench-proxy.sh                      # 5000 requests, concurrency 16, max_tokens 8
#   REQUESTS=5000 CONCURRENCY=32 scripts/bench-proxy.sh
#
# Everything listens on free loopback ports and is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

REQUESTS=${REQUESTS:-5000}
CONCURRENCY=${CONCURRENCY:-16}
MAX_TOKENS=${MAX_TOKENS:-8}
PROMPT_WORDS=${PROMPT_WORDS:-32}
WARMUP=${WARMUP:-200}

command -v curl >/dev/null || { echo "error: curl is needed (apt-get install -y curl)" >&2; exit 1; }

echo "== cargo build --release -p kvlease"
source scripts/lib/procs.sh
build_kvlease --quiet

# A shared secret, so kv_transfer_params are signed and checked as in a real cluster.
export KVLEASE_TRANSFER_SECRET="bench-$$-$RANDOM$RANDOM"

# url_of NAME BANNER: the URL in NAME's start-up line.
url_of() {
  local line
  line=$(started_line "$1" "$2") || exit 1
  line=${line#"$2"}
  echo "${line%% *}"
}

ENGINE=(serve --host 127.0.0.1 --port 0 --prefill-ms-per-token 0 --decode-ms-per-token 0)
launch single "${ENGINE[@]}" --engine-id bench-single
launch p "${ENGINE[@]}" --engine-id bench-p
launch d "${ENGINE[@]}" --engine-id bench-d
SINGLE=$(url_of single "kvlease serve listening on ")
P=$(url_of p "kvlease serve listening on ")
D=$(url_of d "kvlease serve listening on ")
p_hp=${P#http://}
d_hp=${D#http://}
launch proxy proxy --host 127.0.0.1 --port 0 \
  --prefiller-hosts "${p_hp%:*}" --prefiller-ports "${p_hp##*:}" \
  --decoder-hosts "${d_hp%:*}" --decoder-ports "${d_hp##*:}"
PROXY=$(url_of proxy "kvlease proxy listening on ")
echo "single engine $SINGLE | P $P | D $D | proxy $PROXY"

# load URL REQUESTS: one `kvlease load` run; prints its summary line.
load() {
  "$BIN" load --url "$1" --requests "$2" --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" \
    --prompt-words "$PROMPT_WORDS" --timeout-secs 30 --max-run-secs 60 || {
    echo "error: requests to $1 failed" >&2
    return 1
  }
}
rps_of() { sed -n 's/.* rps=\([0-9.]*\).*/\1/p' <<<"$1"; }

echo "== warm-up: $WARMUP requests each"
load "$SINGLE" "$WARMUP" >/dev/null
load "$PROXY" "$WARMUP" >/dev/null

echo "== $REQUESTS requests, concurrency $CONCURRENCY, max_tokens $MAX_TOKENS, $PROMPT_WORDS-word prompts"
A=$(load "$SINGLE" "$REQUESTS")
echo "(a) single engine:     $A"
B=$(load "$PROXY" "$REQUESTS")
echo "(b) proxy P -> D:      $B"
RPS_A=$(rps_of "$A")
RPS_B=$(rps_of "$B")
awk -v a="$RPS_A" -v b="$RPS_B" 'BEGIN { printf "rps direct=%s  rps via proxy=%s  ratio b/a=%.3f\n", a, b, (a > 0 ? b / a : 0) }'

# metric URL NAME: the value of one sample of P's /metrics.
metric() { curl -sf --noproxy '*' --max-time 5 "$1/metrics" | awk -v n="$2" '$1 == n { print $2 }'; }

echo "== P's leases after the run"
active=
for _ in $(seq 100); do
  active=$(metric "$P" kvlease_leases_active)
  [[ $active == 0 ]] && break
  sleep 0.05
done
granted=$(metric "$P" kvlease_leases_granted_total)
transferred=$(metric "$P" 'kvlease_leases_released_total{reason="transferred"}')
expired=$(metric "$P" 'kvlease_leases_released_total{reason="expired"}')
echo "kvlease_leases_active $active"
echo "kvlease_leases_granted_total $granted"
echo "kvlease_leases_released_total{reason=\"transferred\"} $transferred"
echo "kvlease_leases_released_total{reason=\"expired\"} $expired"
if [[ $active != 0 ]]; then
  echo "FAIL: P still holds $active leases" >&2
  exit 1
fi
if [[ $transferred != "$granted" ]]; then
  echo "FAIL: $granted leases granted but only $transferred released as transferred" >&2
  exit 1
fi
echo "OK: every lease was released as transferred"
