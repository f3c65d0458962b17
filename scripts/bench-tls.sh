#!/usr/bin/env bash
# What certificates cost requests through the proxy (issue #26, SPEC S6), next to plain, in the
# same run, as ratios. Two clusters side by side on loopback, each a P, a D and a proxy in front
# of them, zero compute, the tcp agent, the cluster secret in both:
#
#   plain: HTTP everywhere, no certificates;
#   certs: the same plus HTTPS on P, D and the proxy (--ssl-certfile/--ssl-keyfile; P and D with
#          --ssl-cert-reqs 2, so the proxy presents its certificate to them and checks theirs
#          against --ssl-ca-certs) and per-engine transfer certificates (--kv-transfer-tls-*,
#          the engine id as URI SAN kvlease://engine/<id>): the side channel and the tcp agent
#          run mutual TLS. The load generator reaches the proxy over HTTPS (`load --cacert`).
#
# The CA and every certificate are made at start with openssl (EC P-256, as the README shows).
# Then, for {not streamed, streamed} x {concurrency 1, 16}: a warm-up on both clusters, and ROUNDS
# rounds of `kvlease load --json`, plain then certs (ABAB...), max_tokens MAX_TOKENS on
# PROMPT_WORDS-word prompts (32 words: about 110 tokens, a 56 KiB pull). Each run: requests/s,
# latency p50/p99, and the CPU each process spent per request (utime + stime from /proc, so the
# resolution is one tick, 10 ms, over the run). Then a table: plain, certs, and certs / plain
# (of the means over the rounds; each round's own ratio in brackets).
#
# Afterwards every P must hold no lease and have released every lease as `transferred`, and no D
# may have recomputed a request, in both clusters.
#
#   scripts/bench-tls.sh                                   # builds the release binary first
#   KVLEASE_BIN=target/release/kvlease scripts/bench-tls.sh   # a binary built already, no cargo
#   REQ_C1=50 REQ_C16=200 WARMUP=20 ROUNDS=1 scripts/bench-tls.sh   # a smoke run
#   PERF_DIR=/tmp/p scripts/bench-tls.sh   # also one more concurrency-16 run per cluster under
#                                          # `perf record` of its P, D and proxy (perf.data files
#                                          # left in PERF_DIR, a summary printed)
#
# The defaults take about 2 minutes on 2 cores (3 with PERF_DIR). Everything listens on free
# loopback ports and is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
MAX_TOKENS=${MAX_TOKENS:-8}
PROMPT_WORDS=${PROMPT_WORDS:-32}
REQ_C1=${REQ_C1:-1500}
REQ_C16=${REQ_C16:-4000}
WARMUP=${WARMUP:-200}
PERF_DIR=${PERF_DIR:-}

for tool in curl jq openssl python3; do
  command -v "$tool" >/dev/null || { echo "error: $tool is needed" >&2; exit 1; }
done
if [[ -n $PERF_DIR ]]; then command -v perf >/dev/null || { echo "error: PERF_DIR needs perf" >&2; exit 1; }; fi

source scripts/lib/procs.sh
if [[ -z ${KVLEASE_BIN:-} ]]; then echo "== cargo build --release -p kvlease"; fi
build_kvlease --quiet

# A shared secret in both clusters, so kv_transfer_params are signed and checked as in a real one.
export KVLEASE_TRANSFER_SECRET="bench-$$-$RANDOM$RANDOM"

# The PKI, made here: a CA; `http` (localhost and 127.0.0.1, server and client use: P and D
# serve it, the proxy serves it and presents it to them, curl presents it to read their metrics);
# and one transfer certificate per engine, named by its engine id only.
PKI=$WORK/pki
mkdir -p "$PKI"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
  -keyout "$PKI/ca.key" -out "$PKI/ca.pem" -subj "/CN=kvlease bench CA" 2>/dev/null
# leaf NAME EXTENSIONS: NAME.pem and NAME.key, signed by the CA.
leaf() {
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$PKI/$1.key" \
    -out "$PKI/$1.csr" -subj "/CN=$1" 2>/dev/null
  openssl x509 -req -in "$PKI/$1.csr" -CA "$PKI/ca.pem" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 2 -out "$PKI/$1.pem" -extfile <(printf '%b' "$2") 2>/dev/null
}
leaf http 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n'
for id in bench-p-certs bench-d-certs; do
  leaf "$id" "subjectAltName=URI:kvlease://engine/$id\nextendedKeyUsage=serverAuth,clientAuth\n"
done
HTTPS=(--ssl-certfile "$PKI/http.pem" --ssl-keyfile "$PKI/http.key" --ssl-ca-certs "$PKI/ca.pem")
# What curl needs to read a certs engine's /metrics (it asks for a client certificate).
CURL_TLS=(--cacert "$PKI/ca.pem" --cert "$PKI/http.pem" --key "$PKI/http.key")

# cluster NAME: P, D and a proxy; sets P_NAME, D_NAME, PROXY_NAME.
cluster() {
  local name=$1 engine=(serve --host 127.0.0.1 --port 0 --prefill-ms-per-token 0 --decode-ms-per-token 0)
  local proxy_tls=()
  if [[ $name == certs ]]; then
    engine+=("${HTTPS[@]}" --ssl-cert-reqs 2)
    proxy_tls=("${HTTPS[@]}")
  fi
  local role tls
  for role in p d; do
    tls=()
    [[ $name == certs ]] && tls=(--kv-transfer-tls-cert "$PKI/bench-$role-$name.pem"
      --kv-transfer-tls-key "$PKI/bench-$role-$name.key" --kv-transfer-tls-ca "$PKI/ca.pem")
    launch "${role}_$name" "${engine[@]}" "${tls[@]}" --engine-id "bench-$role-$name"
  done
  local p d
  p=$(url_of "p_$name" "kvlease serve listening on ")
  d=$(url_of "d_$name" "kvlease serve listening on ")
  # ${url%:*}: http://host or https://host, as --*-hosts take them.
  launch "proxy_$name" proxy --host 127.0.0.1 --port 0 "${proxy_tls[@]}" \
    --prefiller-hosts "${p%:*}" --prefiller-ports "${p##*:}" \
    --decoder-hosts "${d%:*}" --decoder-ports "${d##*:}"
  printf -v "P_$name" %s "$p"
  printf -v "D_$name" %s "$d"
  printf -v "PROXY_$name" %s "$(url_of "proxy_$name" "kvlease proxy listening on ")"
  echo "$name: P $p | D $d | proxy $(eval echo "\$PROXY_$name")"
}
cluster plain
cluster certs

# load NAME REQUESTS CONCURRENCY [--stream]: one `kvlease load` run through NAME's proxy; prints
# its JSON summary.
load() {
  local url cacert=() out
  url=$(eval echo "\$PROXY_$1")
  [[ $1 == certs ]] && cacert=(--cacert "$PKI/ca.pem")
  out=$("$BIN" load --url "$url" "${cacert[@]}" --requests "$2" --concurrency "$3" "${@:4}" \
    --max-tokens "$MAX_TOKENS" --prompt-words "$PROMPT_WORDS" --json --timeout-secs 30 --max-run-secs 600) || {
    echo "error: requests to $1's proxy failed" >&2
    return 1
  }
  tail -n 1 <<<"$out"
}

RUNS=$WORK/runs.jsonl
: >"$RUNS"
HZ=$(getconf CLK_TCK)

# measure NAME CONCURRENCY REQUESTS ROUND [--stream]: one run, its line, and a record in $RUNS.
measure() {
  local name=$1 json
  local p0 d0 x0 p1 d1 x1
  p0=$(cpu_ticks "p_$name"); d0=$(cpu_ticks "d_$name"); x0=$(cpu_ticks "proxy_$name")
  json=$(load "$name" "$3" "$2" "${@:5}")
  p1=$(cpu_ticks "p_$name"); d1=$(cpu_ticks "d_$name"); x1=$(cpu_ticks "proxy_$name")
  jq -c --arg cluster "$name" --argjson c "$2" --argjson round "$4" --argjson stream "$([[ ${5:-} == --stream ]] && echo true || echo false)" \
    --argjson hz "$HZ" --argjson p "$((p1 - p0))" --argjson d "$((d1 - d0))" --argjson x "$((x1 - x0))" \
    '{cluster: $cluster, c: $c, round: $round, stream: $stream,
      cpu_us: {p: ($p * 1e6 / $hz / .ok), d: ($d * 1e6 / $hz / .ok), proxy: ($x * 1e6 / $hz / .ok)}} + .' <<<"$json" >>"$RUNS"
  jq -r 'def r2: . * 100 | round / 100;
    "  c=\(.c) \(if .stream then "streamed" else "not streamed" end) round \(.round) \(.cluster):"
    + " ok=\(.ok)/\(.requests) rps=\(.rps | r2) p50=\(.p50_ms | r2)ms p99=\(.p99_ms | r2)ms"
    + " CPU us/request P \(.cpu_us.p | round) D \(.cpu_us.d | round) proxy \(.cpu_us.proxy | round)"' <<<"$(tail -n 1 "$RUNS")"
  [[ $(jq -r '.failed' <<<"$json") == 0 ]] || { echo "FAIL: failed requests in that run" >&2; exit 1; }
}

echo "== uptime at start: $(uptime)"
for stream in "" --stream; do
  for conc in 1 16; do
    n=$([[ $conc == 1 ]] && echo "$REQ_C1" || echo "$REQ_C16")
    echo "== ${stream:-not streamed}, concurrency $conc: warm-up $WARMUP each, then $ROUNDS rounds of $n requests, plain then certs"
    load plain "$WARMUP" "$conc" $stream >/dev/null
    load certs "$WARMUP" "$conc" $stream >/dev/null
    for round in $(seq "$ROUNDS"); do
      measure plain "$conc" "$n" "$round" $stream
      measure certs "$conc" "$n" "$round" $stream
    done
  done
done
echo "== uptime at end: $(uptime)"

echo "== certs / plain, mean of $ROUNDS rounds (zero compute, max_tokens $MAX_TOKENS, $PROMPT_WORDS-word prompts)"
python3 - "$RUNS" <<'PY'
import json, sys
from collections import defaultdict
runs = [json.loads(l) for l in open(sys.argv[1])]
cells = defaultdict(list)
for r in runs:
    cells[(r["stream"], r["c"], r["cluster"])].append(r)
mean = lambda xs: sum(xs) / len(xs)
figures = [
    ("requests/s", lambda r: r["rps"], "{:.0f}"),
    ("p50 ms", lambda r: r["p50_ms"], "{:.2f}"),
    ("p99 ms", lambda r: r["p99_ms"], "{:.2f}"),
    ("CPU µs/req P", lambda r: r["cpu_us"]["p"], "{:.0f}"),
    ("CPU µs/req D", lambda r: r["cpu_us"]["d"], "{:.0f}"),
    ("CPU µs/req proxy", lambda r: r["cpu_us"]["proxy"], "{:.0f}"),
    ("CPU µs/req P+D+proxy", lambda r: sum(r["cpu_us"].values()), "{:.0f}"),
]
print("| answers | c | figure | plain | certs | **certs ÷ plain** (each round) |")
print("|---|---|---|---|---|---|")
for stream in (False, True):
    for c in (1, 16):
        plain, certs = cells.get((stream, c, "plain")), cells.get((stream, c, "certs"))
        if not plain or not certs:
            continue
        for name, f, fmt in figures:
            a, b = mean([f(r) for r in plain]), mean([f(r) for r in certs])
            rounds = "; ".join(f"{f(y) / f(x):.2f}" if f(x) > 0 else "-" for x, y in zip(plain, certs))
            ratio = f"**{b / a:.2f}**" if a > 0 else "-"
            print(f"| {'streamed' if stream else 'not streamed'} | {c} | {name} | {fmt.format(a)} | {fmt.format(b)} | {ratio} ({rounds}) |")
PY

if [[ -n $PERF_DIR ]]; then
  mkdir -p "$PERF_DIR"
  echo "== perf: one more run of $REQ_C16 requests at concurrency 16, not streamed, per cluster; P + D + proxy sampled at 999 Hz"
  for name in plain certs; do
    perf record -q -F 999 -o "$PERF_DIR/$name.data" \
      -p "${PID[p_$name]},${PID[d_$name]},${PID[proxy_$name]}" -- sleep 1000 2>/dev/null &
    rec=$!
    sleep 1 # perf attaches
    load "$name" "$REQ_C16" 16 >/dev/null
    kill -INT "$rec"
    wait "$rec" || true
    perf report -i "$PERF_DIR/$name.data" --no-children --sort dso,sym -g none --stdio -n --percent-limit 0 \
      2>/dev/null >"$PERF_DIR/$name.txt"
  done
  # Samples at 999 Hz per request = CPU µs per request, by what the symbol is.
  python3 - "$PERF_DIR" "$REQ_C16" <<'PY'
import re, sys
kinds = [
    ("crypto (ring: AES-GCM, SHA, ECDSA/P-256)", r"aes|gcm|ghash|chacha|poly1305|sha256|sha512|p256|nistz|ecdsa|ring_core|x25519|limbs|bn_|fiat"),
    ("rustls / tokio-rustls (records, handshakes)", r"rustls|webpki"),
    ("memmove / memcpy (user)", r"memmove|memcpy|memset"),
    ("malloc / free", r"malloc|free|_int_|realloc|unlink_chunk|consolidate"),
]
def per_kind(path):
    got = {}
    for line in open(path):
        m = re.match(r"\s*[0-9.]+%\s+(\d+)\s+(\S+)\s+\[(.)\]\s+(.*)", line)
        if not m:
            continue
        n, dso, mode, sym = int(m[1]), m[2], m[3], m[4]
        kind = "kernel" if mode == "k" else next((k for k, pat in kinds if re.search(pat, sym, re.I)), "the rest (user)")
        got[kind] = got.get(kind, 0) + n
    return got
plain, certs = (per_kind(f"{sys.argv[1]}/{n}.txt") for n in ("plain", "certs"))
us = lambda n: n * 1e6 / 999 / int(sys.argv[2])
print("| CPU µs/request (P + D + proxy, perf samples) | plain | certs | certs − plain |")
print("|---|---|---|---|")
for k in [k for k, _ in kinds] + ["kernel", "the rest (user)"]:
    a, b = us(plain.get(k, 0)), us(certs.get(k, 0))
    print(f"| {k} | {a:.0f} | {b:.0f} | {b - a:+.0f} |")
a, b = us(sum(plain.values())), us(sum(certs.values()))
print(f"| all | {a:.0f} | {b:.0f} | {b - a:+.0f} |")
PY
fi

echo "== after the runs: leases on P, recomputes on D"
status=0
for name in plain certs; do
  p=$(eval echo "\$P_$name")
  d=$(eval echo "\$D_$name")
  tls=()
  [[ $name == certs ]] && tls=("${CURL_TLS[@]}")
  active=
  for _ in $(seq 100); do
    active=$(metric "$p" kvlease_leases_active "${tls[@]}")
    [[ $active == 0 ]] && break
    sleep 0.05
  done
  granted=$(metric "$p" kvlease_leases_granted_total "${tls[@]}")
  transferred=$(metric "$p" 'kvlease_leases_released_total{reason="transferred"}' "${tls[@]}")
  recomputed=$(metric "$d" kvlease_recomputed_requests_total "${tls[@]}")
  echo "$name: P kvlease_leases_active $active, granted $granted, released transferred $transferred | D recomputed $recomputed"
  if [[ $active != 0 ]]; then echo "FAIL: $name's P still holds $active leases" >&2; status=1; fi
  if [[ -z $granted || $transferred != "$granted" ]]; then
    echo "FAIL: $name's P granted ${granted:-?} leases but released ${transferred:-?} as transferred" >&2
    status=1
  fi
  if [[ $recomputed != 0 ]]; then echo "FAIL: $name's D recomputed $recomputed requests" >&2; status=1; fi
done
((status == 0)) && echo "OK: no lease left on any P, every lease transferred, nothing recomputed, in both clusters"
exit "$status"
