#!/usr/bin/env bash
# The kvlease demo: a prefill engine P, a decode engine D and the proxy on loopback (and a local
# engine that checks every answer). First a short walk-through of one request's lease by hand,
# then three acts under load, with a live line per second: normal load; an overload burst on D,
# requests queued far longer than the lease, which heartbeats keep alive; D killed, and P taking
# its blocks back by itself. A summary table and a chart (SVG) at the end. About two minutes
# after the build; stops everything on exit.
#
#   bash scripts/demo.sh
#   P_PORT=9100 D_PORT=9200 PROXY_PORT=9000 LOCAL_PORT=9300 bash scripts/demo.sh   # other ports
#   DEMO_OUT=/tmp/demo bash scripts/demo.sh     # where the chart and CSV go (default target/demo)
set -euo pipefail
cd "$(dirname "$0")/.."

P_PORT=${P_PORT:-8100}
D_PORT=${D_PORT:-8200}
PROXY_PORT=${PROXY_PORT:-8000}
LOCAL_PORT=${LOCAL_PORT:-8300}
DEMO_OUT=${DEMO_OUT:-target/demo}
LEASE_SECS=6
MODEL=kvlease-synthetic

if [[ -t 1 ]]; then
  say() { printf '\n\033[1m## %s\033[0m\n' "$*"; }
else
  say() { printf '\n## %s\n' "$*"; }
fi
run() { printf '$ %s\n' "$*"; }
die() { echo "error: $*" >&2; exit 1; }

if ! command -v curl >/dev/null; then
  if command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
    echo "curl is missing: installing it with apt-get"
    apt-get update -qq && apt-get install -y -qq curl >/dev/null
  else
    die "this demo needs curl (e.g. sudo apt-get install -y curl)"
  fi
fi
command -v cargo >/dev/null || die "this demo needs cargo (https://rustup.rs)"
command -v python3 >/dev/null || die "this demo needs python3 (e.g. sudo apt-get install -y python3)"

for port in "$P_PORT" "$D_PORT" "$PROXY_PORT" "$LOCAL_PORT"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    die "port $port on 127.0.0.1 is taken; choose others, e.g. P_PORT=9100 D_PORT=9200 PROXY_PORT=9000 LOCAL_PORT=9300 bash scripts/demo.sh"
  fi
done

say "Building kvlease (cargo build --release -p kvlease)"
ON_STOP='echo; echo "Stopped P, D and the proxy."'
source scripts/lib/procs.sh
build_kvlease

# P and D share a secret: P signs the kv_transfer_params it hands out, D refuses altered ones.
export KVLEASE_TRANSFER_SECRET="demo-secret-$$-$RANDOM$RANDOM"
CONFIG='{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"kv_lease_duration":'$LEASE_SECS'}}'

# start NAME BANNER ARGS...: runs `kvlease ARGS...` in the background and waits for its start-up line.
start() {
  local name=$1 banner=$2 line
  shift 2
  launch "$name" "$@"
  line=$(started_line "$name" "$banner") || exit 1
  echo "  $line"
}

P=http://127.0.0.1:$P_PORT
D=http://127.0.0.1:$D_PORT
PROXY=http://127.0.0.1:$PROXY_PORT

say "Starting P (prefill, :$P_PORT), D (decode, :$D_PORT), the proxy (:$PROXY_PORT) and a local engine (:$LOCAL_PORT)"
echo "  kv-transfer-config: $CONFIG"
echo "  D decodes 2 requests at a time, 25 ms per token, as a small GPU would"
start P "kvlease serve listening on " serve --port "$P_PORT" --engine-id demo-prefill --kv-transfer-config "$CONFIG"
start D "kvlease serve listening on " serve --port "$D_PORT" --engine-id demo-decode --kv-transfer-config "$CONFIG" \
  --max-num-seqs 2 --decode-ms-per-token 25
start local "kvlease serve listening on " serve --port "$LOCAL_PORT" --engine-id demo-local
start proxy "kvlease proxy listening on " proxy --host 127.0.0.1 --port "$PROXY_PORT" \
  --prefiller-hosts 127.0.0.1 --prefiller-ports "$P_PORT" --decoder-hosts 127.0.0.1 --decoder-ports "$D_PORT"

# post URL JSON: POSTs the JSON body, prints the answer; fails on an HTTP error.
post() { curl -sS --noproxy '*' --max-time 30 --fail-with-body -H 'Content-Type: application/json' -d "$2" "$1"; }
# field NAME: the first string value of NAME in the JSON on stdin (values without quotes only).
field() { grep -o "\"$1\":\"[^\"]*\"" | head -n 1 | sed "s/^\"$1\":\"//; s/\"\$//"; }
# metrics: P's lease metrics.
metrics() {
  curl -sS --noproxy '*' --max-time 5 "$P/metrics" |
    grep -E '^kvlease_(leases_active|leased_blocks|leases_granted_total|leases_released_total)' | sed 's/^/  /'
}

say "1. A completion through the proxy: P prefills, D pulls the KV blocks and decodes"
BODY='{"model":"'$MODEL'","prompt":"Why do prefill engines lease their KV cache?","max_tokens":12,"ignore_eos":true}'
run "curl $PROXY/v1/completions -d '$BODY'"
ANSWER=$(post "$PROXY/v1/completions" "$BODY")
echo "  text: \"$(field text <<<"$ANSWER")\""
echo "  (the model is synthetic: deterministic words, no GPU needed)"

say "2. A streamed chat through the proxy"
BODY='{"model":"'$MODEL'","messages":[{"role":"user","content":"Tell me about leases."}],"max_tokens":8,"stream":true}'
run "curl -N $PROXY/v1/chat/completions -d '$BODY'"
STREAM=$(post "$PROXY/v1/chat/completions" "$BODY")
echo "  $(grep -c '^data: ' <<<"$STREAM") SSE events, the last one: $(grep '^data: ' <<<"$STREAM" | tail -n 1)"
CONTENT=$(grep -o '"content":"[^"]*"' <<<"$STREAM" | sed 's/^"content":"//; s/"$//' | tr -d '\n')
echo "  assembled content: \"$CONTENT\""

say "3. P's leases so far: one granted per request, released as soon as D had read the blocks"
metrics

say "4. The proxy's first leg by hand: ask P to prefill for a remote decoder"
BODY='{"model":"'$MODEL'","prompt":"A prompt whose KV cache waits for a decoder","max_tokens":1,"kv_transfer_params":{"do_remote_decode":true}}'
run "curl $P/v1/completions -d '$BODY'"
LEG=$(post "$P/v1/completions" "$BODY")
PARAMS=$(grep -o '"kv_transfer_params":{[^}]*}' <<<"$LEG" | sed 's/^"kv_transfer_params"://')
echo "  P answers with the kv_transfer_params a decoder needs to pull the blocks (signed):"
sed 's/,"/,\n    "/g; s/^{/  {\n    /; s/}$/\n  }/' <<<"$PARAMS"
echo "  P now pins those blocks under lease $(grep -o '"remote_lease_id":[0-9]*' <<<"$PARAMS" | cut -d: -f2) for $LEASE_SECS s:"
metrics

say "5. The second leg by hand: give those kv_transfer_params to D, as the proxy would"
BODY='{"model":"'$MODEL'","prompt":"A prompt whose KV cache waits for a decoder","max_tokens":8,"ignore_eos":true,"kv_transfer_params":'$PARAMS'}'
run "curl $D/v1/completions -d '{..., \"kv_transfer_params\": <P's answer>}'"
echo "  text: \"$(post "$D/v1/completions" "$BODY" | field text)\""
echo "  D read the blocks, so P released the lease at once (transferred):"
metrics

say "6. Three acts under load (L = $LEASE_SECS s, heartbeats every $((LEASE_SECS / 6)) s)"
echo "  1. normal load: 2 clients through the proxy"
echo "  2. an overload burst: 40 clients, D's queue holds requests far longer than L; D's"
echo "     heartbeats keep every lease alive (expired stays flat)"
echo "  3. D killed (SIGKILL) with its queue full: nobody heartbeats, P takes its blocks back"
echo "  Every answer is checked against the local engine running the same request alone."
echo
python3 scripts/lib/demo_acts.py --proxy "$PROXY" --p "$P" --local "http://127.0.0.1:$LOCAL_PORT" \
  --d-pid "${PID[D]}" --lease "$LEASE_SECS" --out "$DEMO_OUT" || die "the acts did not go as they should"

say "Done"
echo "  A decoder that is alive but slow keeps its leases by heartbeating (every L/6, +2L/3 each);"
echo "  when a decoder dies, P gets the blocks back 2L/3 after its last heartbeat (L after a grant"
echo "  it never renewed). Open $DEMO_OUT/kvlease-demo.svg to see it. More: README.md, and SPEC.md."
