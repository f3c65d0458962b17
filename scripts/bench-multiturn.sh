#!/usr/bin/env bash
# Multi-turn (SPEC B1-B4), measured on real processes in one run:
#
# (1) Time to first token of each turn of a 4-turn conversation with a long history, with the
#     history read back from the decoder (bidirectional_kv_xfer, B4) against recomputing it. Two
#     clusters (P, D, proxy) identical but for kv_recompute_threshold: the default 64 (read)
#     and 10^9 (P never reads, so it prefills the whole history every turn). Prefill costs
#     --prefill-ms-per-token on both (0.1 ms: 10k tokens/s, a mid-size model on one GPU).
#     Conversations alternate between the clusters; the table gives each turn's median. Both
#     clusters must answer every turn alike (D7). PARALLEL=N runs N conversations at once
#     (default 1: one after the other).
# (2) KV blocks a decoder holds for abandoned conversations over time: conversations stop after
#     two turns, the decoder keeps each last turn until its decoder_kv_blocks_ttl. Two
#     decoders side by side, same workload: TTL 20 s (safe with kvlease, because a next turn
#     waiting on a busy P renews the turn, B3: the TTL needs to cover only the client's pause)
#     against vLLM's fixed 480 s (which must also cover any wait in P's queue). Sampled every
#     5 s for SAMPLE_SECS.
#
# Every engine gets NUM_GPU_BLOCKS KV blocks (8192): with 4096, the ten conversations' last turns
# (about 390 blocks each) fill the decoders' pools, so the decoders evict cached turns (SPEC B1,
# kvlease_turns_evicted_total) to serve the next conversations.
#
#   scripts/bench-multiturn.sh
#   CONVERSATIONS=10 USER_WORDS=1500 PREFILL_MS=0.1 SAMPLE_SECS=60 NUM_GPU_BLOCKS=4096 scripts/bench-multiturn.sh
#
# Everything listens on free loopback ports and is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

CONVERSATIONS=${CONVERSATIONS:-10}
TURNS=${TURNS:-4}
USER_WORDS=${USER_WORDS:-1500}
MAX_TOKENS=${MAX_TOKENS:-64}
PREFILL_MS=${PREFILL_MS:-0.1}
ABANDONED=${ABANDONED:-20}
SHORT_TTL=${SHORT_TTL:-20}
SAMPLE_SECS=${SAMPLE_SECS:-60}
NUM_GPU_BLOCKS=${NUM_GPU_BLOCKS:-8192}
PARALLEL=${PARALLEL:-1}

command -v python3 >/dev/null || { echo "error: python3 is needed" >&2; exit 1; }
command -v curl >/dev/null || { echo "error: curl is needed (apt-get install -y curl)" >&2; exit 1; }

echo "== cargo build --release -p kvlease"
source scripts/lib/procs.sh
build_kvlease --quiet
export KVLEASE_TRANSFER_SECRET="bench-$$-$RANDOM$RANDOM"
DRIVER=(python3 scripts/lib/multiturn.py)

config() { # TTL THRESHOLD
  echo "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"bidirectional_kv_xfer\":true,\"decoder_kv_blocks_ttl\":$1,\"kv_recompute_threshold\":$2}}"
}
ENGINE=(serve --host 127.0.0.1 --port 0 --max-model-len 16384 --num-gpu-blocks "$NUM_GPU_BLOCKS" --decode-ms-per-token 0)
# cluster NAME TTL THRESHOLD: P, D and a proxy; sets NAME_P, NAME_D, NAME_PROXY.
cluster() {
  local name=$1 cfg p d p_hp d_hp
  cfg=$(config "$2" "$3")
  launch "$name-p" "${ENGINE[@]}" --prefill-ms-per-token "$PREFILL_MS" --engine-id "$name-p" --kv-transfer-config "$cfg"
  launch "$name-d" "${ENGINE[@]}" --prefill-ms-per-token "$PREFILL_MS" --engine-id "$name-d" --kv-transfer-config "$cfg"
  p=$(url_of "$name-p" "kvlease serve listening on ")
  d=$(url_of "$name-d" "kvlease serve listening on ")
  p_hp=${p#http://}
  d_hp=${d#http://}
  launch "$name-proxy" proxy --host 127.0.0.1 --port 0 \
    --prefiller-hosts "${p_hp%:*}" --prefiller-ports "${p_hp##*:}" --decoder-hosts "${d_hp%:*}" --decoder-ports "${d_hp##*:}"
  printf -v "${name}_P" %s "$p"
  printf -v "${name}_D" %s "$d"
  printf -v "${name}_PROXY" %s "$(url_of "$name-proxy" "kvlease proxy listening on ")"
}

echo "== (1) time to first token, history read from D vs recomputed"
cluster read 480 64
cluster recompute 480 1000000000
echo "$CONVERSATIONS conversations x $TURNS turns each side, $USER_WORDS-word user messages, max_tokens $MAX_TOKENS, prefill $PREFILL_MS ms/token, $NUM_GPU_BLOCKS KV blocks an engine, $PARALLEL at once"
MULTITURN_PARALLEL=$PARALLEL "${DRIVER[@]}" ttft "$read_PROXY" "$recompute_PROXY" "$CONVERSATIONS" "$TURNS" "$USER_WORDS" "$MAX_TOKENS"
for side in read recompute; do
  var=${side}_P
  p=${!var}
  var=${side}_D
  d=${!var}
  echo "$side P: turn_tokens_read=$(metric "$p" kvlease_turn_tokens_read_total) prefill_tokens=$(metric "$p" kvlease_prefill_tokens_total) turns_recomputed=$(metric "$p" kvlease_turns_recomputed_total)"
  echo "$side D: turns_kept=$(metric "$d" kvlease_turns_kept_total) turns_evicted=$(metric "$d" kvlease_turns_evicted_total) kv_blocks_free=$(metric "$d" kvlease_kv_blocks_free)"
done

echo "== (2) blocks held on D after $ABANDONED conversations are abandoned after two turns"
cluster short "$SHORT_TTL" 64
cluster fixed 480 64
"${DRIVER[@]}" abandon "$short_PROXY" "$ABANDONED" 200 16 short &
a=$!
"${DRIVER[@]}" abandon "$fixed_PROXY" "$ABANDONED" 200 16 fixed &
b=$!
wait "$a" "$b"
echo "D's KV blocks held (kvlease_kv_blocks_total - kvlease_kv_blocks_free), t from the last answer:"
"${DRIVER[@]}" sample "$SAMPLE_SECS" 5 "ttl_${SHORT_TTL}s=$short_D" "ttl_480s=$fixed_D"
for side in short fixed; do
  var=${side}_D
  d=${!var}
  echo "$side D: turns_kept=$(metric "$d" kvlease_turns_kept_total) transferred=$(metric "$d" 'kvlease_leases_released_total{reason="transferred"}') expired=$(metric "$d" 'kvlease_leases_released_total{reason="expired"}') leases_active=$(metric "$d" kvlease_leases_active)"
done
