"""Real `vllm serve` prefill and decode engines on CPU, KV over NIXL (UCX/TCP), behind vLLM's toy
proxy and `kvlease proxy` (issue 25). Run by scripts/test-real-vllm.sh, which installs vLLM,
makes the tiny model and builds kvlease; see that script for the environment it needs.

What it does:

1. A single `vllm serve` (no KV transfer) answers every prompt the run will send, greedily and
   with a fixed length (`temperature 0`, `ignore_eos`): those are the reference answers. It is
   stopped before any pair starts (three engines do not fit in memory next to other work).
2. Per connector (stock `NixlConnector`, then kvlease's `KvleaseConnector`): a P and a D
   `vllm serve` (`kv_both`), vLLM's toy proxy and `kvlease proxy` in front of them. Each of
   /v1/completions and /v1/chat/completions, streamed and not, through each proxy, must give
   the reference text, and D must have loaded the prompt's KV from P (its
   `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` grows), so a pair that
   silently recomputed everything would not pass.
3. With --faults (lease 6 s, P with 64 KV blocks, D with one sequence at a time):
   (b) 12 requests of 64 tokens queued behind D's single slot (sent a quarter second apart),
       no fault;
   (a) D's engine paused (SIGSTOP to its engine core and worker, not its API server) 15 s
       with 8 requests waiting for it (prefilled on P, handed to the paused engine), P
       prefilling other prompts meanwhile so that it reuses the blocks it freed, then SIGCONT;
   (c) D killed (SIGKILL, every process) right after P prefilled 4 requests for it (sent while
       its engine was paused): how long P keeps the blocks (P's `vllm:kv_cache_usage_perc`
       polled every 0.1 s).
   D is paused before the requests are sent because vLLM 0.32's D reads the KV of a request as
   soon as it arrives, even one queued behind `--max-num-seqs 1`: a D that is up never leaves
   a lease outstanding for long.
   Every answer is classified: ok (200, the reference text; for a fault prompt also the text
   the single instance gave when its set was sent together, batched float32 prefill rounding
   differently), wrong (200, a complete answer, a different text: the failure that matters), error (anything else: a status, a broken stream,
   an error event, a finish_reason of error). A wrong answer always fails the run; an error
   does too, unless `--errors report` counts it instead (a connector none of
   whose equivalence checks passed still fails).

Every process is started in its own process group, listed in RUN_DIR/pgids (the shell script's
trap kills what is listed there if this program dies), and stopped on exit.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures as cf
import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import httpx

MODEL_NAME = "tiny"
CHECK_TOKENS = 24
# A fixed-length answer: the tiny model's EOS would otherwise end some answers after a token.
SAMPLING = {"temperature": 0.0, "ignore_eos": True, "seed": 0}
REQUEST_TIMEOUT = 300.0


# -- processes ---------------------------------------------------------------------------------
class Proc:
    """A process started in its own group (vllm serve forks an engine core and a worker)."""

    registry: list["Proc"] = []
    pgid_file: Path | None = None

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        self.logf = open(log, "wb")
        self.popen = subprocess.Popen(argv, env=env, stdout=self.logf, stderr=subprocess.STDOUT, start_new_session=True)
        self.pgid = self.popen.pid
        Proc.registry.append(self)
        if Proc.pgid_file is not None:
            with open(Proc.pgid_file, "a") as f:
                f.write(f"{self.pgid}\n")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    def signal_engine(self, sig: int) -> None:
        """`sig` to every process of the group but its leader: for `vllm serve`, the engine
        core and its worker (the scheduler, the connector, the heartbeats, the KV reads) but not
        the API server. A paused API server would leave its keep-alive connections overdue, and
        close them at SIGCONT under the proxy's next request: an error of the fault's making."""
        for pid in self.group():
            if pid != self.pgid:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def group(self) -> list[int]:
        pids = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            if int(fields[2]) == self.pgid:  # state, ppid, pgrp
                pids.append(int(d))
        return pids

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the group (SIGCONT first, in case it is paused), SIGKILL after `grace`."""
        if Proc.registry.count(self):
            Proc.registry.remove(self)
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self.signal(signal.SIGKILL)  # what is left of the group: engine core, workers
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.logf.close()

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_excerpt(self, n: int) -> str:
        """The log's last ``n`` warning, error and traceback lines (vLLM's and kvlease's)."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        keep = [x for x in lines if re.search(r"WARNING|ERROR|Traceback|Error:|^\s+File ", x) and "Releasing expired" not in x]
        return "\n".join("  " + x[:400] for x in keep[-n:])

    def log_size(self) -> int:
        try:
            return self.log.stat().st_size
        except OSError:
            return 0

    def said_since(self, offset: int, n: int) -> list[str]:
        """The last ``n`` warning and error lines the log gained after byte ``offset`` (no
        traceback frames), each cut short: what a process said while a check ran."""
        try:
            with self.log.open("rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return []
        keep = [x for x in text.splitlines() if re.search(r"WARNING|ERROR|Error|Exception", x) and "FutureWarning" not in x and not re.match(r"\s+File ", x)]
        return [f"  {self.name}: {x.strip()[:260]}" for x in keep[-n:]]

    def log_count(self, pattern: str) -> int:
        try:
            return len(re.findall(pattern, self.log.read_text(errors="replace")))
        except OSError:
            return 0


def stop_all() -> None:
    for p in list(reversed(Proc.registry)):
        p.stop(grace=10)


_TAKEN: set[int] = set()


def free_port() -> int:
    """A port below Linux's ephemeral range (32768-60999), free now and not handed out before
    in this run: a port the kernel picked (bind to 0) is an ephemeral one, which any outgoing
    connection on the machine may take before the engine binds it. vLLM's NIXL handshake
    listener then dies in its thread and the engine never gets ready."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 32000)
        if port in _TAKEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _TAKEN.add(port)
        return port
    raise Fatal("no free port in 20000-32000")


class Fatal(Exception):
    """The run cannot go on (an engine did not start, the model cannot detect a wrong read)."""


# Log lines after which an engine never gets ready (it does not exit either).
STARTUP_DEAD = ("Exception in thread", "Address already in use")


def wait_until(what: str, cond: Callable[[], bool], timeout: float, procs: tuple[Proc, ...] | list[Proc] = (), every: float = 0.1, dead_if: tuple[str, ...] = ()) -> float:
    """Waits for `cond` (at most `timeout` s); fails early if one of `procs` exits, or logs one
    of `dead_if`. Returns when."""
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if not p.alive():
                raise Fatal(f"{p.name} exited (code {p.popen.returncode}) while waiting for {what}; its log ({p.log}) ends:\n{p.log_tail()}")
            for pat in dead_if:
                if p.log_count(re.escape(pat)):
                    raise Fatal(f"{p.name} logged {pat!r} while waiting for {what}; its log ({p.log}) ends:\n{p.log_tail()}")
        try:
            if cond():
                return time.monotonic()
        except (httpx.HTTPError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise Fatal(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


# -- engines -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Engine:
    proc: Proc
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        """vLLM's /metrics, summed over label sets, keyed by `name{labels}` and by `name`."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
            if not m:
                continue
            try:
                v = float(m.group(3))
            except ValueError:
                continue
            out[m.group(1) + (m.group(2) or "")] = v
            out[m.group(1)] = out.get(m.group(1), 0.0) + v
        return out

    def metric(self, name: str, label: str = "") -> float:
        ms = self.metrics()
        if not label:
            return ms.get(name, 0.0)
        return sum(v for k, v in ms.items() if k.startswith(name + "{") and label in k)

    def external_tokens(self) -> float:
        return self.metric("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')


class Cluster:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir = Path(args.run_dir)
        self.base_env = dict(os.environ)
        self.base_env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_TARGET_DEVICE": "cpu",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "UCX_TLS": "tcp",
                "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_HOST_IP": "127.0.0.1",
                "KVLEASE_NIXL_PTHR_DELAY_US": str(args.nixl_pthr_delay_us),
                "PYTHONPATH": os.pathsep.join(p for p in [str(Path(__file__).parent / "pyhooks"), os.environ.get("PYTHONPATH", "")] if p),
                "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
                "OPENAI_API_KEY": "unused",
                "PYTHONUNBUFFERED": "1",
            }
        )
        self.base_env.pop("VLLM_USE_V1", None)

    def serve(self, name: str, cpu: int, extra: list[str], env: dict[str, str] | None = None) -> Engine:
        port = free_port()
        a = self.args
        argv = [
            str(Path(a.venv) / "bin" / "vllm"), "serve", a.model,
            "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", MODEL_NAME,
            "--block-size", "32", "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "1024", "--seed", "0",
            "--disable-uvicorn-access-log",
        ] + extra  # fmt: skip
        e = dict(self.base_env)
        # --omp-bind pin: each engine's worker on a core of its own (the single and P on 0, D on
        # 1), vLLM's CPU recipe for two engines; nobind: the kernel places every thread.
        e["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu) if a.omp_bind == "pin" else "nobind"
        # vLLM's NIXL worker on CPU pins its thread (and all it starts) to the core it reserves
        # for KV transfer, the host's last: each engine gets its own here (P 0, D 1), as two
        # hosts would (pyhooks/sitecustomize.py).
        e.pop("KVLEASE_TEST_KV_CORE", None)
        if a.kv_core == "per-engine":
            e["KVLEASE_TEST_KV_CORE"] = str(cpu % (os.cpu_count() or 1))
        e.update(env or {})
        proc = Proc(name, argv, e, self.run_dir / f"{name}.log")
        return Engine(proc, port)

    def wait_ready(self, engines: list[Engine], timeout: float) -> None:
        for eng in engines:
            wait_until(
                f"{eng.proc.name} to serve (/health on port {eng.port}; log {eng.proc.log})",
                lambda: httpx.get(eng.url + "/health", timeout=2).status_code == 200,
                timeout,
                [eng.proc],
                every=1.0,
                dead_if=STARTUP_DEAD,
            )

    def proxy(self, kind: str, p: Engine, d: Engine, tag: str) -> Engine:
        port = free_port()
        hosts = ["--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(p.port), "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(d.port)]
        if kind == "toy":
            argv = [str(Path(self.args.venv) / "bin" / "python"), self.args.toy_proxy, "--host", "127.0.0.1", "--port", str(port)] + hosts
        else:
            argv = [self.args.kvlease_bin, "proxy", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"] + hosts
        proc = Proc(f"{tag}-{kind}-proxy", argv, dict(self.base_env), self.run_dir / f"{tag}-{kind}-proxy.log")
        eng = Engine(proc, port)
        wait_until(f"{proc.name} to listen", lambda: httpx.get(eng.url + "/healthcheck", timeout=2).status_code == 200, 120, [proc])
        return eng


# -- requests ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Answer:
    status: int | None
    text: str | None
    error: str | None = None
    elapsed: float = 0.0

    @property
    def complete(self) -> bool:
        return self.error is None and self.status == 200 and self.text is not None


def body_of(kind: str, prompt: Any, max_tokens: int, stream: bool) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": max_tokens, "stream": stream, **SAMPLING}
    if kind == "completions":
        b["prompt"] = prompt
    else:
        b["messages"] = prompt
    return b


def ask(base: str, kind: str, prompt: Any, max_tokens: int, stream: bool, timeout: float = REQUEST_TIMEOUT) -> Answer:
    """One request; the text of a complete answer, or why there is none."""
    url = f"{base}/v1/{'completions' if kind == 'completions' else 'chat/completions'}"
    body = body_of(kind, prompt, max_tokens, stream)
    t0 = time.monotonic()
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout, connect=10)) as c:
            if not stream:
                r = c.post(url, json=body)
                if r.status_code != 200:
                    return Answer(r.status_code, None, f"HTTP {r.status_code}: {r.text[:200]}", time.monotonic() - t0)
                return _whole(r.status_code, r.json(), kind, max_tokens, t0)
            with c.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    return Answer(r.status_code, None, f"HTTP {r.status_code}: {r.text[:200]}", time.monotonic() - t0)
                return _streamed(r, kind, max_tokens, t0)
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        return Answer(None, None, f"{type(e).__name__}: {e}"[:300], time.monotonic() - t0)


def _whole(status: int, j: dict[str, Any], kind: str, max_tokens: int, t0: float) -> Answer:
    el = time.monotonic() - t0
    if "error" in j and j["error"]:
        return Answer(status, None, f"error object in a 200: {str(j['error'])[:200]}", el)
    ch = j["choices"][0]
    text = ch["text"] if kind == "completions" else ch["message"]["content"]
    fr = ch.get("finish_reason")
    if fr != "length":
        return Answer(status, text, f"finish_reason {fr!r} (expected 'length': ignore_eos, max_tokens {max_tokens})", el)
    n = (j.get("usage") or {}).get("completion_tokens")
    if n is not None and n != max_tokens:
        return Answer(status, text, f"{n} completion tokens, expected {max_tokens}", el)
    return Answer(status, text, None, el)


def _streamed(r: httpx.Response, kind: str, max_tokens: int, t0: float) -> Answer:
    parts: list[str] = []
    finish = None
    done = False
    for line in r.iter_lines():
        if not line.strip():
            continue
        if not line.startswith("data:"):
            return Answer(r.status_code, None, f"not an SSE data line: {line[:200]!r}", time.monotonic() - t0)
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        j = json.loads(data)
        if "error" in j and j["error"]:
            return Answer(r.status_code, "".join(parts), f"SSE error event: {str(j['error'])[:200]}", time.monotonic() - t0)
        for ch in j.get("choices") or []:
            piece = ch.get("text") if kind == "completions" else (ch.get("delta") or {}).get("content")
            if piece:
                parts.append(piece)
            if ch.get("finish_reason"):
                finish = ch["finish_reason"]
    el = time.monotonic() - t0
    text = "".join(parts)
    if not done:
        return Answer(r.status_code, text, "stream ended without [DONE]", el)
    if finish != "length":
        return Answer(r.status_code, text, f"finish_reason {finish!r} (expected 'length')", el)
    return Answer(r.status_code, text, None, el)


def verdict(a: Answer, ref: str) -> str:
    if not a.complete:
        return "error"
    return "ok" if a.text == ref else "wrong"


#: The key under which `references` keeps a fault prompt's answer when the single instance
#: prefilled it in one batch with the rest of its set and it differed from the prompt alone.
BATCHED = "completions, prefilled in a batch"


def judge(a: Answer, refs: dict[tuple[str, str], str], q: str) -> str:
    """A fault case's answer: right if the single instance gives it, for the prompt alone or
    prefilled in a batch with its set (float32 batched prefill may round differently and turn
    one greedy token; a read of other blocks matches neither)."""
    v = verdict(a, refs[("completions", json.dumps(q))])
    if v == "wrong" and a.text == refs.get((BATCHED, json.dumps(q))):
        return "ok"
    return v


# -- prompts -----------------------------------------------------------------------------------
class Prompts:
    """Deterministic prompts from the README's words. Fault prompts share a long suffix and
    differ in their first blocks only: their answers differ only if D decodes from the KV of
    their own first blocks, so a read of another prompt's (or stale) blocks shows in the text."""

    def __init__(self, text: str) -> None:
        self.words = [w for w in re.findall(r"[A-Za-z][A-Za-z0-9_-]{2,}", text)]
        self.suffix = " ".join(self.words[300:340])

    def _head(self, seed: str, n: int) -> str:
        rng = random.Random(seed)
        return " ".join(rng.choice(self.words) for _ in range(n))

    def fault(self, tag: str, i: int, head_words: int) -> str:
        return f"Request {tag} {i}: {self._head(f'{tag}-{i}', head_words)}. {self.suffix}"

    def filler(self, i: int) -> str:
        return f"Filler {i}: {self._head(f'filler-{i}', 100)}"

    def completions(self) -> list[str]:
        return [f"Check {i}: {self._head(f'check-{i}', n)}" for i, n in ((0, 70), (1, 200))]

    def chats(self) -> list[list[dict[str, str]]]:
        return [
            [{"role": "system", "content": self._head("sys-0", 40)}, {"role": "user", "content": self._head("chat-0", 60)}],
            [{"role": "user", "content": self._head("chat-1", 150)}],
        ]


# -- the run -----------------------------------------------------------------------------------
class Report:
    def __init__(self, judged: set[str], errors_fail: bool = True) -> None:
        self.judged = judged
        #: --errors fail: a request that ends in an error (a status, a broken stream) fails the
        #: run like a wrong answer; --errors report: it is reported and counted, not judged.
        self.errors_fail = errors_fail
        self.reported_errors = 0
        self.failed: list[str] = []
        self.lines: list[str] = []
        self.faults: dict[str, dict[str, Any]] = {}
        #: What the processes said while a failed check ran, printed again at the very end
        #: (CI keeps only a log's tail; the excerpts printed at a connector's end are long gone).
        self.evidence: list[str] = []

    def said(self, what: str, procs: list[Proc], offsets: list[int], n: int = 6) -> None:
        lines = [x for proc, off in zip(procs, offsets) for x in proc.said_since(off, n)]
        self.evidence.append(f"real-vllm: while '{what}' ran:" + ("\n" + "\n".join(lines) if lines else " no warning or error in any log"))

    def judged_line(self, ok: bool, errors: int, what: str, detail: str = "") -> None:
        """A result that failed only by `errors` requests ending in an error (no wrong answer):
        judged under --errors fail, reported under --errors report."""
        if ok or errors == 0 or self.errors_fail:
            self.line(ok, what, detail)
            return
        self.reported_errors += errors
        self.line(None, what, detail + f" [{errors} error(s), no wrong answer: reported, not judged (--errors report)]")

    def fault_line(self, tag: str, ok: bool, what: str, detail: str = "") -> None:
        """A fault case's result: judged for the connectors in --judge, a baseline otherwise
        (stock vLLM is expected to fail them: that is what the table shows)."""
        if tag in self.judged:
            self.line(ok, what, detail)
        else:
            self.line(None, what, detail + f" [baseline, not judged: {'as required' if ok else 'would FAIL'}]")

    def line(self, ok: bool | None, what: str, detail: str = "") -> None:
        tag = {True: "PASS", False: "FAIL", None: "INFO"}[ok]
        s = f"real-vllm: {tag} {what}" + (f": {detail}" if detail else "")
        print(s, flush=True)
        self.lines.append(s)
        if ok is False:
            self.failed.append(what)


def references(cl: Cluster, prompts: Prompts, rep: Report, fault_sets: dict[str, list[str]]) -> dict[tuple[str, str], str]:
    """The single instance's answers: (kind, json of the prompt) -> text."""
    t = time.monotonic()
    single = cl.serve("single", 0, [])
    cl.wait_ready([single], cl.args.start_timeout)
    rep.line(None, "single instance up", f"{time.monotonic() - t:.0f} s")
    refs: dict[tuple[str, str], str] = {}

    def one(kind: str, prompt: Any, n: int) -> str:
        a = ask(single.url, kind, prompt, n, False)
        if not a.complete:
            raise Fatal(f"the single instance did not answer {kind} {json.dumps(prompt)[:80]}: {a.error}")
        refs[(kind, json.dumps(prompt))] = a.text or ""
        return a.text or ""

    for q in prompts.completions():
        one("completions", q, CHECK_TOKENS)
    for m in prompts.chats():
        one("chat", m, CHECK_TOKENS)
    # The harness's own checks of what it compares against.
    p0, c0 = prompts.completions()[1], prompts.chats()[1]
    checks: list[tuple[str, Any]] = [("completions", p0), ("chat", c0)]
    for kind, p in checks:
        again = ask(single.url, kind, p, CHECK_TOKENS, False)
        streamed = ask(single.url, kind, p, CHECK_TOKENS, True)
        ref = refs[(kind, json.dumps(p))]
        ok = again.text == ref and streamed.complete and streamed.text == ref
        rep.line(ok, f"reference: the single instance's {kind} answer is deterministic and the same streamed", "" if ok else f"{ref!r} / {again.text!r} / {streamed.text!r} {streamed.error or ''}")
    for name, ps in fault_sets.items():
        n = cl.args.fault_tokens if name == "b" else CHECK_TOKENS
        texts = [one("completions", p, n) for p in ps]
        distinct = len(set(texts)) == len(texts)
        rep.line(distinct, f"reference: the {len(ps)} prompts of fault case ({name}) have pairwise different answers (a read of other blocks would show)")
        if not distinct:
            raise Fatal("the tiny model answers different prompts alike: a wrong KV read could go unseen; fix make_model.py")
        # The fault cases send their prompts together, and P prefills them in batches.
        with cf.ThreadPoolExecutor(len(ps)) as ex:
            together = list(ex.map(lambda q: ask(single.url, "completions", q, n, False), ps))
        differ = 0
        for q, a, alone in zip(ps, together, texts):
            if a.complete and a.text != alone:
                if a.text in texts:
                    raise Fatal(f"the single instance answered a fault prompt with another prompt's answer: {a.text!r}")
                refs[(BATCHED, json.dumps(q))] = a.text or ""
                differ += 1
        rep.line(None, f"reference: fault case ({name})'s prompts sent together", f"{differ} of {len(ps)} answers differ from the prompt's alone (batched float32 prefill); either is right")
    toks = httpx.post(single.url + "/tokenize", json={"model": MODEL_NAME, "prompt": fault_sets["a"][0]}, timeout=10).json().get("count") if fault_sets else None
    if toks:
        rep.line(None, "fault prompt length", f"{toks} tokens ({-(-toks // 32)} blocks of 32)")
    single.proc.stop()
    return refs


def equivalence(tag: str, proxies: dict[str, Engine], p: Engine, d: Engine, prompts: Prompts, refs: dict[tuple[str, str], str], rep: Report) -> None:
    cases = [("completions", q) for q in prompts.completions()] + [("chat", q) for q in prompts.chats()]
    passed = 0
    for pname, px in proxies.items():
        for kind in ("completions", "chat"):
            for stream in (False, True):
                bad = []
                errors = 0
                procs = [p.proc, d.proc, px.proc]
                offsets = [x.log_size() for x in procs]
                for k, q in cases:
                    if k != kind:
                        continue
                    before = d.external_tokens()
                    a = ask(px.url, kind, q, CHECK_TOKENS, stream)
                    ref = refs[(kind, json.dumps(q))]
                    v = verdict(a, ref)
                    loaded = d.external_tokens() - before
                    if v != "ok":
                        errors += v == "error"
                        bad.append(f"{v}: {a.error or ''} got {a.text!r}, expected {ref!r}")
                    elif loaded <= 0:
                        bad.append("the answer is right but D loaded no KV from P (external_kv_transfer tokens did not grow): recomputed, not transferred")
                what = f"{tag} via {pname} proxy: /v1/{'completions' if kind == 'completions' else 'chat/completions'} {'streamed' if stream else 'not streamed'} equals the single instance"
                rep.judged_line(not bad, errors if errors == len(bad) else 0, what, "; ".join(bad))
                if bad:
                    rep.said(what, procs, offsets)
                passed += not bad
    if passed == 0:
        # Even under --errors report: a connector that answers nothing is broken, not late.
        rep.line(False, f"{tag}: equivalence", "not one check passed")


def warm_up(tag: str, px: Engine, p: Engine, d: Engine, rep: Report) -> None:
    """One request through the cluster before any judged check; reported, not judged. The first
    NIXL READ between two freshly started engines once took 8.1 s here, with D's heartbeats not
    reaching P meanwhile (RELIABILITY.md, eighth round): longer than the harness's 6 s lease, so
    kvlease refused the read's bytes (as it must: P had expired the lease) and that request
    failed. What this request met is printed, with what each process warned of meanwhile."""
    procs = [p.proc, d.proc, px.proc]
    offsets = [x.log_size() for x in procs]
    a = ask(px.url, "completions", "warm-up: one request through P and D before the judged checks", 4, False)
    rep.line(None, f"{tag}: warm-up request through {px.proc.name} (not judged)", f"{'answered' if a.complete else f'failed: {a.error}'} in {a.elapsed:.1f} s")
    if not a.complete:
        for x in [x for proc, off in zip(procs, offsets) for x in proc.said_since(off, 6)]:
            print(x, flush=True)


def quiesce(p: Engine, d: Engine | None, timeout: float = 120) -> None:
    """Waits until D runs nothing and P holds no KV block (leases ended)."""
    if d is not None and d.proc.alive():
        wait_until("D idle", lambda: d.metric("vllm:num_requests_running") + d.metric("vllm:num_requests_waiting") == 0, timeout)
    wait_until("P's KV blocks all free", lambda: p.metric("vllm:kv_cache_usage_perc") == 0, timeout)


EXPIRED = r"Releasing expired KV blocks for request"


def fault_b(tag: str, px: Engine, p: Engine, d: Engine, prompts: Prompts, refs: dict[tuple[str, str], str], rep: Report, args: argparse.Namespace) -> dict[str, Any]:
    ps = prompts_b(prompts)
    expired0 = p.proc.log_count(EXPIRED)
    procs = [p.proc, d.proc, px.proc]
    offsets = [x.log_size() for x in procs]
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(len(ps)) as ex:
        futs = []
        for q in ps:
            # A quarter second apart: P mostly prefills each alone (as the reference was), and
            # all 12 still queue behind D's one slot (each decode there takes seconds).
            futs.append(ex.submit(ask, px.url, "completions", q, args.fault_tokens, False))
            time.sleep(0.25)
        answers = [f.result() for f in futs]
    vs = [judge(a, refs, q) for a, q in zip(answers, ps)]
    # Leases P let expire although D was healthy: a stock D reads such blocks anyway (right here
    # only because nothing reused them), a kvlease D does not.
    res = {"sent": len(ps), "ok": vs.count("ok"), "wrong": vs.count("wrong"), "error": vs.count("error"), "seconds": round(time.monotonic() - t0, 1), "expired_on_P": p.proc.log_count(EXPIRED) - expired0}
    errs = sorted({a.error for a in answers if a.error})
    what = f"fault (b) {tag}: {len(ps)} requests x {args.fault_tokens} tokens queued behind D's one slot, no fault"
    detail = f"ok {res['ok']}, wrong {res['wrong']}, errors {res['error']} in {res['seconds']} s; P expired {res['expired_on_P']} leases" + (f"; errors: {errs[:3]}" if errs else "")
    if tag in rep.judged:
        rep.judged_line(res["ok"] == len(ps), res["error"] if res["wrong"] == 0 else 0, what, detail)
    else:
        rep.fault_line(tag, res["ok"] == len(ps), what, detail)
    if res["ok"] != len(ps):
        rep.said(what, procs, offsets)
    return res


def prompts_b(prompts: Prompts) -> list[str]:
    return [prompts.fault("b", i, 20) for i in range(12)]  # ~110 tokens: 4 blocks each, 48 of 64


def prompts_a(prompts: Prompts) -> list[str]:
    return [prompts.fault("a", i, 40) for i in range(8)]  # ~145 tokens: 5 blocks each, 40 of 64


def prompts_c(prompts: Prompts) -> list[str]:
    return [prompts.fault("c", i, 40) for i in range(4)]


def prefilled_on_p(p: Engine) -> float:
    """Requests P has finished (a P leg ends after its prefill)."""
    return p.metric("vllm:request_success_total")


def send_while_d_paused(px: Engine, p: Engine, d: Engine, ps: list[str]) -> tuple[cf.ThreadPoolExecutor, list[cf.Future[Answer]]]:
    """Pauses D's engine (SIGSTOP to its engine core and worker), then sends `ps` through the
    proxy and waits until P has prefilled them all: P holds their KV under lease, and D's API
    server has handed them to the paused engine, which neither renews nor reads them. (Sent to
    a running D, a request's KV is read at once, even while it queues behind
    `--max-num-seqs 1`: vLLM 0.32's D fetches the KV of waiting requests ahead.)"""
    before = prefilled_on_p(p)
    if len(d.proc.group()) < 2:
        raise Fatal(f"{d.proc.name}: no engine process to pause in its process group")
    d.proc.signal_engine(signal.SIGSTOP)
    ex = cf.ThreadPoolExecutor(len(ps))
    futs = [ex.submit(ask, px.url, "completions", q, CHECK_TOKENS, False) for q in ps]
    wait_until(f"P to prefill {len(ps)} requests", lambda: prefilled_on_p(p) - before >= len(ps), 60, [p.proc], every=0.05)
    return ex, futs


def fault_a(tag: str, px: Engine, p: Engine, d: Engine, prompts: Prompts, refs: dict[tuple[str, str], str], rep: Report, args: argparse.Namespace) -> dict[str, Any]:
    ps = prompts_a(prompts)
    expired0 = p.proc.log_count(EXPIRED)
    paused = time.monotonic()
    ex, futs = send_while_d_paused(px, p, d, ps)
    rep.line(None, f"fault (a) {tag}", f"D's engine paused (SIGSTOP); {len(ps)} requests prefilled on P {time.monotonic() - paused:.1f} s later, waiting for D")
    # P's leases on those blocks end (expire) while D is paused; then P prefills other prompts
    # into the blocks it freed (LRU: the 24 never-leased blocks first, then the freed ones).
    try:
        wait_until("P to expire the paused D's leases", lambda: p.proc.log_count(EXPIRED) - expired0 >= len(ps), args.pause - 3, [p.proc], every=0.2)
    except Fatal:
        pass
    expired = p.proc.log_count(EXPIRED) - expired0
    fillers = 0
    while time.monotonic() - paused < args.pause - 1 and fillers < 24:
        a = ask(p.url, "completions", prompts.filler(fillers), 1, False, timeout=max(args.pause - 1 - (time.monotonic() - paused), 1))
        if not a.complete:
            rep.line(None, f"fault (a) {tag}", f"filler {fillers} on P failed: {a.error}")
        fillers += 1
    left = args.pause - (time.monotonic() - paused)
    if left > 0:
        time.sleep(left)  # the fault lasts exactly --pause seconds
    d.proc.signal_engine(signal.SIGCONT)
    answers = [f.result() for f in futs]
    ex.shutdown()
    vs = [judge(a, refs, q) for a, q in zip(answers, ps)]
    res = {"sent": len(ps), "ok": vs.count("ok"), "wrong": vs.count("wrong"), "error": vs.count("error"), "expired_on_P": expired, "fillers": fillers}
    errs = sorted({a.error for a in answers if a.error})
    wrong = [f"#{i}: {a.text!r}" for i, (a, v) in enumerate(zip(answers, vs)) if v == "wrong"][:2]
    rep.fault_line(tag, res["wrong"] == 0, f"fault (a) {tag}: D's engine paused {args.pause:.0f} s with {len(ps)} prefilled requests waiting for it, {fillers} other prompts prefilled on P meanwhile",
             f"ok {res['ok']}, wrong with HTTP 200 {res['wrong']}, errors {res['error']}; P expired {expired} leases during the pause" + (f"; errors: {errs[:3]}" if errs else "") + (f"; wrong e.g. {wrong}" if wrong else ""))  # fmt: skip
    return res


def fault_c(tag: str, px: Engine, p: Engine, d: Engine, prompts: Prompts, rep: Report, args: argparse.Namespace) -> dict[str, Any]:
    ps = prompts_c(prompts)
    expired0 = p.proc.log_count(EXPIRED)
    base = p.metric("vllm:kv_cache_usage_perc")
    ex, futs = send_while_d_paused(px, p, d, ps)
    prefilled = time.monotonic()
    held = p.metric("vllm:kv_cache_usage_perc")
    d.proc.signal(signal.SIGKILL)
    killed = time.monotonic()
    rep.line(None, f"fault (c) {tag}", f"D killed (SIGKILL) {killed - prefilled:.2f} s after P prefilled {len(ps)} requests for it; P's KV usage {held:.3f} (before: {base:.3f})")
    freed_at = None
    try:
        freed_at = wait_until("P to free the dead D's blocks", lambda: p.metric("vllm:kv_cache_usage_perc") <= base, args.reclaim_timeout, [p.proc], every=0.1)
    except Fatal:
        pass
    for f in futs:
        f.result()
    ex.shutdown()
    secs = None if freed_at is None else round(freed_at - killed, 1)
    res = {"held_usage": held, "freed_after_s": secs, "expired_on_P": p.proc.log_count(EXPIRED) - expired0}
    bound = args.lease + 2.0
    rep.fault_line(tag, secs is not None and secs <= bound, f"fault (c) {tag}: D killed right after prefill; P frees the blocks",
             (f"after {secs} s (bound L + 2 s = {bound:.0f} s)" if secs is not None else f"NOT within {args.reclaim_timeout:.0f} s") + f"; P expired {res['expired_on_P']} leases")  # fmt: skip
    return res


def run_connector(cl: Cluster, tag: str, connector: dict[str, Any], prompts: Prompts, refs: dict[tuple[str, str], str], rep: Report) -> None:
    a = cl.args
    extra: dict[str, Any] = {}
    if a.faults:
        extra["kv_lease_duration"] = a.lease
    # The NIXL progress-thread delay: KvleaseConnector sets it from its documented key; the stock
    # connector has none, so pyhooks/sitecustomize.py sets it for that one.
    env_delay = str(a.nixl_pthr_delay_us)
    if connector.get("kv_connector") == "KvleaseConnector":
        extra["kvlease_nixl_progress_delay_us"] = a.nixl_pthr_delay_us
        env_delay = ""
    cfg = {**connector, "kv_role": "kv_both", "kv_connector_extra_config": extra}
    p_args = ["--kv-transfer-config", json.dumps(cfg)]
    d_args = list(p_args)
    if a.faults:
        p_args += ["--num-gpu-blocks-override", "64"]
        d_args += ["--max-num-seqs", "1"]
    t = time.monotonic()
    failed0 = len(rep.failed)
    try:
        for attempt in (1, 2):
            p = cl.serve(f"{tag}-P", 0, p_args, {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "KVLEASE_NIXL_PTHR_DELAY_US": env_delay})
            d = cl.serve(f"{tag}-D", 1, d_args, {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "KVLEASE_NIXL_PTHR_DELAY_US": env_delay})
            try:
                cl.wait_ready([p, d], a.start_timeout)
                break
            except Fatal as e:
                if attempt == 2 or "Address already in use" not in str(e):
                    raise
                rep.line(None, f"{tag}: a port was taken under an engine; starting P and D again", str(e).splitlines()[0])
                p.proc.stop()
                d.proc.stop()
                for x in (p, d):
                    x.proc.log.rename(x.proc.log.with_suffix(".try1.log"))
        rep.line(None, f"{tag}: P and D up", f"{time.monotonic() - t:.0f} s (logs {p.proc.log}, {d.proc.log})")
        # The connector under test is the one loaded (vLLM's factory names it in each worker).
        loaded = CONNECTOR_CLASS[tag]
        missing = [x.proc.name for x in (p, d) if not x.proc.log_count(re.escape(f"Creating v1 connector with name: {loaded} "))]
        rep.line(not missing, f"{tag}: P and D loaded {loaded}", f"not named in the log of {missing}" if missing else "")
        proxies = {"toy": cl.proxy("toy", p, d, tag), "kvlease": cl.proxy("kvlease", p, d, tag)}
        warm_up(tag, proxies["toy"], p, d, rep)
        quiesce(p, d)
        equivalence(tag, proxies, p, d, prompts, refs, rep)
        if a.faults:
            px = proxies[a.fault_proxy]
            quiesce(p, d)
            rep.faults.setdefault(tag, {})["b"] = fault_b(tag, px, p, d, prompts, refs, rep, a)
            quiesce(p, d)
            rep.faults[tag]["a"] = fault_a(tag, px, p, d, prompts, refs, rep, a)
            quiesce(p, d)
            rep.faults[tag]["c"] = fault_c(tag, px, p, d, prompts, rep, a)
    finally:
        procs = [x for x in Proc.registry if x.name.startswith(tag)]
        for proc in procs:
            proc.stop()
        if len(rep.failed) > failed0 or sys.exc_info()[0] is not None:
            # CI keeps no run directory: what the engines said about the failure goes to the output.
            for proc in procs:
                print(f"real-vllm: {proc.name}'s warnings and errors (last {LOG_EXCERPT_LINES}):\n{proc.log_excerpt(LOG_EXCERPT_LINES)}", flush=True)


#: How many warning and error lines of each process a failed connector run prints.
LOG_EXCERPT_LINES = 60

CONNECTOR_CLASS = {"stock": "NixlPullConnector", "kvlease": "KvleaseConnector"}
CONNECTORS = {
    "stock": {"kv_connector": "NixlConnector"},
    "kvlease": {"kv_connector": "KvleaseConnector", "kv_connector_module_path": "kvlease.vllm"},
}


def table(rep: Report, args: argparse.Namespace) -> str:
    rows = [
        "| case | " + " | ".join(rep.faults) + " |",
        "|---|" + "---|" * len(rep.faults),
    ]

    def cell(tag: str, case: str) -> str:
        r = rep.faults[tag].get(case)
        if r is None:
            return "—"
        if case == "a":
            return f"ok {r['ok']}, **wrong (200) {r['wrong']}**, errors {r['error']} (P expired {r['expired_on_P']})"
        if case == "b":
            return f"ok {r['ok']}, failed {r['wrong'] + r['error']} (wrong {r['wrong']}, errors {r['error']}; P expired {r['expired_on_P']})"
        s = r["freed_after_s"]
        return f"{s} s after the kill" if s is not None else f"not freed within {args.reclaim_timeout:.0f} s"

    names = {
        "a": f"(a) D's engine paused {args.pause:.0f} s with 8 prefilled requests waiting, P reuses the freed blocks",
        "b": f"(b) no fault: 12 requests x {args.fault_tokens} tokens behind `--max-num-seqs 1`",
        "c": "(c) D killed after prefill: P frees the blocks",
    }
    for case in ("a", "b", "c"):
        rows.append(f"| {names[case]} | " + " | ".join(cell(t, case) for t in rep.faults) + " |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--kvlease-bin", required=True)
    ap.add_argument("--toy-proxy", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--prompt-text", required=True, help="text the prompts' words come from")
    ap.add_argument("--connectors", default="stock,kvlease")
    ap.add_argument("--faults", action="store_true")
    ap.add_argument("--fault-proxy", choices=["toy", "kvlease"], default="toy")
    ap.add_argument("--judge", default="kvlease", help="connectors whose fault results pass or fail the run (the others are a baseline)")
    ap.add_argument(
        "--errors", choices=["fail", "report"], default="fail",
        help="a request that ends in an error (no wrong answer) in the equivalence checks or case (b): fails the run (default), "
        "or is reported and counted (scripts/test.sh: wrong answers always fail)",
    )
    ap.add_argument("--lease", type=float, default=6.0)
    ap.add_argument("--pause", type=float, default=15.0)
    ap.add_argument("--fault-tokens", type=int, default=64)
    ap.add_argument("--reclaim-timeout", type=float, default=40.0)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--nixl-pthr-delay-us", type=int, default=100)
    ap.add_argument(
        "--omp-bind", choices=["nobind", "pin"], default="nobind",
        help="VLLM_CPU_OMP_THREADS_BIND of the engines: nobind (default), or pin (P's worker on core 0, D's on 1: "
        "with every thread of a worker, NIXL's and the connector's included, on the core its main thread spins on "
        "between steps, messages between P and D took tens of seconds here)",
    )
    ap.add_argument(
        "--kv-core", choices=["per-engine", "vllm"], default="per-engine",
        help="the core vLLM's NIXL worker pins itself to: per-engine (default: the single and P on 0, D on 1, as on two hosts), "
        "or vllm (the host's last core for every engine: with P and D on one 2-core host, D's worker starved behind P's)",
    )
    ap.add_argument("--results", help="write the results (JSON) and the fault table (Markdown) next to this path")
    args = ap.parse_args()

    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    Proc.pgid_file = run_dir / "pgids"
    atexit.register(stop_all)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda n, f: sys.exit(128 + n))

    tags = [t.strip() for t in args.connectors.split(",") if t.strip()]
    for t in tags:
        if t not in CONNECTORS:
            ap.error(f"--connectors: unknown connector {t!r} (known: {', '.join(CONNECTORS)})")
    prompts = Prompts(Path(args.prompt_text).read_text(errors="replace"))
    cl = Cluster(args)
    rep = Report({t.strip() for t in args.judge.split(",") if t.strip()}, errors_fail=args.errors == "fail")
    started = time.monotonic()
    try:
        fault_sets = {"a": prompts_a(prompts), "b": prompts_b(prompts)} if args.faults else {}
        refs = references(cl, prompts, rep, fault_sets)
        for t in tags:
            run_connector(cl, t, CONNECTORS[t], prompts, refs, rep)
    except Fatal as e:
        rep.line(False, "harness", str(e))
    finally:
        stop_all()
    elapsed = time.monotonic() - started
    if rep.faults:
        md = table(rep, args)
        print("\n" + md + "\n")
        if args.results:
            Path(args.results).with_suffix(".md").write_text(md + "\n")
    if args.results:
        Path(args.results).with_suffix(".json").write_text(json.dumps({"lines": rep.lines, "faults": rep.faults, "reported_errors": rep.reported_errors, "seconds": round(elapsed)}, indent=1))
    passed = len([l for l in rep.lines if " PASS " in l])
    print(f"real-vllm: done in {elapsed:.0f} s")
    if rep.reported_errors:
        print(f"real-vllm: {rep.reported_errors} request(s) ended in an error, none with a wrong answer (reported, not judged: --errors report)")
    print(f"real-vllm: {passed} passed, {len(rep.failed)} failed")
    # Again last, so that a log's tail (CI keeps only that) names what failed and what the
    # processes said meanwhile.
    for e in rep.evidence[-4:]:
        print(e[:6000])
    for l in rep.lines:
        if " FAIL " in l:
            print(l[:2000])
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
