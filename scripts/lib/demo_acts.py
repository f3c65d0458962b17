"""The demo's three acts (scripts/demo.sh), against real processes already running:

  1. normal load through the proxy;
  2. an overload burst on the decoder: requests wait in its queue far longer than the lease L,
     and D's heartbeats keep every lease alive (no premature expiration);
  3. the decoder killed (SIGKILL) with its queue full: P takes its blocks back by itself.

One line per second while it runs (a terminal gets it redrawn in colour, a pipe plain lines), then
a summary table, a CSV of the per-second samples and an SVG chart of P's pinned blocks and live
leases with the acts marked. Every answer is checked against a local engine running the same
request alone. Standard library only.

  python3 demo_acts.py --proxy URL --p URL --local URL --d-pid PID --lease SECS --out DIR
"""

import argparse
import http.client
import json
import os
import signal
import sys
import threading
import time
import urllib.parse

MODEL = "kvlease-synthetic"


def post(base, path, body, timeout=60):
    u = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        conn.close()


def metrics(base):
    u = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=5)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


class Run:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.done = 0
        self.verified = 0
        self.wrong = []
        self.failed = 0
        self.want = {}  # prompt -> the local engine's text
        self.workers = 0  # how many client threads should be running
        self.stop = False

    def prompt(self, i):
        return f"demo request {i} asks the decoder to keep reading while the prefill engine holds its KV"

    def expected(self, prompt):
        with self.lock:
            if prompt in self.want:
                return self.want[prompt]
        status, body = post(self.args.local, "/v1/completions",
                            {"model": MODEL, "prompt": prompt, "max_tokens": self.args.max_tokens, "ignore_eos": True})
        text = body["choices"][0]["text"] if status == 200 else None
        with self.lock:
            self.want[prompt] = text
        return text

    def worker(self, slot):
        i = slot
        while not self.stop:
            with self.lock:
                if slot >= self.workers:
                    return
            prompt = self.prompt(i % 50)
            i += 1000
            try:
                status, body = post(self.args.proxy, "/v1/completions",
                                    {"model": MODEL, "prompt": prompt, "max_tokens": self.args.max_tokens, "ignore_eos": True},
                                    timeout=120)
            except OSError:
                status, body = 0, None
            if status != 200:
                with self.lock:
                    self.failed += 1
                time.sleep(0.2)  # the decoder is gone: do not spin
                continue
            got = body["choices"][0]["text"]
            want = self.expected(prompt)
            with self.lock:
                self.done += 1
                if got == want:
                    self.verified += 1
                else:
                    self.wrong.append((prompt, got, want))

    def set_workers(self, n):
        with self.lock:
            before, self.workers = self.workers, n
        for slot in range(before, n):
            threading.Thread(target=self.worker, args=(slot,), daemon=True).start()


def chart(samples, acts, kill_at, reclaim_at, lease, path):
    """An SVG chart in two panels sharing the time axis: KV blocks pinned on P; P's live leases
    and its leases expired so far. Acts shaded, the kill and the reclaim marked."""
    W, L, R = 900, 70, 30
    panels = [("blocks pinned on P", [("blocks", "#1f5fbf", "")]),
              ("leases on P", [("leases", "#d2691e", ""), ("expired", "#b00020", "4,3")])]
    PH, T0, GAP = 150, 40, 40
    H = T0 + len(panels) * (PH + GAP) + 30
    t_end = max(s["t"] for s in samples) or 1
    x = lambda t: L + (W - L - R) * t / t_end
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="15" font-weight="bold">'
           f'kvlease demo: a decoder overloaded, then killed (lease L = {lease:g} s)</text>']
    shades = ["#e8f4e8", "#fff3d6", "#fbe1e1"]
    for k, (title, series) in enumerate(panels):
        top = T0 + k * (PH + GAP)
        bottom = top + PH
        vmax = max(max(s[key] for s in samples) for key, _, _ in series) or 1
        y = lambda v, top=top, vmax=vmax: top + PH - PH * v / (vmax * 1.1)
        for (name, a, b), shade in zip(acts, shades):
            out.append(f'<rect x="{x(a):.1f}" y="{top}" width="{x(b) - x(a):.1f}" height="{PH}" fill="{shade}"/>')
            if k == 0:
                out.append(f'<text x="{(x(a) + x(b)) / 2:.1f}" y="{top + 14}" text-anchor="middle" fill="#444">{name}</text>')
        for at, colour, label, dy in ((kill_at, "#c00", "D killed", 30), (reclaim_at, "#070", "P holds nothing", 46)):
            if at is None:
                continue
            out.append(f'<line x1="{x(at):.1f}" y1="{top}" x2="{x(at):.1f}" y2="{bottom}" stroke="{colour}" stroke-dasharray="5,3"/>')
            if k == 0:
                extra = f" ({at - kill_at:.1f} s later)" if at != kill_at else ""
                near_end = x(at) > W - R - 220
                anchor, tx = ("end", x(at) - 4) if near_end else ("start", x(at) + 4)
                out.append(f'<text x="{tx:.1f}" y="{top + dy}" text-anchor="{anchor}" fill="{colour}">{label}{extra}</text>')
        out.append(f'<line x1="{L}" y1="{bottom}" x2="{W - R}" y2="{bottom}" stroke="black"/>')
        out.append(f'<line x1="{L}" y1="{top}" x2="{L}" y2="{bottom}" stroke="black"/>')
        for i in range(3):
            v = vmax * 1.1 * i / 2
            out.append(f'<text x="{L - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
        legend = L + 8
        for key, colour, dash in series:
            pts = " ".join(f"{x(s['t']):.1f},{y(s[key]):.1f}" for s in samples)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="2" stroke-dasharray="{dash}"/>')
        names = {"blocks": "KV blocks pinned on P", "leases": "leases active on P", "expired": "leases expired (total)"}
        for key, colour, dash in series:
            out.append(f'<line x1="{legend}" y1="{bottom + 16}" x2="{legend + 24}" y2="{bottom + 16}" stroke="{colour}" stroke-width="2" stroke-dasharray="{dash}"/>')
            out.append(f'<text x="{legend + 30}" y="{bottom + 20}">{names[key]}</text>')
            legend += 200
    axis = T0 + len(panels) * (PH + GAP) - GAP
    step = 5 if t_end <= 120 else 10
    for t in range(0, int(t_end) + 1, step):
        out.append(f'<text x="{x(t):.1f}" y="{axis + 36}" text-anchor="middle" fill="#444">{t}</text>')
    out.append(f'<text x="{W - R}" y="{axis + 52}" text-anchor="end" fill="#444">seconds</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proxy", required=True)
    ap.add_argument("--p", required=True)
    ap.add_argument("--local", required=True)
    ap.add_argument("--d-pid", type=int, required=True)
    ap.add_argument("--lease", type=float, required=True)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", required=True)
    ap.add_argument("--normal", type=float, default=20, help="seconds of act 1")
    ap.add_argument("--burst", type=float, default=35, help="seconds of act 2")
    ap.add_argument("--after", type=float, default=15, help="seconds of act 3")
    ap.add_argument("--burst-clients", type=int, default=40)
    args = ap.parse_args()
    tty = sys.stdout.isatty()
    run = Run(args)
    acts = [("1. normal load", 0, args.normal),
            ("2. overload burst on D", args.normal, args.normal + args.burst),
            ("3. D killed, clients stop", args.normal + args.burst, args.normal + args.burst + args.after)]
    t0 = time.monotonic()
    samples = []
    kill_at = reclaim_at = None
    expired_at_burst = expired_at_kill = None
    run.set_workers(2)
    print(f"{'t':>4}  {'act':<26} {'done':>5} {'leases':>6} {'pinned':>6} {'renewals':>8} {'expired':>7}")
    next_tick = 0.0
    while True:
        t = time.monotonic() - t0
        if t >= acts[2][2]:
            break
        if t >= acts[1][1] and run.workers == 2:
            run.set_workers(args.burst_clients)
        if t >= acts[2][1] and kill_at is None:
            m = metrics(args.p)
            expired_at_kill = m.get('kvlease_leases_released_total{reason="expired"}', 0)
            os.kill(args.d_pid, signal.SIGKILL)
            kill_at = t
            # Nothing is left to serve the clients: they stop (those in flight fail cleanly; the
            # proxy hands back the leases of their prefill legs at once).
            run.set_workers(0)
        m = metrics(args.p)
        expired = m.get('kvlease_leases_released_total{reason="expired"}', 0)
        if expired_at_burst is None and t >= acts[1][1]:
            expired_at_burst = expired
        s = {"t": round(t, 2), "blocks": m.get("kvlease_leased_blocks", 0), "leases": m.get("kvlease_leases_active", 0),
             "renewals": m.get("kvlease_lease_renewals_total", 0), "expired": expired, "done": run.done}
        samples.append(s)
        if kill_at is not None and reclaim_at is None and s["leases"] == 0:
            reclaim_at = t
        if t >= next_tick:
            act = next(name for name, a, b in acts if a <= t < b)
            line = f"{t:4.0f}  {act:<26} {run.done:>5} {s['leases']:>6.0f} {s['blocks']:>6.0f} {s['renewals']:>8.0f} {s['expired']:>7.0f}"
            print(f"\033[1m{line}\033[0m" if tty and kill_at is not None and reclaim_at is None else line, flush=True)
            next_tick += 1.0
        time.sleep(0.25)
    run.stop = True

    premature = (expired_at_kill or 0) - (expired_at_burst or 0)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kvlease-demo.csv"), "w") as f:
        f.write("t,blocks_pinned,leases_active,renewals_total,expired_total,requests_done\n")
        for s in samples:
            f.write(f"{s['t']},{s['blocks']:.0f},{s['leases']:.0f},{s['renewals']:.0f},{s['expired']:.0f},{s['done']}\n")
    svg = os.path.join(args.out, "kvlease-demo.svg")
    chart(samples, acts, kill_at, reclaim_at, args.lease, svg)
    with run.lock:
        done, verified, wrong, failed = run.done, run.verified, list(run.wrong), run.failed
    reclaim = f"{reclaim_at - kill_at:.1f} s (bound: L = {args.lease:g} s: a lease lasts 2L/3 after its last heartbeat, L after its grant)" \
        if reclaim_at is not None else "not within the act"
    print()
    print("| what | result |")
    print("|---|---|")
    print(f"| answers checked against a local run | {verified} of {done} identical, {len(wrong)} wrong |")
    print(f"| premature expirations during the overload (leases of a live decoder lost) | {premature:.0f} |")
    print(f"| reclaim after the kill (P holds no lease) | {reclaim} |")
    print(f"| requests in flight at the kill, failed cleanly (an HTTP error, no wrong answer) | {failed} |")
    print(f"\nchart: {svg}\nsamples: {os.path.join(args.out, 'kvlease-demo.csv')}")
    # A tick (100 ms) and a sample (250 ms) past the bound at most.
    ok = not wrong and premature == 0 and reclaim_at is not None and reclaim_at - kill_at <= args.lease + 0.5
    if not ok:
        print("the demo did not go as it should", file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
