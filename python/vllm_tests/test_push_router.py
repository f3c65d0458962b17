"""SPEC U12 through vLLM's own push router (issue 24): vLLM 0.33.0's
`disagg_proxy_pushconnector_demo.py`, unchanged (scripts/install-vllm.sh takes it from the
release's sdist), routes to `kvlease serve` engines started with vLLM's
`"kv_connector":"NixlPushConnector"`. It sends both legs at once: the prefill leg to P with
`do_remote_decode`, the decode leg to D with P's coordinates from its flags and its own request
id, no blocks. Every answer equals a local engine's, P counts every transfer as `transferred`,
and nothing is recomputed."""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

ROUTER = os.environ.get("KVLEASE_PUSH_ROUTER", "")
BIN = os.environ.get("KVLEASE_BIN", "")
DEADLINE = 60.0
PUSH = json.dumps({"kv_connector": "NixlPushConnector", "kv_role": "kv_both"})

pytestmark = pytest.mark.skipif(
    not (os.path.isfile(ROUTER) and os.path.isfile(BIN)),
    reason="KVLEASE_PUSH_ROUTER (scripts/install-vllm.sh) and KVLEASE_BIN (cargo build) are set by scripts/test-python.sh",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, ready: str) -> subprocess.Popen:
    """Starts a process and waits for its start-up line on stdout or stderr."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    seen = []
    while time.monotonic() - t0 < DEADLINE:
        line = p.stdout.readline()
        if not line:
            if p.poll() is not None:
                raise RuntimeError(f"{args[0]} exited: {''.join(seen)}")
            continue
        seen.append(line)
        if ready in line:
            return p
    p.kill()
    raise RuntimeError(f"{args} did not start: {''.join(seen)}")


def serve(name: str, kv_port: int, push: bool = True) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [BIN, "serve", "--port", str(port), "--engine-id", name, "--kv-port", str(kv_port), "--log-level", "warn"]
    if push:
        args += ["--kv-transfer-config", PUSH]
    return start(args, "kvlease serve listening on "), f"http://127.0.0.1:{port}"


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=DEADLINE) as r:
        return json.loads(r.read())


def metric(base: str, name: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=DEADLINE) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


def until(what: str, cond, limit: float = 10.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture()
def cluster():
    procs = []
    try:
        p_kv = free_port()
        p, p_url = serve("push-p", p_kv)
        procs.append(p)
        d, d_url = serve("push-d", free_port())
        procs.append(d)
        local, local_url = serve("push-local", free_port(), push=False)
        procs.append(local)
        router_port = free_port()
        router = subprocess.Popen(
            [sys.executable, ROUTER, "--model", "kvlease-synthetic", "--port", str(router_port),
             "--prefill", p_url.removeprefix("http://"), "--decode", d_url.removeprefix("http://"),
             "--prefill-engine-id", "push-p", "--prefill-kv-host", "127.0.0.1",
             "--prefill-side-channel-port", str(p_kv), "--prefill-tp-size", "1", "--prefill-pp-size", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(router)
        router_url = f"http://127.0.0.1:{router_port}"

        def up():
            try:
                urllib.request.urlopen(f"{router_url}/status", timeout=2).read()
                return True
            except (urllib.error.URLError, ConnectionError):
                return False

        until("vLLM's push router", up, DEADLINE)
        yield p_url, d_url, local_url, router_url
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def text_of(body: dict) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_u12_vllms_push_router_drives_kvlease_push_engines_unchanged(cluster):
    p_url, d_url, local_url, router_url = cluster
    words = ["lease", "heartbeat", "prefill", "decode", "block", "engine", "write"]
    n = 12
    for i in range(n):
        prompt = " ".join(words[(i * 3 + j) % len(words)] for j in range(3 + i % 9))
        if i % 3 == 2:
            path, body = "/v1/chat/completions", {"model": "kvlease-synthetic", "messages": [{"role": "user", "content": prompt}]}
        else:
            path, body = "/v1/completions", {"model": "kvlease-synthetic", "prompt": prompt}
        body.update(max_tokens=4 + i % 7, ignore_eos=True)
        want = text_of(post(local_url + path, body))
        got = text_of(post(router_url + path, body))
        assert want and got == want, f"request {i}: {got!r} != {want!r}"
    until("P holds no lease", lambda: metric(p_url, "kvlease_leases_active") == 0.0)
    assert metric(p_url, 'kvlease_leases_released_total{reason="transferred"}') == n
    assert metric(d_url, "kvlease_recomputed_requests_total") == 0.0
    assert metric(d_url, "kvlease_writes_refused_total") == 0.0
