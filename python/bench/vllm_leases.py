"""Same-interpreter benchmark (issue 14): vLLM 0.33.0's own P-side lease code against
KvleaseConnector's, per renewed lease and per idle step, at 10^3..10^6 live leases.

Both sides run their real methods: vLLM's NixlBaseConnectorWorker._handle_heartbeat and
._reap_expired_send_leases, and KvleaseConnectorWorker's overrides of them (LeaseBook over
kvlease's LeaseTable), each on a worker object holding only the state those methods touch (no
NIXL: the notification transport is the same for both and not measured). A heartbeat is vLLM's
text `HB:` payload naming every live lease (what a D with that many requests toward one P sends
each interval); an idle step is one call of the expiry sweep with nothing due (vLLM calls it on
every get_transfer_results, i.e. every engine step).

    python python/bench/vllm_leases.py [--sizes 1000,10000,100000,1000000]
(in the vLLM venv scripts/install-vllm.sh builds, with kvlease installed).
"""

import argparse
import collections
import gc
import statistics
import sys
import time
import types

import vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker as bw
from kvlease import DEFAULT_MAX_NOTIF_BYTES, LeaseConfig, encode_heartbeats
from kvlease.vllm import KvleaseConnectorWorker, LeaseBook

Stock = bw.NixlBaseConnectorWorker


class _Stats:
    def record_kv_expired_req(self):
        pass


def worker(kind: str, n: int):
    w = types.SimpleNamespace()
    w.consumer_notification_counts_by_req = collections.defaultdict(int)
    w.expected_consumer_notifications_by_req = {}
    w.xfer_stats = _Stats()
    w._reqs_to_process = set()
    w._lease_extension = 20
    now = time.perf_counter()
    if kind == "vllm":
        w._reqs_to_send = {f"cmpl-{i:08d}-0": now + 30 for i in range(n)}
        w.heartbeat = lambda payload: Stock._handle_heartbeat(w, payload)
        w.reap = lambda done: Stock._reap_expired_send_leases(w, done)
    else:
        book = LeaseBook(LeaseConfig(30), capacity=n)
        for i in range(n):
            book[f"cmpl-{i:08d}-0"] = now + 30
        for i, r in enumerate(list(book)):
            book.name_wire_id(r, i + 1)
        w._reqs_to_send = book
        # A binary heartbeat as the control channel hands it to the book (decided by the core;
        # the answer is built, not sent: the bench has no connection).
        w.binary = lambda data: book.on_message("d-engine", data)
        w.heartbeat = lambda payload: KvleaseConnectorWorker._handle_heartbeat(w, payload)
        w.reap = lambda done: KvleaseConnectorWorker._reap_expired_send_leases(w, done)
    w._reqs_to_process.update(w._reqs_to_send)
    return w


def timeit(fn, min_time=0.3, min_reps=3):
    times = []
    end = time.perf_counter() + min_time
    while len(times) < min_reps or time.perf_counter() < end:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000,100000,1000000")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"python {sys.version.split()[0]}, vllm {__import__('vllm').__version__}")
    print("| live leases | vLLM `HB:` heartbeat, ns/renewed lease | kvlease, same `HB:` text | ratio | kvlease binary heartbeat | bytes/lease binary (text) | vLLM idle step | kvlease idle step | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        row = {}
        for kind in ("vllm", "kvlease"):
            w = worker(kind, n)
            payload = ",".join(w._reqs_to_send)
            gc.collect()
            hb = timeit(lambda: w.heartbeat(payload)) / n * 1e9
            if kind == "kvlease":
                msgs = encode_heartbeats(1, list(range(1, n + 1)), DEFAULT_MAX_NOTIF_BYTES)
                row["binary"] = timeit(lambda: [w.binary(m) for m in msgs]) / n * 1e9
                row["bytes"] = (sum(map(len, msgs)) / n, len(payload) / n)
            done = set()
            idle = timeit(lambda: w.reap(done), min_reps=5)
            assert not done, "nothing may expire in the idle measurement"
            row[kind] = (hb, idle)
            del w, payload
            gc.collect()
        (vh, vi), (kh, ki), kb = row["vllm"], row["kvlease"], row["binary"]

        def fmt(s):
            return f"{s * 1e6:.1f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms"

        bb, tb = row["bytes"]
        print(
            f"| {n:,} | {vh:.0f} | {kh:.0f} | {vh / kh:.2f}× | {kb:.0f} ({vh / kb:.1f}×) | {bb:.2f} ({tb:.0f}) "
            f"| {fmt(vi)} | {fmt(ki)} | {vi / ki:,.0f}× |"
        )


if __name__ == "__main__":
    main()
