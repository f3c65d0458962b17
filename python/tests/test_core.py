"""The kvlease Python bindings (issue 14): each test names the SPEC id it proves through the
bindings. The rules themselves are kvlease-core's and are proven there; these tests show the
bindings carry them across the boundary unchanged, and that bad input raises, never crashes."""

import threading
import time

import pytest

import kvlease
from kvlease import (
    ConfigInvalid,
    IdIssuer,
    IssuedLeaseTable,
    KvleaseError,
    LeaseConfig,
    LeaseTable,
    Pull,
    Renewer,
    WireDecodeError,
    decode,
    encode,
    encode_heartbeats,
    parse_kv_transfer_config,
    prompt_digest,
)

MS = 1_000_000
S = 1_000_000_000  # ns per second
L = 30 * S


def table(lease: float = 30.0) -> LeaseTable:
    return LeaseTable(LeaseConfig(lease))


# ---------------------------------------------------------------- config (SPEC §2)


def test_spec2_config_defaults_and_derived_interval_extension():
    c = LeaseConfig()
    assert c.lease_duration == 30.0
    assert c.heartbeat_interval == pytest.approx(5.0)
    assert c.extension == pytest.approx(20.0)
    assert c.max_lifetime is None
    assert c.load_failure_policy == "recompute"
    assert c.max_notif_bytes == kvlease.DEFAULT_MAX_NOTIF_BYTES


def test_spec2_extra_config_dict_parsed_unknown_keys_warned():
    c, warnings = LeaseConfig.from_extra_config({"kv_lease_duration": "12", "kv_lease_max_lifetime": 60, "backends": ["UCX"]})
    assert c.lease_duration == 12.0 and c.extension == pytest.approx(8.0)
    assert c.max_lifetime == 60.0
    assert warnings == []
    _, warnings = LeaseConfig.from_extra_config({"kv_lease_durration": 1})
    assert len(warnings) == 1 and "kv_lease_durration" in warnings[0]


@pytest.mark.parametrize("bad", [0, -1, "nan", "soon", 1e-6, [1]])
def test_spec2_invalid_lease_duration_refused_naming_key(bad):
    with pytest.raises(ConfigInvalid, match="kv_lease_duration"):
        LeaseConfig.from_extra_config({"kv_lease_duration": bad})


def test_spec2_nan_float_refused():
    # Python's json writes a float NaN as `NaN`, which is not JSON: refused as such.
    with pytest.raises(ConfigInvalid):
        LeaseConfig.from_extra_config({"kv_lease_duration": float("nan")})


def test_spec2_kv_transfer_config_dict_or_json_text():
    cfg = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "engine_id": "p0",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"kv_lease_duration": 6},
    }
    for c in (parse_kv_transfer_config(cfg), parse_kv_transfer_config(__import__("json").dumps(cfg))):
        assert c.kv_role == "kv_producer" and c.engine_id == "p0"
        assert c.lease.lease_duration == 6.0 and c.lease.load_failure_policy == "fail"
    with pytest.raises(ConfigInvalid):
        parse_kv_transfer_config("{not json")
    with pytest.raises(ConfigInvalid, match="kv_role"):
        parse_kv_transfer_config({"kv_role": "kv_sideways"})
    with pytest.raises(TypeError):
        parse_kv_transfer_config({"x": object()})  # not JSON-able: Python's own error
    assert isinstance(ConfigInvalid("x"), ValueError)


# ---------------------------------------------------------------- lease table (SPEC §4)


def test_p1_grant_deadline_is_now_plus_l_and_payload_kept():
    t = table()
    lid = t.grant(5 * S, 3, payload="req-1")
    assert t.deadline(lid) == 5 * S + L
    assert t.get(lid) == "req-1"
    assert t.live == 1 and len(t) == 1 and t.leased_blocks == 3
    assert t.stats()["granted"] == 1


def test_p2_heartbeat_extends_to_now_plus_e_never_shortens():
    t = table()
    h = t.holder("d0")
    lid = t.grant(0, 1)
    renewed, lost, released = t.renew(h, [lid], 1 * S)
    assert (renewed, lost, released) == (1, [], [])
    assert t.deadline(lid) == L  # max(L, 1 s + 20 s): never shortens
    t.renew(h, [lid], 25 * S)
    assert t.deadline(lid) == 45 * S
    assert t.stats()["renewals"] == 2


def test_p3_released_exactly_once_later_messages_lost():
    t = table()
    h = t.holder("d0")
    lid = t.grant(0, 2, payload="r")
    lost, released = t.release(h, [lid], S)
    assert lost == [] and [(r.lease_id, r.reason, r.payload, r.blocks) for r in released] == [(lid, "released", "r", 2)]
    assert t.release(h, [lid], S) == ([lid], [])
    assert t.complete(h, lid, S) == ("lost", [])
    assert t.tick(100 * S) == []
    s = t.stats()
    assert (s["released"], s["expired"], s["transferred"]) == (1, 0, 0)


def test_p4_expiry_in_deadline_order_not_grant_order_vllm_58222():
    """vLLM #58222: a renewed lease granted first must not pin an expired one granted after it."""
    t = table()
    h = t.holder("d0")
    first = t.grant(0, 1, payload="renewed")
    second = t.grant(1 * S, 1, payload="idle")
    t.renew(h, [first], 20 * S)  # first now lives to 40 s
    released = t.tick(31 * S + S // 10)
    assert [(r.lease_id, r.reason) for r in released] == [(second, "expired")]
    assert t.live == 1 and t.deadline(first) == 40 * S
    assert t.next_expiry() is not None and t.next_expiry() <= 40 * S


def test_p4_idle_tick_releases_nothing_and_next_expiry_bounds_it():
    t = table()
    assert t.next_expiry() is None and t.tick(S) == []
    # The table keeps deadlines in whole milliseconds, rounded up (never early): 1 ms apart.
    ids = [t.grant(i * MS, 1) for i in range(100)]
    assert t.tick(L - 1) == []
    assert t.next_expiry() <= L
    released = t.tick(L + 100 * MS)
    assert sorted(r.lease_id for r in released) == ids
    assert [r.lease_id for r in released] == ids  # deadline order (granted 1 ms apart)


def test_p4_tick_budget_carries_work_over():
    t = table()
    for i in range(50):
        t.grant(i * MS, 1)
    more, first = t.tick_budget(L + 100 * MS, 10)
    assert more and 0 < len(first) <= 10
    total = len(first)
    while more:
        more, rest = t.tick_budget(L + 100 * MS, 10)
        total += len(rest)
    assert total == 50 and t.live == 0


def test_p6_unknown_ids_answered_lost():
    t = table()
    h = t.holder("d0")
    lid = t.grant(0, 1)
    renewed, lost, _ = t.renew(h, [lid, 999_999, 0], S)
    assert renewed == 1 and sorted(lost) == [0, 999_999]


def test_p6_p2_on_message_heartbeat_answered_with_ack_and_lost_ids():
    t = table()
    h = t.holder("d0")
    lid = t.grant(0, 1)
    reply, renewed, released = t.on_message(h, encode({"type": "heartbeat", "seq": 7, "lease_ids": [lid, lid + 1000]}), S)
    assert renewed == 1 and released == []
    assert decode(reply) == {"type": "heartbeat_ack", "seq": 7, "lost_ids": [lid + 1000]}


def test_p1_p5_issued_ids_name_leases_and_overtaking_messages_are_held():
    """IssuedLeaseTable (kvlease-core's IssuedLeases): messages name leases by ids another
    process issued; a ReadDone of an id not granted yet is held, then answered live once it is
    granted and named; P's own end by the read keeps confirming it to its holder only."""
    t = IssuedLeaseTable(LeaseConfig(30))
    d1, d2 = t.holder("d1"), t.holder("d2")
    w = (5 << 32) + 1
    a = t.grant(0, 1, payload="a")
    assert t.name(a, w, 0) == (True, []) and t.lease_of(w) == a and t.pending(w + 1) and not t.pending(w - 1)
    reply, renewed, _ = t.on_message(d1, encode({"type": "heartbeat", "seq": 1, "lease_ids": [w, w + 1, w - 1]}), S)
    assert renewed == 1 and decode(reply)["lost_ids"] == [w - 1]
    read_done = {"type": "read_done", "lease_id": w + 1, "consumer_rank": 0, "n": 1, "digest": bytes(16)}
    assert t.on_message(d1, encode(read_done), S, tag=5)[0] is None and t.held == 1
    b = t.grant(2 * S, 1, payload="b")
    t.name(b, w + 1, 2 * S)
    due, _ = t.answer_due(2 * S, 20.0)
    assert [(h, tag, decode(m)) for h, tag, m in due] == [(d1, 5, {"type": "read_done_ack", "lease_id": w + 1, "live": True})]
    t.on_message(d1, encode({"type": "heartbeat", "seq": 2, "lease_ids": [w + 1]}), 2 * S)  # d1 holds it (S5)
    live, released = t.end(b, "transferred", 3 * S)
    assert live and [r.payload for r in released] == ["b"] and t.stats()["transferred"] == 1
    assert decode(t.on_message(d1, encode(read_done), 3 * S)[0])["live"] is True
    assert decode(t.on_message(d2, encode(read_done), 3 * S)[0])["live"] is False
    with pytest.raises(KvleaseError):
        t.end(a, "expired", 3 * S)


def test_p1_id_issuer_issues_in_order_in_one_series():
    """kvlease-core's Issuer, as vLLM's scheduler uses it: ids in order, one series per life."""
    a = IdIssuer(6)
    assert [a.next_id(), a.next_id()] == [7 << 32, (7 << 32) + 1]
    assert IdIssuer(0).next_id() == 1 << 32


def test_d6_pull_decides_when_to_read_and_whether_to_use_it():
    """kvlease-core's Pull as a driver that posts its own reads uses it (the vLLM connector): wait
    for a live acknowledgement, read, use the bytes only once P confirmed every read; a read with
    no link to P waits once more within the link wait; an unconfirmed one is not used."""
    cfg = LeaseConfig(30)
    p = Pull(cfg, "p0", 0, confirm_within=30.0)
    what, until, renew, verdict = p.check("renew_first", 0)
    assert what == "wait" and renew and until is not None and verdict is None
    assert p.check("safe", 1)[0] == "read" and p.reading(1) is not None
    assert p.reads_done(True, 2, 2) == ("await", 2 + 30 * S, None)
    assert p.on_read_done_ack(True) is None
    assert p.on_read_done_ack(True) == ("use", None, None)
    e = int(cfg.ack_wait * S)
    late = Pull(cfg, "p0", 0, link_wait=30.0)
    assert late.check("no_link", e)[0] == "wait", "no link yet: waits once more"
    assert late.check("no_link", 2 * e)[0] == "lost"
    q = Pull(cfg, "p0", 0)
    q.check("safe", 0)
    q.reading(0)
    q.reads_done(True, 1, 0)
    assert q.on_deadline()[:2] == ("recompute", "read_unconfirmed")
    with pytest.raises(KvleaseError):
        Pull(cfg, "p0", 0).check("maybe", 0)


def test_d6_a_loss_reported_after_the_read_was_posted_is_left_to_its_read_done():
    """kvlease-core's Pull decides what a lease reported lost means (the vLLM connector asks it):
    before the read, the load fails; once the read is posted or landed, P's answer to its
    ReadDone decides (P may have ended the lease on that very read)."""
    cfg = LeaseConfig(30)
    assert Pull(cfg, "p0", 0).lease_lost() == ("recompute", "lease_lost", "the prefill engine reported the lease lost")
    p = Pull(cfg, "p0", 0)
    assert p.check("safe", 0)[0] == "read" and p.reading(0) is not None
    assert p.lease_lost() is None
    p.reads_done(True, 1, 1)
    assert p.lease_lost() is None
    assert p.on_read_done_ack(True) == ("use", None, None)


def test_p7_malformed_message_raises_wire_error_table_unchanged():
    t = table()
    h = t.holder("d0")
    t.grant(0, 1)
    for junk in [b"", b"HB:1,2", b"KL\x02\xff", b"KL\x63\x01\x00", bytes(range(256))]:
        with pytest.raises(WireDecodeError):
            t.on_message(h, junk, S)
    assert t.live == 1


def test_p8_transferred_after_n_distinct_consumers_duplicates_not_counted():
    t = table()
    h = t.holder("d0")
    dg = prompt_digest([1, 2, 3])
    lid = t.grant(0, 4, digest=dg, payload="r")
    assert t.complete(h, lid, S, consumer=0, n=2, digest=dg) == ("pending", [])
    assert t.complete(h, lid, S, consumer=0, n=2, digest=dg) == ("pending", [])
    outcome, released = t.complete(h, lid, S, consumer=1, n=2, digest=dg)
    assert outcome == "transferred" and [(r.reason, r.payload) for r in released] == [("transferred", "r")]


def test_p9_max_lifetime_caps_renewals():
    c, _ = LeaseConfig.from_extra_config({"kv_lease_duration": 30, "kv_lease_max_lifetime": 40})
    t = LeaseTable(c)
    h = t.holder("d0")
    lid = t.grant(0, 1)
    renewed, lost, _ = t.renew(h, [lid], 25 * S)
    assert renewed == 0 and lost == [lid]  # capped short of a full E: D must not count on it
    assert t.deadline(lid) == 40 * S


def test_s4_completion_for_another_prompt_not_confirmed():
    t = table()
    h = t.holder("d0")
    lid = t.grant(0, 1, digest=prompt_digest([1, 2]))
    assert t.complete(h, lid, S, digest=prompt_digest([1, 3]))[0] == "lost"
    assert t.live == 1
    assert t.complete(h, lid, S, digest=prompt_digest([1, 2]))[0] == "transferred"


def test_s5_other_holder_cannot_renew_or_release():
    t = table()
    d0, d1 = t.holder("d0"), t.holder("d1")
    assert t.holder("d0") == d0 and d0 != d1
    lid = t.grant(0, 1)
    t.renew(d0, [lid], S)
    assert t.renew(d1, [lid], 2 * S)[1] == [lid]
    assert t.release(d1, [lid], 2 * S) == ([lid], [])
    assert t.live == 1


def test_p3_shutdown_releases_every_live_lease_once():
    t = table()
    for i in range(3):
        t.grant(i, 1, payload=i)
    released = t.shutdown(S)
    assert sorted(r.payload for r in released) == [0, 1, 2] and {r.reason for r in released} == {"shutdown"}
    assert t.live == 0 and t.stats()["shutdown"] == 3


def test_bad_input_raises_python_exceptions_never_panics():
    t = table()
    with pytest.raises(KvleaseError, match="16 bytes"):
        t.grant(0, 1, digest=b"short")
    with pytest.raises(KvleaseError, match="holder 0"):
        t.renew(0, [1], 0)
    with pytest.raises(OverflowError):
        t.renew(1, [-1], 0)
    with pytest.raises(OverflowError):
        t.grant(-5, 1)
    with pytest.raises(OverflowError):
        t.renew(1, [2**64], 0)
    with pytest.raises(TypeError):
        t.renew(1, "123", 0)
    with pytest.raises(KvleaseError):
        t.grant(0, 1, lifetime=float("inf"))
    with pytest.raises(KvleaseError, match="type"):
        encode({"type": "gossip"})
    with pytest.raises(KvleaseError, match="lease_ids"):
        encode({"type": "heartbeat", "seq": 1})
    with pytest.raises(KvleaseError, match="sorted"):
        encode_heartbeats(1, [3, 2], 1024)
    assert issubclass(WireDecodeError, KvleaseError) and issubclass(KvleaseError, ValueError)


def test_p2_gil_released_during_batch_renew():
    """Batch operations run without the GIL: another Python thread runs *inside* a large renew
    (its timestamps fall strictly within the call), not only between calls (a correctness
    check of the binding, not a timing assertion)."""
    t = table()
    h = t.holder("d0")
    ids = [t.grant(0, 1) for _ in range(300_000)]
    seen = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            seen.append(time.perf_counter_ns())
            time.sleep(0)

    th = threading.Thread(target=spin)
    th.start()
    inside = False
    try:
        for k in range(20):
            started = time.perf_counter_ns()
            t.renew(h, ids, (k + 1) * S)
            ended = time.perf_counter_ns()
            if any(started < s < ended for s in seen[-10_000:]):
                inside = True
                break
    finally:
        stop.set()
        th.join(timeout=30)
    assert not th.is_alive()
    assert inside, "no other thread ran during a renew: the GIL was held"


# ---------------------------------------------------------------- renewer (SPEC §5)


def drive_handshake(r: Renewer, now: int):
    acts = r.poll(now)
    hs = [a for a in acts if a.kind == "handshake"]
    assert [(a.engine_id, a.host, a.port) for a in hs] == [("p0", "127.0.0.1", 5600)]
    assert r.handshake_done("p0", now, incarnation=7, agents=["agent-p0"]) == (True, [])
    assert r.is_ready("p0")


def test_d1_d5_tracking_starts_handshake_then_batched_heartbeat():
    r = Renewer(LeaseConfig(30))
    r.track("req-a", "p0", "127.0.0.1", 5600, 11, 0, incarnation=7)
    r.track("req-b", "p0", "127.0.0.1", 5600, 12, 0, incarnation=7)
    assert r.tracked == 2 and r.is_tracked("req-a")
    assert r.poll_timeout() == 0
    drive_handshake(r, 0)
    sends = [a for a in r.poll(1) if a.kind == "send" and a.send_kind == "heartbeat"]
    assert len(sends) == 1  # one batched heartbeat per engine (D2)
    msg = decode(sends[0].data)
    assert msg["type"] == "heartbeat" and msg["lease_ids"] == [11, 12]
    # Nothing more until the interval has passed.
    assert [a for a in r.poll(2) if a.send_kind == "heartbeat"] == []
    assert r.poll_timeout() <= 1 + 5 * S


def test_d2_heartbeat_chunks_at_256_bytes():
    ids = list(range(1, 5000, 7))
    chunks = encode_heartbeats(1, ids, 256)
    assert len(chunks) > 1 and all(len(c) <= 256 for c in chunks)
    got = []
    for i, c in enumerate(chunks):
        m = decode(c)
        assert m["seq"] == 1 + i
        got += m["lease_ids"]
    assert got == ids


def test_d6_read_check_safe_only_after_ack_and_lost_lease_reported():
    r = Renewer(LeaseConfig(30))
    r.track("req-a", "p0", "127.0.0.1", 5600, 11, 0, incarnation=7)
    r.track("req-b", "p0", "127.0.0.1", 5600, 12, 0, incarnation=7)
    drive_handshake(r, 0)
    assert r.read_check("req-a", 5.0, 1) == "renew_first"
    hb = [a for a in r.poll(1) if a.kind == "send" and a.send_kind == "heartbeat"][0]
    seq = decode(hb.data)["seq"]
    # P answers: 12 is lost (P6).
    r.on_message("p0", encode({"type": "heartbeat_ack", "seq": seq, "lost_ids": [12]}), 2)
    assert r.read_check("req-a", 5.0, 3) == "safe"
    lost = [a for a in r.poll(4) if a.kind == "lost"]
    assert [(a.request_id, a.lease_id) for a in lost] == [("req-b", 12)]
    assert not r.is_tracked("req-b") and r.read_check("req-b", 5.0, 5) == "untracked"
    with pytest.raises(WireDecodeError):
        r.on_message("p0", b"HB:req-a", 6)


def test_d4_abandoned_request_sends_release_at_once():
    r = Renewer(LeaseConfig(30))
    r.track("req-a", "p0", "127.0.0.1", 5600, 11, 0, incarnation=7)
    drive_handshake(r, 0)
    r.poll(1)
    r.untrack("req-a", abandoned=True)
    rel = [a for a in r.poll(2) if a.kind == "send" and a.send_kind == "release"]
    assert [decode(a.data) for a in rel] == [{"type": "release", "lease_ids": [11]}]


def test_d5_failed_handshake_reports_unreachable_and_retries():
    r = Renewer(LeaseConfig(30))
    r.track("req-a", "p0", "127.0.0.1", 5600, 11, 0)
    assert [a.kind for a in r.poll(0)] == ["handshake"]
    r.handshake_done("p0", 0, incarnation=None)
    assert r.read_check("req-a", 5.0, 1) == "unreachable"
    retry = r.poll_timeout()
    assert retry is not None and retry > 0
    assert [a.kind for a in r.poll(retry)] == ["handshake"]


def test_d6_renewer_and_table_round_trip_over_the_wire():
    """D's renewer and P's table talk only bytes: D's heartbeat renews P's lease, P's ack makes
    the read safe, a lease P no longer has comes back as lost on D."""
    cfg = LeaseConfig(30)
    p, d = LeaseTable(cfg), Renewer(cfg)
    hd = p.holder("d0")
    a, b = p.grant(0, 1, payload="A"), p.grant(0, 1, payload="B")
    d.track("A", "p0", "127.0.0.1", 5600, a, 0)
    d.track("B", "p0", "127.0.0.1", 5600, b, 0)
    drive_handshake(d, 0)
    p.release(hd, [b], 0)  # B is gone on P
    for act in d.poll(10 * S):
        if act.kind == "send":
            reply, _, _ = p.on_message(hd, act.data, 10 * S)
            d.on_message("p0", reply, 10 * S)
    assert p.deadline(a) == 30 * S and p.deadline(b) is None
    assert d.read_check("A", 5.0, 10 * S) == "safe"
    assert [(x.kind, x.request_id) for x in d.poll(10 * S + 1) if x.kind == "lost"] == [("lost", "B")]


# ---------------------------------------------------------------- wire (SPEC §9)


@pytest.mark.parametrize(
    "msg",
    [
        {"type": "heartbeat", "seq": 3, "lease_ids": [1, 2, 3, 900]},
        {"type": "heartbeat_ack", "seq": 3, "lost_ids": []},
        {"type": "release", "lease_ids": [5]},
        {"type": "lease_lost", "lease_ids": [2**64 - 1]},
        {"type": "read_done", "lease_id": 9, "consumer_rank": 1, "n": 2, "digest": bytes(range(16))},
        {"type": "read_done_ack", "lease_id": 9, "live": False},
        {"type": "clock_ping", "seq": 1, "t0": 123},
        {"type": "clock_pong", "seq": 1, "t0": 1, "t1": 2, "t2": 3},
        {
            "type": "hello",
            "engine_id": "p,0",
            "incarnation": 42,
            "agents": [b"a0", b"a1"],
            "info": b"{}",
            "t_send": 5,
            "echo": (1, 2),
            "auth": b"",
        },
    ],
)
def test_spec9_wire_round_trip(msg):
    data = encode(msg)
    assert kvlease.is_kvlease_message(data) and data[2] == kvlease.WIRE_VERSION
    assert decode(data) == msg


def test_spec9_heartbeat_of_consecutive_ids_about_one_byte_per_lease():
    data = encode({"type": "heartbeat", "seq": 1, "lease_ids": list(range(1000, 2000))})
    assert len(data) < 1000 + 16


def test_p7_decoder_total_on_random_bytes():
    import random

    rng = random.Random(14)
    valid = encode({"type": "heartbeat", "seq": 1, "lease_ids": [1, 2, 3]})
    for _ in range(5000):
        n = rng.randrange(0, 40)
        junk = bytes(rng.randrange(256) for _ in range(n))
        if rng.random() < 0.5:
            junk = valid[: rng.randrange(len(valid) + 1)] + junk
        try:
            decode(junk)
        except WireDecodeError:
            pass


def test_s4_prompt_digest_is_16_bytes_and_binds_tokens():
    a = prompt_digest([1, 2, 3])
    assert len(a) == 16 and a == prompt_digest([1, 2, 3]) and a != prompt_digest([1, 2, 4])
    with pytest.raises(OverflowError):
        prompt_digest([-1])
