"""kvlease's control channel between a vLLM decoder (D) and prefiller (P): one TCP connection per
(D worker, P worker), carrying kvlease's binary messages (SPEC §9) both ways.

Why not NIXL notifications, which vLLM's own heartbeats use: inside real ``vllm serve``
processes on a loaded host, messages between P and D sent as NIXL notifications arrived 20-50 s
late now and then (issue 25, RELIABILITY.md), and for a P to answer D over NIXL it had to load
D's agent and open connections back to it, which vLLM's pull mode never does. kvlease's D waits
for P's answers (an acknowledged renewal before a read, P's confirmation after it), so they
travel here: a P worker's thread answers at once, whether or not its engine is stepping.

Framing only: each message is a 4-byte big-endian length and that many bytes (a kvlease wire
message). What the messages mean is decided by kvlease's core (``LeaseTable``, ``Renewer``)
and the connector; this module moves bytes and reports who sent them.

* :class:`ControlServer` — P: listens, gives each accepted connection a reader thread, and
  calls ``on_frame(peer, data)`` for every message; ``peer.send`` answers on that connection.
* :class:`ControlLink` — D: one connection to one P worker, a reader thread calling
  ``on_frame(data)`` for every answer and ``on_close()`` once it is over, ``send`` from any
  thread.

Their threads run on the CPUs they are given (:func:`spawn`), not only on the core vLLM's CPU
worker pins its own thread to.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from typing import Callable, Iterable

logger = logging.getLogger("vllm.kvlease")

#: The largest message either side accepts; a longer length prefix closes the connection (a
#: heartbeat batch of every lease a D holds toward a P is far smaller).
MAX_FRAME = 1 << 20
#: How long a send may block on a full socket before the connection is given up.
SEND_TIMEOUT_S = 2.0
#: How long D waits for a P worker's control port to accept a connection.
CONNECT_TIMEOUT_S = 1.0
#: The most connections a P worker serves at once (a thread each): one per D worker that reads
#: from it is the need; beyond the cap a new connection is closed at once (its D retries on its
#: next send), so a flood of connections cannot take a P worker's threads and memory.
MAX_PEERS = 512
#: How long a new connection may take to send its first message (D's Hello, sent as it
#: connects): a connection that says nothing is closed, so idle ones cannot fill MAX_PEERS.
FIRST_MESSAGE_TIMEOUT_S = 5.0

_LEN = struct.Struct(">I")


def spawn(target: Callable[[], None], name: str, cpus: Iterable[int] | None = None) -> threading.Thread:
    """Starts a daemon thread running ``target`` on ``cpus`` (any CPU of the set; ``None``: the
    CPUs of the thread that starts it). vLLM's CPU worker pins its thread to one core per NUMA
    node before the connector starts threads, and every thread it starts inherits that: on a
    2-core host with P and D on it, kvlease's threads shared one core with both engines' busy
    loops and went unscheduled for seconds (issue 25)."""
    wanted = set(cpus) if cpus is not None else None

    def run() -> None:
        if wanted and hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, wanted)
            except OSError:
                logger.debug("kvlease: thread %s cannot run on CPUs %s", name, sorted(wanted), exc_info=True)
        target()

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t


class FrameError(Exception):
    """The peer sent a length prefix over :data:`MAX_FRAME`: the stream cannot be trusted."""


def frame(data: bytes) -> bytes:
    """``data`` with its length prefix."""
    if len(data) > MAX_FRAME:
        raise FrameError(f"a message of {len(data)} bytes is over the control channel's limit of {MAX_FRAME}")
    return _LEN.pack(len(data)) + data


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket) -> bytes | None:
    """The next message, or ``None`` once the peer closed the connection."""
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise FrameError(f"the peer announced a message of {n} bytes, over the limit of {MAX_FRAME}")
    return _recv_exact(sock, n)


class _Conn:
    """A connected socket: sends serialized by a lock, from any thread."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Blocking reads on the reader thread; a send gives up after SEND_TIMEOUT_S (the kernel's
        # send timeout: a Python socket timeout would apply to the reads as well).
        sock.settimeout(None)
        secs = int(SEND_TIMEOUT_S)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", secs, int((SEND_TIMEOUT_S - secs) * 1e6)))
        self.sock = sock
        self.name = name
        self._lock = threading.Lock()
        self.closed = False

    def send(self, data: bytes) -> bool:
        """Sends one message; ``False`` (and the connection closed) when it could not."""
        if self.closed:
            return False
        try:
            with self._lock:
                self.sock.sendall(frame(data))
            return True
        except (OSError, FrameError):
            logger.debug("kvlease: control connection %s: send failed", self.name, exc_info=True)
            self.close()
            return False

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _read_loop(self, on_frame: Callable[[bytes], None], first_timeout: float | None = None) -> None:
        """Reads until the peer closes (or breaks framing, or sends nothing within
        ``first_timeout`` seconds of the start)."""
        try:
            while True:
                if first_timeout is not None:
                    self.sock.settimeout(first_timeout)
                data = read_frame(self.sock)
                if first_timeout is not None:
                    self.sock.settimeout(None)
                    first_timeout = None
                if data is None:
                    break
                try:
                    on_frame(data)
                except Exception:  # a bug in a handler must not kill the connection silently
                    logger.exception("kvlease: control connection %s: handling a message failed", self.name)
        except FrameError as e:
            logger.warning("kvlease: control connection %s closed: %s", self.name, e)
        except TimeoutError:
            logger.debug("kvlease: control connection %s closed: nothing said in time", self.name)
        except OSError:
            pass
        finally:
            self.close()


class Peer(_Conn):
    """One D worker's connection to this P worker, as the server sees it. ``engine_id`` is what
    the D said it is (its Hello), ``None`` until then."""

    engine_id: str | None = None


class ControlServer:
    """P's end: listens on ``(host, port)`` (port 0: one the system picks, :attr:`port`)."""

    def __init__(
        self,
        host: str,
        on_frame: Callable[[Peer, bytes], None],
        port: int = 0,
        cpus: Iterable[int] | None = None,
        max_peers: int = MAX_PEERS,
        first_message_timeout: float = FIRST_MESSAGE_TIMEOUT_S,
    ) -> None:
        self._on_frame = on_frame
        self.max_peers = max_peers
        self.first_message_timeout = first_message_timeout
        #: Connections closed at once because ``max_peers`` were open.
        self.refused = 0
        self._cpus = cpus
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(addr)
        self._sock.listen(128)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self._peers: set[Peer] = set()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = spawn(self._accept_loop, "kvlease-control", cpus)

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                break
            peer = Peer(sock, f"{addr[0]}:{addr[1]}")
            with self._lock:
                # Accepted while close() ran (a blocked accept still takes what was queued):
                # closed here, as close() closes the others.
                stopped = self._stopped
                full = len(self._peers) >= self.max_peers
                if not full and not stopped:
                    self._peers.add(peer)
            if stopped:
                peer.close()
                break
            if full:
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    logger.warning("kvlease: control channel: %d connections open, the most it serves; closed %s (%d so far)", self.max_peers, peer.name, self.refused)
                peer.close()
                continue
            spawn(lambda: self._serve(peer), "kvlease-control-peer", self._cpus)

    def _serve(self, peer: Peer) -> None:
        try:
            peer._read_loop(lambda data: self._on_frame(peer, data), self.first_message_timeout)
        finally:
            with self._lock:
                self._peers.discard(peer)

    def close(self) -> None:
        with self._lock:
            self._stopped = True
        try:
            # Wakes the accept loop (closing alone leaves a blocked accept() running, and it can
            # still take a queued connection).
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            peers = list(self._peers)
        for p in peers:
            p.close()


class ControlLink(_Conn):
    """D's end: a connection to one P worker's control port. ``hello`` is sent first (it tells P
    which D engine this is, SPEC S5); answers go to ``on_frame`` on the link's reader thread."""

    def __init__(
        self,
        host: str,
        port: int,
        hello: bytes,
        on_frame: Callable[[bytes], None],
        cpus: Iterable[int] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        super().__init__(sock, f"{host}:{port}")
        if not self.send(hello):
            raise OSError(f"the kvlease control port {host}:{port} closed on our Hello")
        spawn(lambda: self._read_then(on_frame, on_close), "kvlease-control-link", cpus)

    def _read_then(self, on_frame: Callable[[bytes], None], on_close: Callable[[], None] | None) -> None:
        """Reads until the connection is over, then calls ``on_close`` (once, after every answer
        that arrived was handed to ``on_frame``): nothing more will come on it."""
        try:
            self._read_loop(on_frame)
        finally:
            if on_close is not None:
                try:
                    on_close()
                except Exception:
                    logger.exception("kvlease: control connection %s: handling its close failed", self.name)
