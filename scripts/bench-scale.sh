#!/usr/bin/env bash
# Live leases across real processes (issue 27): N requests in flight at once through
# `kvlease proxy` (PROXIES of them side by side, as router replicas), each holding a lease on P while it waits in D's queue, renewed by D's heartbeats
# for HOLD seconds; then D is SIGKILLed and P must take every lease back by itself.
#
# One P (kv_producer) and one D (kv_consumer), synthetic engine on loopback, lease L = 30 s
# (heartbeat every L/6 = 5 s, extension 2L/3 = 20 s), a cluster secret. D runs one sequence at a
# time (--max-num-seqs 1) and is kept busy by a "blocker": one local request sent to D directly
# (no lease), ignore_eos, decoded at --decode-ms-per-token $DECODE_MS, long enough to outlast the
# ramp and the hold. A client (below) then puts N requests (max_tokens 1) in flight through the
# proxy: each gets its lease on P and queues on D behind the blocker.
#
# During the hold nothing runs but D's renewals (and the blocker's one decode step every
# DECODE_MS, the proxy's health probes every 0.5 s and this script's /metrics scrapes every 5 s).
# Every SAMPLE seconds: P's kvlease_leases_active, expirations (must stay 0), renewals,
# heartbeats, CPU time (utime + stime from /proc/PID/stat) and RSS of P and D, and the payload
# bytes D's sockets to P's side channel and transfer agent carried (`ss -ti`: bytes_acked /
# bytes_received), so heartbeat bytes per lease per interval = D->P bytes / renewals.
#
#   N=1000 HOLD=60 scripts/bench-scale.sh       # a first try (~2 min)
#   scripts/bench-scale.sh                      # N=10000, HOLD=300, two proxies (see below)
#   N=9500 PROXIES=1 scripts/bench-scale.sh     # the most one proxy takes under 20000 open files
#   KVLEASE_BIN=target/release/kvlease N=5000 scripts/bench-scale.sh   # no cargo build
#
# Environment: N (10000), HOLD (300 s), SAMPLE (5 s), LEASE (30 s), DECODE_MS (1000),
# PROMPT_WORDS (8), RATE (250), RAMP_TIMEOUT (300 s: give up waiting for N leases after this),
# RECLAIM_TIMEOUT (120 s), CHURN (requests a second whose client leaves, each replaced by a new
# one, from CHURN_AFTER (20) s after the last request started: leases end and new ones are granted
# under N live; default 0, none; paced client only), PROXIES (how many proxies share the requests, round robin; default:
# as few as fit the open-file limit), OUT (a directory for the samples' CSV and the processes'
# logs; default target/bench-scale).
#
# The client: by default a paced one (RATE new requests a second, 250; raw HTTP/1.1 from Python's
# asyncio), because every kvlease listener has an accept backlog of 128 (tokio's
# TcpListener::bind): a burst of thousands of connections overflows it and some of them time out
# (ETIMEDOUT) 45-66 s later. RATE=0 uses `kvlease load --concurrency N` instead: all N at once,
# which shows that.
#
# Limits on the shared 2-core test machine: the open-file hard limit (20000 there, not raisable
# in its container) bounds the proxy, which holds a socket per client and one per decode leg
# (about 2N; 3N in a burst, with a P-leg socket per request kept in its pool), so N=9500 is the
# most one proxy takes; more requests are spread over PROXIES proxies (each holds its share, and D
# one socket per request: N=10000 fits D's limit). See BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."

N=${N:-10000}
HOLD=${HOLD:-300}
SAMPLE=${SAMPLE:-5}
LEASE=${LEASE:-30}
DECODE_MS=${DECODE_MS:-1000}
PROMPT_WORDS=${PROMPT_WORDS:-8}
RATE=${RATE:-250}
CHURN=${CHURN:-0}
CHURN_AFTER=${CHURN_AFTER:-20}
RAMP_TIMEOUT=${RAMP_TIMEOUT:-300}
RECLAIM_TIMEOUT=${RECLAIM_TIMEOUT:-120}
OUT=${OUT:-target/bench-scale}
PY=${PY:-/root/.cache/kvlease/py-venv/bin/python}
[[ -x $PY ]] || PY=python3

command -v curl >/dev/null || { echo "error: curl is needed (apt-get install -y curl)" >&2; exit 1; }
command -v ss >/dev/null || { echo "error: ss is needed (apt-get install -y iproute2)" >&2; exit 1; }

source scripts/lib/procs.sh
if [[ -z ${KVLEASE_BIN:-} ]]; then echo "== cargo build --release -p kvlease"; fi
build_kvlease --quiet
mkdir -p "$OUT"

# Every process (and kvlease load, which does not raise it itself) gets the hard limit.
ulimit -n "$(ulimit -Hn)"
NOFILE=$(ulimit -n)
CONNS=$((N + 1024))
# A proxy holds about 2 open files per request (its client's socket, the decode leg's) plus 256.
PROXIES=${PROXIES:-$(((2 * N + 256 + NOFILE - 257) / (NOFILE - 256)))}
echo "== N=$N HOLD=${HOLD}s lease ${LEASE}s, open files $NOFILE, HTTP connection caps $CONNS, $PROXIES proxies"
if ((2 * N / PROXIES + 256 > NOFILE)); then
  echo "warning: each proxy needs about 2N/PROXIES+256 = $((2 * N / PROXIES + 256)) open files (a client socket and a decode-leg socket per request); the limit is $NOFILE" >&2
fi
if ((N + 512 > NOFILE)); then
  echo "warning: D holds a socket per queued request: N+512 = $((N + 512)) open files; the limit is $NOFILE" >&2
fi

export KVLEASE_TRANSFER_SECRET="scale-$$-$RANDOM$RANDOM"
cfg() { printf '{"kv_connector":"NixlConnector","kv_role":"%s","kv_connector_extra_config":{"kv_lease_duration":%s}}' "$1" "$LEASE"; }
# Blocker: ignore_eos, BLOCK_TOKENS tokens at DECODE_MS each, past the ramp and the hold.
BLOCK_TOKENS=$(((RAMP_TIMEOUT + HOLD + 300) * 1000 / DECODE_MS))
MAX_MODEL_LEN=$((BLOCK_TOKENS + 512))

# P: a lease pins its prompt's 16-token blocks: 4 at PROMPT_WORDS=8 (63 tokens) while request
# numbers have up to four digits, 5 past 10,000 (the words are longer): a pool of 6 blocks per
# request, so no request waits for P's blocks (one that does queues on P, and holds no lease).
launch p serve --host 127.0.0.1 --port 0 --engine-id scale-p --kv-transfer-config "$(cfg kv_producer)" \
  --num-gpu-blocks $((6 * N + 1024)) --max-num-seqs 256 --http-max-connections "$CONNS"
launch d serve --host 127.0.0.1 --port 0 --engine-id scale-d --kv-transfer-config "$(cfg kv_consumer)" \
  --max-num-seqs 1 --decode-ms-per-token "$DECODE_MS" --max-model-len "$MAX_MODEL_LEN" \
  --num-gpu-blocks $((MAX_MODEL_LEN / 16 + 1024)) --http-max-connections "$CONNS"
P_URL=$(url_of p "kvlease serve listening on ")
D_URL=$(url_of d "kvlease serve listening on ")
p_hp=${P_URL#http://}
d_hp=${D_URL#http://}
PROXY_URLS=() PROXY_PIDS=()
for i in $(seq "$PROXIES"); do
  launch "proxy$i" proxy --host 127.0.0.1 --port 0 \
    --prefiller-hosts "${p_hp%:*}" --prefiller-ports "${p_hp##*:}" \
    --decoder-hosts "${d_hp%:*}" --decoder-ports "${d_hp##*:}" \
    --http-max-connections "$CONNS" --request-timeout $((RAMP_TIMEOUT + HOLD + 3600))
  PROXY_URLS+=("$(url_of "proxy$i" "kvlease proxy listening on ")")
  PROXY_PIDS+=("${PID[proxy$i]}")
done
PROXY_URL=$(IFS=,; echo "${PROXY_URLS[*]}")
echo "P $P_URL (pid ${PID[p]}) | D $D_URL (pid ${PID[d]}) | proxies $PROXY_URL (pids ${PROXY_PIDS[*]})"

# Keep the logs when the script ends, whatever happens.
save_logs() {
  cp "$WORK"/*.out "$WORK"/*.err "$OUT"/ 2>/dev/null || true
  stop_all
}
trap save_logs EXIT

echo "== blocker: $BLOCK_TOKENS tokens at ${DECODE_MS} ms/token on D (one decode slot)"
curl -sN --max-time $((BLOCK_TOKENS * DECODE_MS / 1000 + 60)) "$D_URL/v1/completions" \
  -H 'Content-Type: application/json' \
  -d "{\"model\":\"kvlease-synthetic\",\"prompt\":\"the blocker holds the only decode slot\",\"max_tokens\":$BLOCK_TOKENS,\"ignore_eos\":true,\"stream\":true}" \
  >"$WORK/blocker.out" 2>&1 &
PID[blocker]=$!
# (The metrics are read whole first: `curl | grep -q` fails under pipefail when grep quits early.)
blocker_running() { local m; m=$(curl -s "$D_URL/metrics") && grep -q '^kvlease_requests_running 1$' <<<"$m"; }
for _ in $(seq 100); do
  blocker_running && break
  sleep 0.1
done
blocker_running || { echo "error: the blocker is not running on D" >&2; exit 1; }

# Baseline of P's RSS before any lease.
P_RSS0=$(awk '/^VmRSS/ { print $2 }' "/proc/${PID[p]}/status")

cp /proc/net/netstat "$WORK/netstat0"
export NETSTAT0=$WORK/netstat0
if ((RATE > 0)); then
  # A paced client: RATE new connections a second, so no listener's accept queue overflows
  # (kvlease's listeners have a backlog of 128: see BENCHMARKS.md). One connection per request,
  # raw HTTP/1.1, `Connection: close`; it prints a status tally when every request has ended.
  cat >"$WORK/client.py" <<'CLIENT'
import asyncio, collections, json, sys, time
import random
urls, n, rate, words = sys.argv[1].split(","), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
churn, churn_after = float(sys.argv[5]), float(sys.argv[6])
tally = collections.Counter()
async def one(i):
    host, port = urls[i % len(urls)].removeprefix("http://").split(":")
    prompt = " ".join(f"w{i}x{j}" for j in range(words))
    body = json.dumps({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    w = None
    try:
        r, w = await asyncio.open_connection(host, int(port))
        w.write(head + body)
        await w.drain()
        line = await r.readline()
        await r.read()
        tally["http_" + (line.split()[1].decode() if line else "eof")] += 1
    except asyncio.CancelledError:
        tally["left (churn)"] += 1
    except Exception as e:
        tally[type(e).__name__] += 1
    finally:
        if w is not None:
            w.close()
async def main():
    t0, tasks = time.monotonic(), []
    for i in range(n):
        tasks.append(asyncio.create_task(one(i)))
        delay = t0 + (i + 1) / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
    print(f"started {n} requests in {time.monotonic() - t0:.1f} s", flush=True)
    if churn > 0:
        # Churn: from churn_after s on, `churn` times a second a random request's client leaves
        # (its connection closes: the proxy drops the decode leg, D gives the request up and
        # releases its lease) and a new request takes its place, so N stay in flight while
        # leases end and new ones are granted.
        await asyncio.sleep(churn_after)
        print(f"churn: {churn:g} requests a second replaced from now on", flush=True)
        i, t1 = n, time.monotonic()
        while True:
            k = random.randrange(n)
            tasks[k].cancel()
            tasks[k] = asyncio.create_task(one(i))
            i += 1
            await asyncio.sleep(max(0.0, t1 + (i - n) / churn - time.monotonic()))
    await asyncio.gather(*tasks)
    print(f"requests={n} " + " ".join(f"{k}={v}" for k, v in sorted(tally.items())), flush=True)
asyncio.run(main())
CLIENT
  echo "== paced client: $N requests through the proxies (round robin), $RATE new a second, all held open (max_tokens 1, $PROMPT_WORDS-word prompts)"
  "$PY" "$WORK/client.py" "$PROXY_URL" "$N" "$RATE" "$PROMPT_WORDS" "$CHURN" "$CHURN_AFTER" >"$WORK/load.out" 2>"$WORK/load.err" &
else
  echo "== kvlease load: $N requests at once through the proxy (max_tokens 1, $PROMPT_WORDS-word prompts)"
  ((PROXIES == 1)) || { echo "error: RATE=0 (kvlease load) drives one proxy: set PROXIES=1" >&2; exit 1; }
  [[ $CHURN == 0 ]] || { echo "error: CHURN needs the paced client (RATE > 0)" >&2; exit 1; }
  "$BIN" load --url "$PROXY_URL" --requests "$N" --concurrency "$N" --max-tokens 1 \
    --prompt-words "$PROMPT_WORDS" --timeout-secs $((RAMP_TIMEOUT + HOLD + 3600)) \
    --max-run-secs $((RAMP_TIMEOUT + HOLD + 3600)) --log-level warn >"$WORK/load.out" 2>"$WORK/load.err" &
fi
PID[load]=$!

# The rest (ramp, hold, kill, reclaim, table) in Python: it polls, parses and times better.
CHURN=$CHURN "$PY" - "$N" "$HOLD" "$SAMPLE" "$LEASE" "$RAMP_TIMEOUT" "$RECLAIM_TIMEOUT" "$OUT" "$P_RSS0" \
  "$P_URL" "$D_URL" "$PROXY_URL" "${PID[p]}" "${PID[d]}" "$(IFS=,; echo "${PROXY_PIDS[*]}")" "${PID[load]}" <<'PY'
import os, re, signal, subprocess, sys, time, urllib.request

(n, hold, sample, lease, ramp_timeout, reclaim_timeout, out, p_rss0,
 p_url, d_url, proxy_url, p_pid, d_pid, proxy_pid, load_pid) = sys.argv[1:]
n, hold, sample, lease = int(n), float(hold), float(sample), float(lease)
ramp_timeout, reclaim_timeout, p_rss0 = float(ramp_timeout), float(reclaim_timeout), int(p_rss0)
p_pid, d_pid, load_pid = int(p_pid), int(d_pid), int(load_pid)
proxy_pids = [int(x) for x in proxy_pid.split(",")]
HZ = os.sysconf("SC_CLK_TCK")
LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')

def metrics(url, timeout=5.0):
    text = urllib.request.urlopen(url + "/metrics", timeout=timeout).read().decode()
    m = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        g = LINE.match(line)
        if g:
            m[g.group(1) + (g.group(2) or "")] = float(g.group(3))
    return m

def cpu_s(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / HZ          # utime + stime (fields 14, 15)

def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0

def fds(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1

def p_ports():
    """P's listening TCP ports (HTTP, side channel, transfer agents)."""
    ports = set()
    for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines():
        if f"pid={p_pid}," in line:
            ports.add(int(line.split()[3].rsplit(":", 1)[1]))
    return ports

HTTP_PORT = int(p_url.rsplit(":", 1)[1])
KV_PORTS = p_ports() - {HTTP_PORT}

def d_to_p_bytes():
    """Payload bytes (sent acked, received) on D's sockets to P's side channel and transfer agent,
    whichever side dialled (P may dial D's agent: then the peer is one of P's own ports)."""
    txt = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True).stdout
    def ends(line):
        parts = line.split()
        try:
            return int(parts[2].rsplit(":", 1)[1]), int(parts[3].rsplit(":", 1)[1])
        except (IndexError, ValueError):
            return None
    p_ports = set(KV_PORTS)
    for line in txt.splitlines():
        if not line[:1].isspace() and f"pid={p_pid}," in line and (e := ends(line)) and e[0] != HTTP_PORT:
            p_ports.add(e[0])
    sent = recv = 0
    cur = None
    for line in txt.splitlines():
        if not line[:1].isspace():
            cur = None
            if f"pid={d_pid}," in line and (e := ends(line)) and e[1] in p_ports:
                cur = True
        elif cur:
            a = re.search(r"bytes_acked:(\d+)", line)
            r = re.search(r"bytes_received:(\d+)", line)
            sent += int(a.group(1)) if a else 0
            recv += int(r.group(1)) if r else 0
    return sent, recv

EXP = 'kvlease_leases_released_total{reason="expired"}'
REL = 'kvlease_leases_released_total{reason="released"}'
def snap(t0):
    pm, dm = metrics(p_url), metrics(d_url)
    s, r = d_to_p_bytes()
    return dict(t=time.monotonic() - t0, active=pm.get("kvlease_leases_active", 0),
                granted=pm.get("kvlease_leases_granted_total", 0), expired=pm.get(EXP, 0),
                released=pm.get(REL, 0),
                blocks=pm.get("kvlease_leased_blocks", 0),
                renewals=pm.get("kvlease_lease_renewals_total", 0),
                hb_recv=pm.get("kvlease_heartbeats_received_total", 0),
                hb_sent=dm.get("kvlease_heartbeats_sent_total", 0),
                d_waiting=dm.get("kvlease_requests_waiting", 0), d_lost=dm.get("kvlease_lease_lost_total", 0),
                p_cpu=cpu_s(p_pid), d_cpu=cpu_s(d_pid), proxy_cpu=sum(cpu_s(x) for x in proxy_pids),
                p_rss=rss_kib(p_pid), d_rss=rss_kib(d_pid), proxy_fds=max(fds(x) for x in proxy_pids),
                d_fds=fds(d_pid),
                hb_bytes=s, ack_bytes=r)

COLS = ["t", "active", "blocks", "granted", "released", "expired", "renewals", "hb_sent", "hb_recv", "d_waiting", "d_lost",
        "p_cpu", "d_cpu", "proxy_cpu", "p_rss", "d_rss", "proxy_fds", "d_fds", "hb_bytes", "ack_bytes"]
csv = open(os.path.join(out, "samples.csv"), "w")
csv.write("phase," + ",".join(COLS) + "\n")
def log(phase, s):
    csv.write(phase + "," + ",".join(f"{s[c]:.3f}" if isinstance(s[c], float) else str(s[c]) for c in COLS) + "\n")
    csv.flush()
    print(f"  [{phase:6}] t={s['t']:6.1f}s leases={int(s['active']):6d} granted={int(s['granted']):6d} "
          f"expired={int(s['expired'])} renewals={int(s['renewals']):8d} D waiting={int(s['d_waiting']):6d} "
          f"P cpu={s['p_cpu']:7.2f}s rss={s['p_rss']//1024}MiB | D cpu={s['d_cpu']:7.2f}s rss={s['d_rss']//1024}MiB "
          f"| proxy fds={s['proxy_fds']} D fds={s['d_fds']} | D->P {s['hb_bytes']} B", flush=True)

def load_alive():
    try:
        pid, _ = os.waitpid(load_pid, os.WNOHANG)
        return pid == 0
    except ChildProcessError:
        return os.path.exists(f"/proc/{load_pid}")

def tcpext(path="/proc/net/netstat"):
    """Machine-wide TcpExt counters (listen queue overflows, TCP timeouts) from /proc/net/netstat."""
    lines = [l.split() for l in open(path) if l.startswith("TcpExt:")]
    d = dict(zip(lines[0][1:], map(int, lines[1][1:])))
    return {k: d.get(k, 0) for k in ("ListenOverflows", "ListenDrops", "TCPTimeouts")}
net0 = tcpext(os.environ["NETSTAT0"])

# Ramp: until N leases are live, or no progress for 30 s, or RAMP_TIMEOUT.
t0 = time.monotonic()
best, best_t = -1, t0
print("== ramp: waiting for the leases on P", flush=True)
while True:
    s = snap(t0)
    log("ramp", s)
    if s["active"] > best:
        best, best_t = s["active"], time.monotonic()
    if s["active"] >= n - 1:            # the blocker is local: every load request holds a lease
        break
    if time.monotonic() - best_t > 30 or s["t"] > ramp_timeout:
        print(f"warning: the ramp stopped at {int(s['active'])} live leases of {n}", flush=True)
        break
    time.sleep(2)
ramp_s = s["t"]
time.sleep(2)

# Hold.
print(f"== hold: {hold:.0f} s, a sample every {sample:.0f} s", flush=True)
h0 = snap(t0)
log("hold", h0)
samples = [h0]
next_t = time.monotonic() + sample
end = time.monotonic() + hold
while time.monotonic() < end - 0.01:
    time.sleep(max(0.0, min(next_t, end) - time.monotonic()))
    next_t += sample
    s = snap(t0)
    log("hold", s)
    samples.append(s)
h1 = samples[-1]
net1 = tcpext()

# Kill D, time P's reclaim. A churning client is paused first (SIGSTOP: its requests stay open),
# or its new requests would get new leases after the kill, each with its own bound.
churning = float(os.environ.get("CHURN", "0")) > 0
if churning:
    os.kill(load_pid, signal.SIGSTOP)
    time.sleep(1)
print("== SIGKILL D", flush=True)
os.kill(d_pid, signal.SIGKILL)
k0 = time.monotonic()
reclaim = None
last_print = 0
while time.monotonic() - k0 < reclaim_timeout:
    pm = metrics(p_url)
    a = pm.get("kvlease_leases_active", 0)
    el = time.monotonic() - k0
    if el - last_print >= 1:
        print(f"  [kill  ] +{el:5.1f}s leases={int(a)} expired={int(pm.get(EXP, 0))} "
              f"released={int(pm.get(REL, 0))}", flush=True)
        last_print = el
    if a == 0:
        reclaim = el
        break
    time.sleep(0.1)
if churning:
    os.kill(load_pid, signal.SIGCONT)
pm = metrics(p_url)
reasons = {k.split('"')[1]: int(v) for k, v in pm.items() if k.startswith("kvlease_leases_released_total{")}
hold_secs = h1["t"] - h0["t"]
renew = h1["renewals"] - h0["renewals"]
hbb = h1["hb_bytes"] - h0["hb_bytes"]
ackb = h1["ack_bytes"] - h0["ack_bytes"]
live_min = min(int(s["active"]) for s in samples)
live_max = max(int(s["active"]) for s in samples)
interval = lease / 6
# Renewals expected: each live lease once per interval I = L/6.
expected = sum(a["active"] * (b["t"] - a["t"]) for a, b in zip(samples, samples[1:])) / interval
# Bytes per renewal in the intervals with renewals and no release (steady state): the median.
steady = sorted((b["hb_bytes"] - a["hb_bytes"]) / (b["renewals"] - a["renewals"])
                for a, b in zip(samples, samples[1:])
                if b["renewals"] > a["renewals"] and b["active"] == a["active"])
median = steady[len(steady) // 2] if steady else float("nan")
# A pinned KV block's bytes: 2 (K, V) x layers x heads x head_dim x dtype bytes x block size.
block_bytes = int(os.environ.get("BLOCK_BYTES", "8192"))
rows = [
    ("N (requests in flight through the proxies)", f"{n} through {len(proxy_pids)} prox{'y' if len(proxy_pids) == 1 else 'ies'}"),
    ("live leases reached on P (min-max during the hold)", f"{live_min}-{live_max} (ramp {ramp_s:.0f} s)"),
    ("churn during the hold: leases granted / released", f"{int(h1['granted'] - h0['granted'])} / {int(h1['released'] - h0['released'])}"),
    ("premature expirations during the hold", f"{int(h1['expired'] - h0['expired'])} (D lease_lost +{int(h1['d_lost'] - h0['d_lost'])})"),
    (f"hold measured", f"{hold_secs:.0f} s, {len(samples)} samples"),
    ("renewals during the hold (expected: live leases x time / I)", f"{int(renew)} ({expected:.0f}); heartbeat messages D sent {int(h1['hb_sent'] - h0['hb_sent'])} / P received {int(h1['hb_recv'] - h0['hb_recv'])}"),
    ("P CPU during the hold, % of a core", f"{100 * (h1['p_cpu'] - h0['p_cpu']) / hold_secs:.2f}"),
    ("D CPU during the hold, % of a core", f"{100 * (h1['d_cpu'] - h0['d_cpu']) / hold_secs:.2f}"),
    ("proxies' CPU during the hold, % of a core (together)", f"{100 * (h1['proxy_cpu'] - h0['proxy_cpu']) / hold_secs:.2f}"),
    ("heartbeat bytes per lease per interval (D->P payload / renewals; with churn D's releases too)",
     f"{hbb / renew:.2f} mean, {median:.3f} median interval (acks P->D {ackb / renew:.3f})" if renew else "n/a"),
    ("P RSS growth per live lease", f"{(h1['p_rss'] - p_rss0) * 1024 / max(live_max, 1):.0f} B ({p_rss0 // 1024} -> {h1['p_rss'] // 1024} MiB)"),
    ("  of which the lease's pinned KV blocks", f"{h1['blocks'] / max(h1['active'], 1):.2f} blocks x {block_bytes} B = {h1['blocks'] * block_bytes / max(h1['active'], 1):.0f} B; the rest {((h1['p_rss'] - p_rss0) * 1024 - h1['blocks'] * block_bytes) / max(live_max, 1):.0f} B"),
    ("P RSS growth during the hold", f"{(h1['p_rss'] - h0['p_rss'])} KiB (pinned KV blocks {int(h1['blocks'] - h0['blocks']):+d} x {block_bytes // 1024} KiB)"),
    ("D RSS at the end of the hold", f"{h1['d_rss'] // 1024} MiB"),
    ("open files at the end of the hold: the busiest proxy, D", f"{h1['proxy_fds']}, {h1['d_fds']}"),
    ("reclaim after SIGKILL of D (P leases_active -> 0)", (f"{reclaim:.1f} s (bound: L = {lease:.0f} s with churn: a lease granted less than L/3 before the kill keeps its first deadline, grant + L; older ones 2L/3 = {2 * lease / 3:.0f} s after their last renewal)" if churning else f"{reclaim:.1f} s (bound 2L/3 = {2 * lease / 3:.0f} s after the last renewal)") if reclaim is not None else f"not within {reclaim_timeout:.0f} s ({int(pm.get('kvlease_leases_active', 0))} left)"),
    ("TcpExt counters, load start to end of hold (machine-wide)", ", ".join(f"{k} +{net1[k] - net0[k]}" for k in net0)),
    ("P leases released by reason (whole run)", ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))),
]
print()
w = max(len(r[0]) for r in rows)
print(f"| {'what'.ljust(w)} | result |")
print(f"|{'-' * (w + 2)}|--------|")
for k, v in rows:
    print(f"| {k.ljust(w)} | {v} |")
with open(os.path.join(out, "table.md"), "w") as f:
    f.write("| what | result |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows))
PY

# The load's requests failed when D died; give it a moment to print its summary.
for _ in $(seq 100); do kill -0 "${PID[load]}" 2>/dev/null || break; sleep 0.2; done
kill "${PID[load]}" 2>/dev/null || true
echo "== the client's summary (its requests failed when D was killed, as expected):"
tail -n 5 "$WORK/load.out" || true
grep -v '^\s*$' "$WORK/load.err" | tail -n 5 || true
echo "== warnings and errors logged by P, D and the proxy (first lines):"
for name in p d $(seq -f 'proxy%g' "$PROXIES"); do
  echo "-- $name: $(wc -l <"$WORK/$name.err") lines"
  head -n 5 "$WORK/$name.err" | cut -c1-300
done
echo "samples: $OUT/samples.csv, table: $OUT/table.md, logs: $OUT/*.out, *.err"
