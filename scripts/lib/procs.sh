# Sourced by scripts/demo.sh, scripts/bench-*.sh: build the
# kvlease binary, run `kvlease` processes in the background, wait for their start-up lines, stop
# them all on exit.
#
#   build_kvlease               # sets BIN (KVLEASE_BIN=path: that binary, nothing built)
#   launch NAME ARGS...         # `kvlease ARGS... --log-level warn`, output in $WORK/NAME.{out,err}
#                               # (LAUNCH_BIN=path: that program instead of kvlease; it gets
#                               # `--log-level warn` too; LAUNCH_LOG_LEVEL=warning: that level,
#                               # for a program that spells it so; LAUNCH_LOG_LEVEL= : no flag)
#   started_line NAME BANNER    # waits (10 s at most) for the start-up line; prints it, or fails
#   ON_STOP='echo stopped'      # optional: run after everything was stopped

build_kvlease() {
  if [[ -n ${KVLEASE_BIN:-} ]]; then
    BIN=$KVLEASE_BIN # a binary built already (e.g. target/debug/kvlease)
    return
  fi
  cargo build --release -p kvlease "$@"
  BIN=${CARGO_TARGET_DIR:-target}/release/kvlease
}

WORK=$(mktemp -d)
declare -A PID=()
ON_STOP=${ON_STOP:-}
stop_all() {
  for name in "${!PID[@]}"; do kill "${PID[$name]}" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
  if ((${#PID[@]})) && [[ -n $ON_STOP ]]; then eval "$ON_STOP"; fi
}
trap stop_all EXIT
trap 'exit 130' INT TERM

launch() {
  local name=$1
  shift
  local level=(--log-level "${LAUNCH_LOG_LEVEL:-warn}")
  [[ -n ${LAUNCH_LOG_LEVEL+set} && -z $LAUNCH_LOG_LEVEL ]] && level=()
  "${LAUNCH_BIN:-$BIN}" "$@" "${level[@]}" >"$WORK/$name.out" 2>"$WORK/$name.err" &
  PID[$name]=$!
}

started_line() {
  local name=$1 banner=$2 line
  for _ in $(seq 200); do
    line=$(head -n 1 "$WORK/$name.out" 2>/dev/null || true)
    if [[ $line == "$banner"* ]]; then
      echo "$line"
      return 0
    fi
    kill -0 "${PID[$name]}" 2>/dev/null || break
    sleep 0.05
  done
  echo "error: $name did not start:" >&2
  cat "$WORK/$name.err" >&2
  return 1
}

# Beside the above, for benchmark scripts:
#
#   url_of NAME BANNER          # the URL in NAME's start-up line (exits if it did not start)
#   cpu_ticks NAME...           # utime + stime of these launched processes, in clock ticks
#   metric URL NAME [CURL ARG...]  # one sample of URL's /metrics (empty if absent); extra curl
#                               # arguments for HTTPS (--cacert, --cert, --key)

url_of() {
  local line
  line=$(started_line "$1" "$2") || exit 1
  line=${line#"$2"}
  echo "${line%% *}"
}

cpu_ticks() {
  local t=0 n
  for n in "$@"; do t=$((t + $(awk '{ print $14 + $15 }' "/proc/${PID[$n]}/stat"))); done
  echo "$t"
}

metric() {
  local url=$1 name=$2
  shift 2
  curl -sf --noproxy '*' --max-time 5 "$@" "$url/metrics" | awk -v n="$name" '$1 == n { print $2 }'
}
