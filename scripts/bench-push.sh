#!/usr/bin/env bash
# Push against pull through P/D (issue #24): time to first token, in the same run, as a ratio.
#
# For each case in CASES (default: zero, prefill, large) this starts two clusters side by side,
# each a P, a D and a proxy in front of them. zero: no compute; prefill: --prefill-ms-per-token
# $PREFILL_MS; large: the same prefill compute with a model whose KV is large ($LARGE_FLAGS: 16
# layers, 8 KV heads of 128, 1 MiB blocks, about 16 MiB of KV per request), where the transfer
# is a real share of the time to first token. The clusters:
#
#   pull: engines with the default connector, `proxy --transfer-mode pull` (P leg, then D leg;
#         D reads the KV from P after P answered);
#   push: engines with `{"kv_connector":"NixlPushConnector","kv_role":"kv_both"}`, `proxy
#         --transfer-mode learn` (the default: the first request goes one leg after the other,
#         the proxy learns from P's answer that P pushes, and from then on it sends both legs at
#         once, so D registers its blocks while P prefills and P writes the moment it is done).
#
# Then, for concurrency 1 and 16: a warm-up on both clusters (which also makes the push proxy
# learn), and ROUNDS rounds of `kvlease load --stream --json`, pull then push (ABAB...), on
# PROMPT_WORDS-word prompts (62 words: about 256 prompt tokens on the synthetic model). It prints
# one line per run and a table: TTFT p50/p90 and end-to-end latency p50 for pull and push (mean
# over the rounds) and push/pull, plus P's mean lease hold (grant to release, from
# kvlease_lease_hold_seconds) in each mode: in pull mode it is what the legs' sequencing costs
# after prefill (P's answer through the proxy, D's leg, the handshake, the read, the release).
#
# For scale, each zero-compute concurrency-1 round also runs the same load straight against one
# engine (the pull cluster's D, a plain local request: one HTTP round trip to an engine and its
# zero-time steps, no proxy and no P/D), printed as "direct"; and P's lease hold in push mode is
# what is left of the transfer after the grant (the writes early writes did not carry, usually
# none, and the completion).
#
# Afterwards every P must hold no lease and have released every lease as `transferred`, no D may
# have recomputed a request, and the push proxy must have sent every request but the first both
# legs at once (kvlease_proxy_push_dispatches).
#
#   scripts/bench-push.sh                                  # builds the release binary first
#   KVLEASE_BIN=target/debug/kvlease scripts/bench-push.sh # a binary built already, no cargo
#   REQ_C1=20 REQ_C16=20 WARMUP=5 ROUNDS=1 scripts/bench-push.sh   # a smoke run
#
# The defaults take about 15 minutes on 2 cores, most of it at concurrency 16 with prefill compute
# (P is the bottleneck there: about 7 requests/s at 0.5 ms/token and 256 tokens).
# Everything listens on free loopback ports and is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-2}
read -r -a CASES <<<"${CASES:-zero prefill large}"
LARGE_FLAGS=${LARGE_FLAGS:---num-layers 16 --num-kv-heads 8 --head-dim 128 --num-gpu-blocks 512}
PREFILL_MS=${PREFILL_MS:-0.5}
PROMPT_WORDS=${PROMPT_WORDS:-62}
MAX_TOKENS=${MAX_TOKENS:-8}
REQ_C1=${REQ_C1:-300}
REQ_C16=${REQ_C16:-1000}
WARMUP=${WARMUP:-50}

for tool in curl jq python3; do
  command -v "$tool" >/dev/null || { echo "error: $tool is needed" >&2; exit 1; }
done

source scripts/lib/procs.sh
if [[ -z ${KVLEASE_BIN:-} ]]; then echo "== cargo build --release -p kvlease"; fi
build_kvlease --quiet

# A shared secret, so kv_transfer_params are signed and checked as in a real cluster.
export KVLEASE_TRANSFER_SECRET="bench-$$-$RANDOM$RANDOM"
PUSH_CONFIG='{"kv_connector":"NixlPushConnector","kv_role":"kv_both"}'

# cluster NAME MODE PREFILL_MS [ENGINE FLAGS...]: P, D and a proxy; sets P_NAME, D_NAME, PROXY_NAME.
cluster() {
  local name=$1 mode=$2 engine=(serve --host 127.0.0.1 --port 0 --prefill-ms-per-token "$3" --decode-ms-per-token 0 "${@:4}")
  [[ $mode == push ]] && engine+=(--kv-transfer-config "$PUSH_CONFIG")
  launch "p_$name" "${engine[@]}" --engine-id "bench-p-$name"
  launch "d_$name" "${engine[@]}" --engine-id "bench-d-$name"
  local p d
  p=$(url_of "p_$name" "kvlease serve listening on ")
  d=$(url_of "d_$name" "kvlease serve listening on ")
  local p_hp=${p#http://} d_hp=${d#http://}
  launch "proxy_$name" proxy --host 127.0.0.1 --port 0 \
    --transfer-mode "$([[ $mode == push ]] && echo learn || echo pull)" \
    --prefiller-hosts "${p_hp%:*}" --prefiller-ports "${p_hp##*:}" \
    --decoder-hosts "${d_hp%:*}" --decoder-ports "${d_hp##*:}"
  printf -v "P_$name" %s "$p"
  printf -v "D_$name" %s "$d"
  printf -v "PROXY_$name" %s "$(url_of "proxy_$name" "kvlease proxy listening on ")"
  echo "$name ($mode, prefill $3 ms/token): P $p | D $d | proxy $(eval echo "\$PROXY_$name")"
}

# load URL REQUESTS CONCURRENCY: one streamed `kvlease load` run; prints its JSON summary.
load() {
  local out
  out=$("$BIN" load --url "$1" --requests "$2" --concurrency "$3" --max-tokens "$MAX_TOKENS" \
    --prompt-words "$PROMPT_WORDS" --stream --json --timeout-secs 60 --max-run-secs 900) || {
    echo "error: requests to $1 failed" >&2
    return 1
  }
  tail -n 1 <<<"$out"
}

# The machine's load, at the start and the end: the ratios are comparable within one run only.
echo "== start: $(uptime)"
trap 'echo "== end: $(uptime)"; stop_all' EXIT

declare -A CASE_MS=([zero]=0 [prefill]=$PREFILL_MS [large]=$PREFILL_MS)
declare -A CASE_FLAGS=([zero]= [prefill]= [large]=$LARGE_FLAGS)
for c in "${CASES[@]}"; do
  read -r -a flags <<<"${CASE_FLAGS[$c]}"
  cluster "${c}_pull" pull "${CASE_MS[$c]}" "${flags[@]}"
  cluster "${c}_push" push "${CASE_MS[$c]}" "${flags[@]}"
done

RUNS=$WORK/runs.jsonl
: >"$RUNS"

# measure CASE MODE CONCURRENCY REQUESTS ROUND: one run, its line, and a JSON record in $RUNS.
# MODE direct: the load goes straight to the pull cluster's D (a local request, no P/D).
measure() {
  local name=$1_$2 p proxy
  if [[ $2 == direct ]]; then
    name=$1_pull
    p=$(eval echo "\$P_$name")
    proxy=$(eval echo "\$D_$name")
  else
    p=$(eval echo "\$P_$name")
    proxy=$(eval echo "\$PROXY_$name")
  fi
  local s0 n0 s1 n1 tok0 tok1 r0 rn0 r1 rn1 json d
  d=$(eval echo "\$D_$name")
  s0=$(metric "$p" kvlease_lease_hold_seconds_sum)
  n0=$(metric "$p" kvlease_lease_hold_seconds_count)
  tok0=$(metric "$p" kvlease_prefill_tokens_total)
  r0=$(metric "$d" kvlease_read_seconds_sum)
  rn0=$(metric "$d" kvlease_read_seconds_count)
  json=$(load "$proxy" "$4" "$3")
  s1=$(metric "$p" kvlease_lease_hold_seconds_sum)
  n1=$(metric "$p" kvlease_lease_hold_seconds_count)
  tok1=$(metric "$p" kvlease_prefill_tokens_total)
  r1=$(metric "$d" kvlease_read_seconds_sum)
  rn1=$(metric "$d" kvlease_read_seconds_count)
  jq -c --arg case "$1" --arg mode "$2" --argjson c "$3" --argjson round "$5" \
    --argjson hold_s "$(awk -v a="$s0" -v b="$s1" 'BEGIN { print b - a }')" \
    --argjson holds "$((n1 - n0))" --argjson tokens "$((tok1 - tok0))" \
    --argjson read_s "$(awk -v a="$r0" -v b="$r1" 'BEGIN { print b - a }')" \
    --argjson reads "$((rn1 - rn0))" \
    '{case: $case, mode: $mode, c: $c, round: $round, hold_s: $hold_s, holds: $holds,
      tokens: $tokens, read_s: $read_s, reads: $reads} + .' <<<"$json" >>"$RUNS"
  jq -r 'def r2: . * 100 | floor / 100;
    "  \(.case) c=\(.c) round \(.round) \(.mode): ok=\(.ok)/\(.requests) rps=\(.rps | floor)"
    + " ttft p50=\(.ttft_p50_ms | r2)ms p90=\(.ttft_p90_ms | r2)ms latency p50=\(.p50_ms | r2)ms"
    + " lease hold mean=\(if .holds > 0 then (.hold_s * 1000 / .holds | r2) else "-" end)ms"
    + " prompt tokens/request=\(.tokens / .ok | floor)"' <<<"$(tail -n 1 "$RUNS")"
  [[ $(jq -r '.failed' <<<"$json") == 0 ]] || { echo "FAIL: failed requests in that run" >&2; exit 1; }
}

for c in "${CASES[@]}"; do
  for conc in 1 16; do
    n=$([[ $conc == 1 ]] && echo "$REQ_C1" || echo "$REQ_C16")
    echo "== $c (prefill ${CASE_MS[$c]} ms/token), concurrency $conc: warm-up $WARMUP each, then $ROUNDS rounds of $n requests, pull then push"
    load "$(eval echo "\$PROXY_${c}_pull")" "$WARMUP" "$conc" >/dev/null
    load "$(eval echo "\$PROXY_${c}_push")" "$WARMUP" "$conc" >/dev/null
    for round in $(seq "$ROUNDS"); do
      measure "$c" pull "$conc" "$n" "$round"
      measure "$c" push "$conc" "$n" "$round"
      if [[ $c == zero && $conc == 1 ]]; then measure "$c" direct "$conc" "$n" "$round"; fi
    done
  done
done

echo "== push / pull, TTFT and latency in ms, mean of $ROUNDS rounds (streamed, max_tokens $MAX_TOKENS, $PROMPT_WORDS-word prompts)"
python3 - "$RUNS" "$PREFILL_MS" <<'PY'
import json, sys
from collections import defaultdict
runs = [json.loads(l) for l in open(sys.argv[1])]
cells = defaultdict(list)
for r in runs:
    cells[(r["case"], r["c"], r["mode"])].append(r)
mean = lambda xs: sum(xs) / len(xs)
label = {"zero": "zero compute", "prefill": f"prefill {sys.argv[2]} ms/token",
         "large": f"prefill {sys.argv[2]} ms/token, 16 MiB KV"}
print("| compute | c | TTFT p50 pull | TTFT p50 push | push/pull | TTFT p90 pull | TTFT p90 push | push/pull "
      "| latency p50 pull | latency p50 push | push/pull | pull − push TTFT p50 | P lease hold pull / push "
      "| push ahead by pull's hold? | pull's read + one HTTP round trip | push ahead by that? |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
direct = cells.get(("zero", 1, "direct"))
rtt = mean([r["ttft_p50_ms"] for r in direct]) if direct else None
for case in ("zero", "prefill", "large"):
    for c in (1, 16):
        pull, push = cells.get((case, c, "pull")), cells.get((case, c, "push"))
        if not pull or not push:
            continue
        row = [label[case], str(c)]
        for key in ("ttft_p50_ms", "ttft_p90_ms", "p50_ms"):
            a, b = mean([r[key] for r in pull]), mean([r[key] for r in push])
            rounds = "; ".join(f"{y[key] / x[key]:.2f}" for x, y in zip(pull, push))
            row += [f"{a:.2f}", f"{b:.2f}", f"**{b / a:.2f}** ({rounds})"]
        row.append(f"{mean([r['ttft_p50_ms'] for r in pull]) - mean([r['ttft_p50_ms'] for r in push]):+.2f}")
        hold = lambda rs: sum(r["hold_s"] for r in rs) * 1000 / max(1, sum(r["holds"] for r in rs))
        row.append(f"{hold(pull):.2f} / {hold(push):.2f}")
        # Pull's lease hold is what comes after its prefill: P's answer through the proxy, D's
        # leg (one HTTP round trip) and the read (the P→D transfer), up to D's release.
        ahead = mean([r['ttft_p50_ms'] for r in pull]) - mean([r['ttft_p50_ms'] for r in push])
        row.append("yes" if ahead >= hold(pull) else "no")
        # The issue's criterion read literally: the P→D transfer (pull's D's reads, posted to
        # landed, kvlease_read_seconds) plus one HTTP round trip (the direct request's TTFT).
        reads = sum(r.get("reads", 0) for r in pull)
        if reads and rtt is not None:
            bar = sum(r["read_s"] for r in pull) * 1000 / reads + rtt
            row += [f"{bar:.2f}", "yes" if ahead >= bar else "no"]
        else:
            row += ["-", "-"]
        print("| " + " | ".join(row) + " |")
print("(push/pull: of the means; in brackets, each round's own ratio. Pull's P lease hold is what its")
print(" legs' sequencing costs after the prefill: P's answer through the proxy, D's leg, the P→D read)")
if direct:
    print("direct to one engine, zero compute, c=1 (one HTTP round trip and the engine's steps): TTFT p50 "
          + "; ".join(f"{r['ttft_p50_ms']:.2f}" for r in direct) + " ms (per round)")
PY

echo "== after the runs: leases on P, recomputes on D, dispatches of the push proxies"
status=0
for c in "${CASES[@]}"; do
  for mode in pull push; do
    name=${c}_$mode
    p=$(eval echo "\$P_$name")
    d=$(eval echo "\$D_$name")
    proxy=$(eval echo "\$PROXY_$name")
    active=
    for _ in $(seq 100); do
      active=$(metric "$p" kvlease_leases_active)
      [[ $active == 0 ]] && break
      sleep 0.05
    done
    granted=$(metric "$p" kvlease_leases_granted_total)
    transferred=$(metric "$p" 'kvlease_leases_released_total{reason="transferred"}')
    expired=$(metric "$p" 'kvlease_leases_released_total{reason="expired"}')
    recomputed=$(metric "$d" kvlease_recomputed_requests_total)
    dispatches=$(metric "$proxy" kvlease_proxy_push_dispatches_total)
    early=$(metric "$p" kvlease_push_early_blocks_total)
    echo "$name: P kvlease_leases_active $active, granted $granted, released transferred $transferred, expired $expired, blocks written early ${early:-0} | D recomputed $recomputed | proxy push dispatches ${dispatches:-?}"
    if [[ $active != 0 ]]; then echo "FAIL: $name's P still holds $active leases" >&2; status=1; fi
    if [[ $transferred != "$granted" ]]; then
      echo "FAIL: $name's P granted $granted leases but released $transferred as transferred" >&2
      status=1
    fi
    if [[ $recomputed != 0 ]]; then echo "FAIL: $name's D recomputed $recomputed requests" >&2; status=1; fi
    if [[ $mode == push && $dispatches != $((granted - 1)) ]]; then
      echo "FAIL: $name's proxy sent $dispatches of $granted requests both legs at once (expected all but the first)" >&2
      status=1
    fi
  done
done
((status == 0)) && echo "OK: no lease left on any P, every lease transferred, nothing recomputed, push dispatched at once"
exit "$status"
