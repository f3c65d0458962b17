"""``KvleaseConnector``: vLLM's NixlConnector with P's lease bookkeeping done by kvlease's core.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvleaseConnector",
                           "kv_connector_module_path": "kvlease.vllm",
                           "kv_role": "kv_producer", ...}'

Everything but the lease bookkeeping stays vLLM's (NixlConnector's pull mode: handshakes, NIXL
reads, block accounting, the ``HB:`` heartbeats D sends). What changes, on P's worker:

* vLLM keeps ``_reqs_to_send`` (request id -> deadline) in a dict and scans **all** of it on every
  step for expired entries (O(live) per step, idle or not). Here that dict is a
  :class:`LeaseBook`: each entry is a lease in kvlease's :class:`~kvlease.LeaseTable`, expiry
  comes from the table's timing wheel in deadline order (SPEC P4; vLLM #58222), and a step with
  nothing due costs O(1).
* A heartbeat renews through the table (SPEC P2: ``max(deadline, now + E)``). Request ids the
  table does not know are counted as answered-lost (SPEC P6) — vLLM's text heartbeat has no
  answer channel, so a stock vLLM D only sees it in P's log and metrics.

D's side is vLLM's unchanged (its scheduler batches ``HB:`` heartbeats per P engine): a stock
vLLM D renews a kvlease P and a kvlease D renews a stock vLLM P, with the same text messages.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator

from kvlease._core import LeaseConfig, LeaseTable

try:  # vLLM is optional for `import kvlease`, required for this module.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPullConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
except ImportError as e:  # pragma: no cover - exercised only without vLLM
    raise ImportError("kvlease.vllm needs vLLM (pip install vllm); the rest of kvlease does not") from e

logger = logging.getLogger("kvlease.vllm")

__all__ = ["KvleaseConnector", "KvleaseConnectorWorker", "LeaseBook", "lease_config_of"]


def lease_config_of(vllm_config: Any) -> LeaseConfig:
    """The lease parameters of a vLLM config's ``kv_connector_extra_config`` (SPEC §2), parsed
    by kvlease's core: invalid values raise :class:`kvlease.ConfigInvalid` naming the key at
    start-up instead of misbehaving later; unknown keys are logged."""
    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {})
    cfg, warnings = LeaseConfig.from_extra_config(extra)
    for w in warnings:
        logger.info("kvlease: %s", w)
    return cfg


class LeaseBook:
    """vLLM's ``_reqs_to_send`` mapping (request id -> deadline on ``time.perf_counter()``),
    backed by a kvlease :class:`~kvlease.LeaseTable`.

    Supports exactly what vLLM's NIXL worker does with the dict (``in``, ``[req] = deadline``,
    ``pop``, ``del``, ``len``, iteration) plus :meth:`renew` and :meth:`expired`, which replace
    vLLM's heartbeat loop and expiry sweep. All of P's leases are held by one holder: vLLM's
    text heartbeats do not say which D engine sent them, so SPEC S5 is not enforced here (as in
    vLLM).
    """

    __slots__ = ("table", "_holder", "_lease_of", "_due", "unknown_renewals")

    def __init__(self, config: LeaseConfig, capacity: int = 0) -> None:
        self.table = LeaseTable(config, capacity)
        self._holder = self.table.holder("vllm")
        self._lease_of: dict[str, int] = {}
        # Leases a renewal found past their deadline (released by the table as expired on the
        # spot); handed out by the next expired().
        self._due: list[str] = []
        #: SPEC P6: heartbeat names the table did not know (unknown, released or expired).
        self.unknown_renewals = 0

    # -- the dict protocol vLLM's worker uses ---------------------------------------------
    def __contains__(self, req_id: object) -> bool:
        return req_id in self._lease_of

    def __len__(self) -> int:
        return len(self._lease_of)

    def __bool__(self) -> bool:
        return bool(self._lease_of)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._lease_of))

    def __getitem__(self, req_id: str) -> float:
        lease = self._lease_of[req_id]
        deadline = self.table.deadline(lease)
        if deadline is None:  # pragma: no cover - the book and the table agree
            raise KeyError(req_id)
        return time.perf_counter() + (deadline - time.monotonic_ns()) / 1e9

    def __setitem__(self, req_id: str, deadline: float) -> None:
        """SPEC P1: grant a lease for ``req_id`` until ``deadline`` (``time.perf_counter()``
        seconds, as vLLM computes it: now + ``kv_lease_duration``)."""
        now = time.monotonic_ns()
        if req_id in self._lease_of:
            self.pop(req_id)
        lifetime = max(deadline - time.perf_counter(), 1e-9)
        self._lease_of[req_id] = self.table.grant(now, 1, payload=req_id, lifetime=lifetime)

    def __delitem__(self, req_id: str) -> None:
        if req_id not in self._lease_of:
            raise KeyError(req_id)
        self.pop(req_id)

    def pop(self, req_id: str, default: Any = None) -> Any:
        """The lease ends: the read completed (or vLLM dropped the request)."""
        lease = self._lease_of.pop(req_id, None)
        if lease is None:
            return default
        self.table.release(self._holder, [lease], time.monotonic_ns())
        return default

    def items(self) -> list[tuple[str, float]]:
        return [(r, self[r]) for r in self._lease_of]

    # -- what replaces vLLM's loops -------------------------------------------------------
    def renew(self, req_ids: list[str]) -> int:
        """SPEC P2, P6: a heartbeat named ``req_ids``: each live lease's deadline becomes
        ``max(deadline, now + E)``. Returns how many were renewed; names not live are counted in
        ``unknown_renewals``."""
        lease_of = self._lease_of
        ids = []
        for r in req_ids:
            lease = lease_of.get(r)
            if lease is None:
                self.unknown_renewals += 1
            else:
                ids.append(lease)
        if not ids:
            return 0
        renewed, lost, released = self.table.renew(self._holder, ids, time.monotonic_ns())
        for rel in released:  # found past their deadline: expired now
            self._due.append(rel.payload)
        return renewed

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


class KvleaseConnectorWorker(NixlPullConnectorWorker):
    """vLLM's pull-mode NIXL worker with ``_reqs_to_send`` a :class:`LeaseBook`."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.kvlease_config = lease_config_of(vllm_config)
        self._reqs_to_send = LeaseBook(self.kvlease_config)  # type: ignore[assignment]

    def _handle_heartbeat(self, payload: str) -> None:
        """vLLM's ``HB:req1,req2`` heartbeat, applied by kvlease's table (SPEC P2, P6)."""
        self._reqs_to_send.renew(payload.split(","))  # type: ignore[attr-defined]

    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        """SPEC P4: expired leases, in deadline order, O(1) when none is due. The bookkeeping
        per expired request is vLLM's (counters, stats, ``done_sending``)."""
        for req_id in self._reqs_to_send.expired():  # type: ignore[attr-defined]
            count = self.consumer_notification_counts_by_req.pop(req_id, 0)
            self.expected_consumer_notifications_by_req.pop(req_id, None)
            self.xfer_stats.record_kv_expired_req()
            logger.warning(
                "Releasing expired KV blocks for request %s which were retrieved by %d remote worker(s) before lease expired.",
                req_id,
                count,
            )
            self._reqs_to_process.discard(req_id)
            done_sending.add(req_id)


class KvleaseConnector(NixlPullConnector):
    """vLLM's ``NixlConnector`` (pull mode) with P's leases kept by kvlease's core.

    Scheduler side: vLLM's, unchanged, except that the lease config is validated by kvlease at
    start-up. Worker side: :class:`KvleaseConnectorWorker`.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        # Refuse a bad lease config before anything starts (vLLM would take int() of it later).
        lease_config_of(vllm_config)
        # NixlPullConnector.__init__ with our worker class (one NIXL agent, not two).
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = KvleaseConnectorWorker(vllm_config, self.engine_id, kv_cache_config)


# vLLM's scheduler class, re-exported for tests that compare the two connectors.
KvleaseConnectorScheduler = NixlPullConnectorScheduler
