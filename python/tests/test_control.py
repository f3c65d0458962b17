"""kvlease's control channel (``kvlease.control``, issue 25): the TCP connection a vLLM decoder's
connector keeps to each prefiller worker for kvlease's messages. Real sockets on loopback; waits
are on conditions with deadlines. What the messages mean is tested with the connector."""

import socket
import struct
import time

import pytest

from kvlease import control
from kvlease.control import MAX_FRAME, ControlLink, ControlServer, FrameError, frame

DEADLINE = 10.0


def wait_for(cond, what, timeout=DEADLINE):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def echo():
    """A server that records what each peer said and answers each message with it reversed."""
    got = []

    def on_frame(peer, data):
        got.append((peer, data))
        if data == b"hello":
            peer.engine_id = "d-engine"
        else:
            peer.send(data[::-1])

    server = ControlServer("127.0.0.1", on_frame)
    yield server, got
    server.close()


def test_messages_go_both_ways_in_order_hello_first(echo):
    """The link's Hello is the first message the server sees on the connection; every message
    arrives whole and in order (several in one TCP segment too), and answers come back on the
    same connection to the link's reader."""
    server, got = echo
    answers = []
    link = ControlLink("127.0.0.1", server.port, b"hello", answers.append)
    msgs = [b"a", b"", bytes(range(256)) * 40, b"xyz"]
    for m in msgs:
        assert link.send(m)
    wait_for(lambda: len(answers) == len(msgs), "every answer")
    assert [d for _, d in got] == [b"hello", *msgs]
    assert {p.engine_id for p, _ in got} == {"d-engine"}, "one connection, which said who it is"
    assert answers == [m[::-1] for m in msgs]
    link.close()


def test_a_length_over_the_limit_closes_the_connection_and_loses_nothing_else(echo):
    """Bad input: a peer announcing a message over MAX_FRAME is cut off (its stream cannot be
    trusted); the server keeps serving everyone else. Sending one is refused locally, naming
    the limit."""
    server, got = echo
    raw = socket.create_connection(("127.0.0.1", server.port))
    raw.sendall(struct.pack(">I", MAX_FRAME + 1) + b"x")
    raw.settimeout(DEADLINE)
    assert raw.recv(1) == b"", "the server closed the connection"
    raw.close()
    with pytest.raises(FrameError, match=str(MAX_FRAME)):
        frame(bytes(MAX_FRAME + 1))
    answers = []
    link = ControlLink("127.0.0.1", server.port, b"hello", answers.append)
    assert link.send(b"ok")
    wait_for(lambda: answers == [b"ko"], "another peer still served")
    link.close()


def test_a_closed_peer_makes_send_fail_not_hang(echo):
    """Once the server is gone, a send on the link reports failure (the connector then counts the
    message as not sent and reconnects next time) within the send timeout, never blocking."""
    server, _ = echo
    link = ControlLink("127.0.0.1", server.port, b"hello", lambda d: None)
    server.close()
    started = time.monotonic()
    wait_for(lambda: not link.send(b"x"), "a failed send")
    assert link.closed
    assert time.monotonic() - started < control.SEND_TIMEOUT_S + 1


def test_connecting_to_a_port_nobody_listens_on_raises_oserror():
    """D's connector catches OSError and logs which P it could not reach."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError):
        ControlLink("127.0.0.1", port, b"hello", lambda d: None)


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="Linux only")
def test_threads_run_on_the_cpus_they_are_given_not_the_starters():
    """Issue 25: vLLM's CPU worker pins its thread to one core per NUMA node before the
    connector starts its threads, and a thread inherits its starter's CPUs: kvlease's renewer and
    control threads shared one core with both engines' busy loops and went unscheduled for
    seconds. A thread `spawn` starts runs on the CPUs it is given, whatever its starter's."""
    import os
    import threading

    every = os.sched_getaffinity(0)
    one = {min(every)}
    seen = {}
    done = threading.Event()

    def starter():
        os.sched_setaffinity(0, one)  # as vLLM's worker does to its thread
        control.spawn(lambda: (seen.update(given=os.sched_getaffinity(0)), done.set()), "given", every)
        control.spawn(lambda: seen.update(inherited=os.sched_getaffinity(0)), "inherited").join()

    t = threading.Thread(target=starter)
    t.start()
    t.join()
    assert done.wait(DEADLINE)
    assert seen == {"given": every, "inherited": one}


def test_connections_past_the_cap_are_closed_and_the_open_ones_keep_working():
    """A P worker serves at most ``max_peers`` connections (a thread each): one more is closed at
    once and counted, the ones open still answer, and once one closes a new one is served."""
    server = ControlServer("127.0.0.1", lambda peer, data: peer.send(data), max_peers=2)
    try:
        answers: list[list[bytes]] = [[], []]
        links = [ControlLink("127.0.0.1", server.port, b"hello", answers[i].append) for i in range(2)]
        wait_for(lambda: len(server._peers) == 2, "both connections served")
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE)
        wait_for(lambda: server.refused == 1, "the third connection refused")
        assert extra.recv(1) == b"", "closed by P without a word"
        extra.close()
        for i, link in enumerate(links):
            assert link.send(b"x%d" % i)
        wait_for(lambda: answers == [[b"hello", b"x0"], [b"hello", b"x1"]], "the open connections' answers")
        links[0].close()
        wait_for(lambda: len(server._peers) == 1, "the closed connection gone")
        again: list[bytes] = []
        link = ControlLink("127.0.0.1", server.port, b"hello", again.append)
        wait_for(lambda: again == [b"hello"], "a new connection served once there is room")
        link.close()
        links[1].close()
    finally:
        server.close()


def test_a_links_close_is_reported_once_after_every_answer(echo):
    """D learns when a link is over (P died or dropped it): ``on_close`` is called once, after
    every answer that arrived was handed over, so a caller waiting for an answer on that link
    can stop waiting (the connector fails such reads at once)."""
    server, _ = echo
    answers: list[bytes] = []
    closed: list[int] = []
    link = ControlLink("127.0.0.1", server.port, b"hello", answers.append, on_close=lambda: closed.append(len(answers)))
    assert link.send(b"ab")
    wait_for(lambda: answers == [b"ba"], "the answer")
    server.close()
    wait_for(lambda: closed, "the close to be reported")
    assert closed == [1], "once, after the answer"
    assert not link.send(b"cd"), "nothing goes on a closed link"


def test_a_connection_that_says_nothing_is_closed_and_frees_its_place():
    """A connection that sends no first message (D's Hello comes as it connects) within the
    timeout is closed, so idle connections cannot hold a P worker's places; one that speaks in
    time is served on and is not cut later for being quiet."""
    server = ControlServer("127.0.0.1", lambda peer, data: peer.send(data), max_peers=1, first_message_timeout=0.3)
    try:
        idle = socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE)
        wait_for(lambda: len(server._peers) == 1, "the idle connection taken")
        assert idle.recv(1) == b"", "closed by P"
        idle.close()
        wait_for(lambda: not server._peers, "its place freed")
        answers: list[bytes] = []
        link = ControlLink("127.0.0.1", server.port, b"hello", answers.append)
        wait_for(lambda: answers == [b"hello"], "the Hello answered")
        time.sleep(0.6)  # past the first-message timeout: a connection that spoke stays
        assert link.send(b"later")
        wait_for(lambda: answers == [b"hello", b"later"], "served after a quiet spell")
        link.close()
    finally:
        server.close()
