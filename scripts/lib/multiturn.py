"""Multi-turn client for scripts/bench-multiturn.sh (Python 3 standard library only).

  multiturn.py ttft PROXY_READ PROXY_RECOMPUTE CONVERSATIONS TURNS USER_WORDS MAX_TOKENS
      Runs CONVERSATIONS conversations of TURNS turns through each proxy, interleaved (read
      conversation i, then recompute conversation i), each turn a streamed /v1/completions with a
      top-level conversation_id whose prompt is the whole history so far. Prints, per turn, the
      median time to first token (request sent -> first SSE chunk with text) on each side and
      their ratio. Fails if the two sides ever answer differently (SPEC D7). With
      MULTITURN_PARALLEL=N, N conversations run at once (both sides' conversations share the N
      clients, still started in that interleaved order); the default 1 runs them one by one.

  multiturn.py abandon PROXY CONVERSATIONS USER_WORDS MAX_TOKENS TAG
      Runs CONVERSATIONS two-turn conversations through PROXY and walks away: the decoder keeps
      each conversation's last turn (SPEC B1) until its TTL.

  multiturn.py sample SECONDS INTERVAL NAME=URL...
      Prints `t NAME=held ...` every INTERVAL seconds for SECONDS seconds: each engine's KV
      blocks held (kvlease_kv_blocks_total - kvlease_kv_blocks_free).
"""

import concurrent.futures
import http.client
import json
import os
import statistics
import sys
import time
import urllib.parse

WORDS = ["lease", "heartbeat", "prefill", "decode", "block", "engine", "cache", "renewal"]


def connect(url):
    u = urllib.parse.urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=float(os.environ.get("MULTITURN_TIMEOUT", "120")))


def metrics(url):
    c = connect(url)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def turn(url, conversation, prompt, max_tokens):
    """One streamed turn; returns (seconds to first token, reply text)."""
    body = json.dumps({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": max_tokens,
                       "stream": True, "conversation_id": conversation})
    c = connect(url)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        sys.exit(f"error: {url} answered {r.status}: {r.read()[:300]!r}")
    ttft, reply = None, []
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            sys.exit(f"error: {url}: {chunk}")
        for choice in chunk.get("choices", []):
            text = choice.get("text") or ""
            if text and ttft is None:
                ttft = time.perf_counter() - t0
            reply.append(text)
    c.close()
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(reply)


def user_message(conversation, k, words):
    return "\n" + " ".join(f"{WORDS[(j * 7 + k * 3 + len(conversation)) % len(WORDS)]}" for j in range(words)) + "\n"


def conversation(side, url, i, turns, words, max_tokens):
    """Conversation i of one side, turn by turn: [(seconds to first token, prompt, reply)]."""
    cid = f"bench-{side}-{i}-{time.time_ns()}"
    prompt, out = "", []
    for k in range(turns):
        prompt += user_message(f"c{i}", k, words)
        t, reply = turn(url, cid, prompt, max_tokens)
        if os.environ.get("MULTITURN_VERBOSE"):
            print(f"{side} conversation {i} turn {k + 1}: {t * 1000:.1f} ms", file=sys.stderr)
        out.append((t, prompt, reply))
        prompt += reply
    return out


def ttft(read_url, recompute_url, conversations, turns, words, max_tokens):
    parallel = int(os.environ.get("MULTITURN_PARALLEL", "1"))
    jobs = [(side, url, i) for i in range(conversations) for side, url in (("read", read_url), ("recompute", recompute_url))]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        done = list(pool.map(lambda j: conversation(*j, turns, words, max_tokens), jobs))
    times = {"read": [[] for _ in range(turns)], "recompute": [[] for _ in range(turns)]}
    for (side, _, _), turns_of in zip(jobs, done):
        for k, t in enumerate(turns_of):
            times[side][k].append(t)
    for k in range(turns):
        for (_, pa, ra), (_, pb, rb) in zip(times["read"][k], times["recompute"][k]):
            if (pa, ra) != (pb, rb):
                sys.exit(f"error: turn {k + 1}: the two clusters answered differently (D7)")
    print(f"turn  prompt_tokens~  ttft_read_ms(median)  ttft_recompute_ms(median)  read/recompute")
    for k in range(turns):
        a = statistics.median(t for t, _, _ in times["read"][k]) * 1000
        b = statistics.median(t for t, _, _ in times["recompute"][k]) * 1000
        tokens = len(times["read"][k][0][1].split()) + times["read"][k][0][1].count("\n")
        print(f"{k + 1:>4}  {tokens:>14}  {a:>20.1f}  {b:>25.1f}  {a / b:>14.3f}")


def abandon(url, conversations, words, max_tokens, tag):
    for i in range(conversations):
        cid = f"abandon-{tag}-{i}-{time.time_ns()}"
        prompt = ""
        for k in range(2):
            prompt += user_message(f"a{i}", k, words)
            _, reply = turn(url, cid, prompt, max_tokens)
            prompt += reply


def sample(seconds, interval, targets):
    targets = [t.split("=", 1) for t in targets]
    t0 = time.monotonic()
    while True:
        t = time.monotonic() - t0
        row = []
        for name, url in targets:
            m = metrics(url)
            row.append(f"{name}={int(m['kvlease_kv_blocks_total'] - m['kvlease_kv_blocks_free'])}")
        print(f"{t:6.1f}s  " + "  ".join(row), flush=True)
        if t >= seconds:
            return
        time.sleep(max(0.0, interval - (time.monotonic() - t0 - t)))


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "ttft":
        ttft(args[0], args[1], int(args[2]), int(args[3]), int(args[4]), int(args[5]))
    elif cmd == "abandon":
        abandon(args[0], int(args[1]), int(args[2]), int(args[3]), args[4])
    elif cmd == "sample":
        sample(float(args[0]), float(args[1]), args[2:])
    else:
        sys.exit(__doc__)
