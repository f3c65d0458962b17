//! `kvlease._core`: Python bindings of kvlease-core (issue 14).
//!
//! Thin wrappers only: every protocol rule stays in kvlease-core. Time crosses the boundary as
//! integer nanoseconds on the caller's monotonic clock (`time.monotonic_ns()`), lease ids as
//! Python ints, messages as `bytes` (the SPEC §9 wire) or as dicts (`encode` / `decode`).
//! Bad input raises a Python exception (`KvleaseError` and its subclasses, `TypeError`,
//! `OverflowError`); nothing here panics on outside input. Batch operations (renew, release,
//! tick, on_message, poll, heartbeat chunking) run with the GIL released.

use kvlease_core::config::{ConfigError, KvRole, KvTransferConfig, LeaseConfig, LoadFailurePolicy};
use kvlease_core::digest::PromptDigest;
use kvlease_core::issued::{IssuedLeases, Issuer};
use kvlease_core::lease_table::{Answer, Completion, Holder, LeaseTable, ReleaseReason, Released};
use kvlease_core::pull::{AfterReads, Pull, ReadFailure, Step, Verdict};
use kvlease_core::renewer::{Action, Handshook, ReadCheck, Remote, Renewer, SendKind, Untrack};
use kvlease_core::wire::{self, Hello, Message, WireError};
use kvlease_core::{LeaseId, Nanos};
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};
use std::num::NonZeroU32;
use std::time::Duration;

create_exception!(kvlease, KvleaseError, PyValueError, "Bad input to kvlease (a ValueError).");
create_exception!(kvlease, WireDecodeError, KvleaseError, "Bytes that are not a valid kvlease message (SPEC §9).");
create_exception!(kvlease, ConfigInvalid, KvleaseError, "A kv-transfer-config kvlease refuses (SPEC §2).");

fn wire_err(e: WireError) -> PyErr {
    WireDecodeError::new_err(format!("{}: {e}", e.reason()))
}

fn config_err(e: ConfigError) -> PyErr {
    ConfigInvalid::new_err(e.to_string())
}

fn digest_of(d: Option<&[u8]>) -> PyResult<PromptDigest> {
    match d {
        None => Ok(PromptDigest::default()),
        Some(b) => {
            let arr: [u8; 16] = b.try_into().map_err(|_| KvleaseError::new_err(format!("a prompt digest is 16 bytes, got {}", b.len())))?;
            Ok(PromptDigest(arr))
        }
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn duration_of(name: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|e| KvleaseError::new_err(format!("{name}: {s} s is not a duration: {e}")))
}

/// The config given, or the default one (L = 30 s).
fn config_or_default(config: Option<&PyLeaseConfig>) -> LeaseConfig {
    config.map(|c| c.inner.clone()).unwrap_or_default()
}

fn holder_of(h: u32) -> PyResult<Holder> {
    NonZeroU32::new(h).map(Holder).ok_or_else(|| KvleaseError::new_err("holder 0 does not exist: use LeaseTable.holder(engine)"))
}

// ---------------------------------------------------------------- config

/// The lease parameters (SPEC §2): L, I = L/6, E = 2L/3 and the rest, all in seconds.
#[pyclass(module = "kvlease._core", frozen, name = "LeaseConfig")]
#[derive(Clone)]
struct PyLeaseConfig {
    inner: LeaseConfig,
}

#[pymethods]
impl PyLeaseConfig {
    /// The defaults of SPEC §2 with lease duration ``lease_duration`` seconds (30 by default).
    #[new]
    #[pyo3(signature = (lease_duration = 30.0))]
    fn new(lease_duration: f64) -> PyResult<Self> {
        LeaseConfig::with_lease_secs(lease_duration).map(|inner| PyLeaseConfig { inner }).map_err(config_err)
    }

    /// Parses a ``kv_connector_extra_config`` dict (``kv_lease_duration``, ``kv_lease_max_lifetime``,
    /// ``max_notif_bytes``, ...). Returns the config and warnings for unknown keys; raises
    /// ``ConfigInvalid`` for invalid values.
    #[staticmethod]
    #[pyo3(signature = (extra = None))]
    fn from_extra_config(py: Python<'_>, extra: Option<&Bound<'_, PyAny>>) -> PyResult<(PyLeaseConfig, Vec<String>)> {
        let top = PyDict::new(py);
        if let Some(e) = extra {
            top.set_item("kv_connector_extra_config", e)?;
        }
        let (cfg, warnings) = parse_config(py, top.as_any())?;
        Ok((PyLeaseConfig { inner: cfg.lease }, warnings))
    }

    /// L, seconds.
    #[getter]
    fn lease_duration(&self) -> f64 {
        secs(self.inner.lease_duration)
    }
    /// I, seconds: D sends at most one heartbeat per P engine per interval.
    #[getter]
    fn heartbeat_interval(&self) -> f64 {
        secs(self.inner.heartbeat_interval)
    }
    /// E, seconds: a heartbeat sets ``deadline = max(deadline, now + E)``.
    #[getter]
    fn extension(&self) -> f64 {
        secs(self.inner.extension)
    }
    /// SPEC P9: no renewal pushes a deadline past grant + this, seconds; None for no cap.
    #[getter]
    fn max_lifetime(&self) -> Option<f64> {
        self.inner.max_lifetime.map(secs)
    }
    /// SPEC B1, seconds.
    #[getter]
    fn decoder_kv_blocks_ttl(&self) -> f64 {
        secs(self.inner.decoder_kv_blocks_ttl)
    }
    #[getter]
    fn bidirectional(&self) -> bool {
        self.inner.bidirectional
    }
    #[getter]
    fn kv_recompute_threshold(&self) -> u32 {
        self.inner.kv_recompute_threshold
    }
    /// ``"recompute"`` or ``"fail"`` (SPEC D6).
    #[getter]
    fn load_failure_policy(&self) -> &'static str {
        match self.inner.load_failure_policy {
            LoadFailurePolicy::Recompute => "recompute",
            LoadFailurePolicy::Fail => "fail",
        }
    }
    /// SPEC D2: the largest notification, bytes.
    #[getter]
    fn max_notif_bytes(&self) -> usize {
        self.inner.max_notif_bytes
    }
    /// SPEC P4: how late after its deadline a lease may be reaped, seconds.
    #[getter]
    fn reap_granularity(&self) -> f64 {
        secs(self.inner.reap_granularity())
    }
    /// SPEC D6: D reads only while an acknowledged heartbeat covers this much more, seconds.
    #[getter]
    fn read_budget(&self) -> f64 {
        secs(self.inner.read_budget())
    }
    /// SPEC D6: how long D waits for P's answer to a renewal before giving up on a lease, seconds.
    #[getter]
    fn ack_wait(&self) -> f64 {
        secs(self.inner.ack_wait())
    }
    /// SPEC P5, D6: how long D waits for P to confirm a completed read before giving up on its
    /// bytes, seconds.
    #[getter]
    fn read_done_ack_wait(&self) -> f64 {
        secs(self.inner.read_done_ack_wait())
    }
    fn __repr__(&self) -> String {
        format!(
            "LeaseConfig(lease_duration={}, heartbeat_interval={}, extension={}, max_lifetime={:?})",
            self.lease_duration(),
            self.heartbeat_interval(),
            self.extension(),
            self.max_lifetime()
        )
    }
}

/// A parsed ``--kv-transfer-config`` (SPEC §2).
#[pyclass(module = "kvlease._core", frozen, get_all, name = "KvTransferConfig")]
struct PyKvTransferConfig {
    kv_connector: String,
    /// ``"kv_producer"``, ``"kv_consumer"`` or ``"kv_both"``.
    kv_role: &'static str,
    engine_id: Option<String>,
    lease: Py<PyLeaseConfig>,
    /// Unknown keys, ignored: log them.
    warnings: Vec<String>,
}

fn parse_config(py: Python<'_>, config: &Bound<'_, PyAny>) -> PyResult<(KvTransferConfig, Vec<String>)> {
    let text: String = if let Ok(s) = config.cast::<PyString>() {
        s.to_str()?.to_owned()
    } else {
        // vLLM hands its config around as dicts: serialize with Python's own json, so any
        // JSON-able value gets the same treatment as on vLLM's command line.
        let json = py.import("json")?;
        json.call_method1("dumps", (config,))?.extract()?
    };
    KvTransferConfig::parse(&text).map_err(config_err)
}

/// Parses a ``--kv-transfer-config`` (a dict, or its JSON text). Raises ``ConfigInvalid`` for
/// invalid values; unknown keys come back in ``warnings``.
#[pyfunction]
fn parse_kv_transfer_config(py: Python<'_>, config: &Bound<'_, PyAny>) -> PyResult<PyKvTransferConfig> {
    let (cfg, warnings) = parse_config(py, config)?;
    Ok(PyKvTransferConfig {
        kv_connector: cfg.kv_connector,
        kv_role: match cfg.kv_role {
            KvRole::Producer => "kv_producer",
            KvRole::Consumer => "kv_consumer",
            KvRole::Both => "kv_both",
        },
        engine_id: cfg.engine_id,
        lease: Py::new(py, PyLeaseConfig { inner: cfg.lease })?,
        warnings,
    })
}

// ---------------------------------------------------------------- lease table

/// A lease that just ended (SPEC P3): its id, why (``"transferred"``, ``"released"``,
/// ``"expired"``, ``"shutdown"``), its payload, blocks, and how long it was held (seconds).
#[pyclass(module = "kvlease._core", frozen, get_all, name = "Released")]
struct PyReleased {
    lease_id: LeaseId,
    reason: &'static str,
    payload: Option<Py<PyAny>>,
    blocks: u32,
    held: f64,
}

#[pymethods]
impl PyReleased {
    fn __repr__(&self) -> String {
        format!("Released(lease_id={}, reason={:?}, blocks={}, held={})", self.lease_id, self.reason, self.blocks, self.held)
    }
}

/// A lease's payload in the table: the prompt's digest (SPEC S4, checked by the table through
/// `LeasePayload`) and the Python object.
type Payload = (PromptDigest, Py<PyAny>);

fn released_list(v: Vec<Released<Payload>>) -> Vec<PyReleased> {
    v.into_iter()
        .map(|r| PyReleased {
            lease_id: r.lease_id,
            reason: r.reason.as_str(),
            payload: r.payload.map(|(_, p)| p),
            blocks: r.blocks,
            held: secs(r.held),
        })
        .collect()
}

/// Decodes a wire message and applies it with the GIL released: the reply's bytes, how many
/// leases it renewed, and the leases it ended. Raises ``WireDecodeError`` for bytes that are not
/// a message.
fn on_wire(
    py: Python<'_>,
    data: &[u8],
    apply: impl FnOnce(&Message, &mut Vec<Released<Payload>>) -> Answer + Send,
) -> PyResult<(Option<Py<PyBytes>>, usize, Vec<PyReleased>)> {
    let data = data.to_vec();
    let (reply, renewed, released) = py
        .detach(move || {
            let msg = Message::decode(&data)?;
            let mut released = Vec::new();
            let a = apply(&msg, &mut released);
            Ok::<_, WireError>((a.reply.map(|m| m.encode()), a.renewed, released))
        })
        .map_err(wire_err)?;
    Ok((reply.map(|b| PyBytes::new(py, &b).unbind()), renewed, released_list(released)))
}

/// Runs `f` with the GIL released and returns what it ended.
fn ending(py: Python<'_>, f: impl FnOnce(&mut Vec<Released<Payload>>) + Send) -> Vec<PyReleased> {
    let released = py.detach(move || {
        let mut released = Vec::new();
        f(&mut released);
        released
    });
    released_list(released)
}

/// A renewal with the GIL released: ``(renewed, lost_ids, released)``.
fn renewing(
    py: Python<'_>,
    f: impl FnOnce(&mut Vec<LeaseId>, &mut Vec<Released<Payload>>) -> usize + Send,
) -> (usize, Vec<LeaseId>, Vec<PyReleased>) {
    let (n, lost, released) = py.detach(move || {
        let (mut lost, mut released) = (Vec::new(), Vec::new());
        let n = f(&mut lost, &mut released);
        (n, lost, released)
    });
    (n, lost, released_list(released))
}

/// P's lease table (SPEC §4): grant, renew, complete, release, expire — each exactly once.
///
/// Each lease owns a payload (any Python object, e.g. the request id), handed back in the
/// ``Released`` record when it ends. Expiry is in deadline order whatever the grant order, and
/// an idle ``tick`` is O(1) (SPEC P4). Holders (SPEC S5) are small ints from ``holder(engine)``.
#[pyclass(module = "kvlease._core", name = "LeaseTable")]
struct PyLeaseTable {
    table: LeaseTable<Payload>,
}

#[pymethods]
impl PyLeaseTable {
    #[new]
    #[pyo3(signature = (config = None, capacity = 0))]
    fn new(config: Option<&PyLeaseConfig>, capacity: usize) -> Self {
        let cfg = config_or_default(config);
        PyLeaseTable { table: LeaseTable::with_capacity(&cfg, capacity) }
    }

    /// SPEC S5: the holder for an engine as the transport authenticated it; the same name always
    /// gets the same holder.
    fn holder(&mut self, engine: &str) -> u32 {
        self.table.holder(engine).0.get()
    }

    /// SPEC P1: grant a lease of L from ``now_ns`` over ``blocks`` blocks of the prompt whose
    /// 16-byte digest is ``digest`` (S4; None for none), owning ``payload``. Returns its id.
    #[pyo3(signature = (now_ns, blocks, digest = None, payload = None, lifetime = None))]
    fn grant(
        &mut self,
        py: Python<'_>,
        now_ns: u64,
        blocks: u32,
        digest: Option<&[u8]>,
        payload: Option<Py<PyAny>>,
        lifetime: Option<f64>,
    ) -> PyResult<LeaseId> {
        let d = digest_of(digest)?;
        let payload = payload.unwrap_or_else(|| py.None());
        Ok(match lifetime {
            None => self.table.grant(Nanos(now_ns), blocks, (d, payload)),
            Some(s) => self.table.grant_for(Nanos(now_ns), duration_of("lifetime", s)?, blocks, (d, payload)),
        })
    }

    /// SPEC P2, P6: renew ``ids`` for ``holder`` to ``max(deadline, now + E)``. Returns
    /// ``(renewed, lost_ids, released)``: ids not live (or not the holder's) are lost; ones found
    /// past their deadline are released as expired. Runs without the GIL.
    fn renew(&mut self, py: Python<'_>, holder: u32, ids: Vec<LeaseId>, now_ns: u64) -> PyResult<(usize, Vec<LeaseId>, Vec<PyReleased>)> {
        let h = holder_of(holder)?;
        let table = &mut self.table;
        Ok(renewing(py, move |lost, released| table.renew(h, &ids, Nanos(now_ns), lost, released)))
    }

    /// SPEC D4, P6: D will not read ``ids``: release the live ones. Returns
    /// ``(lost_ids, released)``. Runs without the GIL.
    fn release(&mut self, py: Python<'_>, holder: u32, ids: Vec<LeaseId>, now_ns: u64) -> PyResult<(Vec<LeaseId>, Vec<PyReleased>)> {
        let h = holder_of(holder)?;
        let table = &mut self.table;
        let (lost, released) = py.detach(move || {
            let (mut lost, mut released) = (Vec::new(), Vec::new());
            table.release(h, &ids, Nanos(now_ns), &mut lost, &mut released);
            (lost, released)
        });
        Ok((lost, released_list(released)))
    }

    /// SPEC P8: consumer rank ``consumer`` of ``n`` finished reading lease ``lease_id`` for the
    /// prompt whose digest is ``digest``. Returns ``(outcome, released)``, outcome one of
    /// ``"pending"``, ``"transferred"`` (the lease ended), ``"lost"`` (not live: the bytes read
    /// must not be used).
    #[pyo3(signature = (holder, lease_id, now_ns, consumer = 0, n = 1, digest = None))]
    fn complete(
        &mut self,
        holder: u32,
        lease_id: LeaseId,
        now_ns: u64,
        consumer: u32,
        n: u32,
        digest: Option<&[u8]>,
    ) -> PyResult<(&'static str, Vec<PyReleased>)> {
        let h = holder_of(holder)?;
        let d = digest_of(digest)?;
        let mut released = Vec::new();
        let c = self.table.complete(h, lease_id, consumer, n, d, Nanos(now_ns), &mut released);
        let s = match c {
            Completion::Pending => "pending",
            Completion::Transferred => "transferred",
            Completion::Lost => "lost",
        };
        Ok((s, released_list(released)))
    }

    /// Everything P does with a wire message from ``holder`` (SPEC P2, P3, P6, P8): applies it and
    /// returns ``(reply_bytes_or_None, renewed, released)``. Raises ``WireDecodeError`` for bytes
    /// that are not a message. Runs without the GIL.
    fn on_message(
        &mut self,
        py: Python<'_>,
        holder: u32,
        data: &[u8],
        now_ns: u64,
    ) -> PyResult<(Option<Py<PyBytes>>, usize, Vec<PyReleased>)> {
        let h = holder_of(holder)?;
        let table = &mut self.table;
        on_wire(py, data, move |msg, released| table.on_message(h, msg, Nanos(now_ns), released))
    }

    /// SPEC P4: release every lease whose deadline ≤ ``now_ns``, as expired, in deadline order.
    /// O(1) when nothing is due. Runs without the GIL.
    fn tick(&mut self, py: Python<'_>, now_ns: u64) -> Vec<PyReleased> {
        let table = &mut self.table;
        ending(py, move |released| table.tick(Nanos(now_ns), released))
    }

    /// Like ``tick`` but looks at no more than ``max_work`` index entries. Returns
    /// ``(more_left, released)``.
    fn tick_budget(&mut self, py: Python<'_>, now_ns: u64, max_work: usize) -> (bool, Vec<PyReleased>) {
        let table = &mut self.table;
        let (more, released) = py.detach(move || {
            let mut released = Vec::new();
            let more = table.tick_budget(Nanos(now_ns), max_work, &mut released);
            (more, released)
        });
        (more, released_list(released))
    }

    /// When the next lease may expire (ns), a lower bound; None when no lease is live.
    fn next_expiry(&self) -> Option<u64> {
        self.table.next_expiry().map(|n| n.0)
    }

    /// Engine shutdown: release every live lease as ``"shutdown"``.
    fn shutdown(&mut self, py: Python<'_>, now_ns: u64) -> Vec<PyReleased> {
        let table = &mut self.table;
        ending(py, move |released| table.shutdown(Nanos(now_ns), released))
    }

    /// The payload of a live lease, or None.
    fn get(&self, py: Python<'_>, lease_id: LeaseId) -> Option<Py<PyAny>> {
        self.table.get(lease_id).map(|(_, p)| p.clone_ref(py))
    }

    /// The current deadline (ns) of a live lease (maybe already past, awaiting the reaper).
    fn deadline(&self, lease_id: LeaseId) -> Option<u64> {
        self.table.deadline(lease_id).map(|n| n.0)
    }

    /// Live leases.
    #[getter]
    fn live(&self) -> usize {
        self.table.live()
    }

    fn __len__(&self) -> usize {
        self.table.live()
    }

    /// Blocks pinned by live leases.
    #[getter]
    fn leased_blocks(&self) -> u64 {
        self.table.leased_blocks()
    }

    /// SPEC §11 counters: ``granted``, ``renewals`` and releases by reason.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.table.stats();
        let d = PyDict::new(py);
        d.set_item("granted", s.granted)?;
        d.set_item("renewals", s.renewals)?;
        for r in ReleaseReason::ALL {
            d.set_item(r.as_str(), s.released(r))?;
        }
        Ok(d)
    }
}

/// The ids P's scheduler issues for its leases, in order (kvlease-core's ``Issuer``): one
/// series per life of P (``series``: draw it at random, e.g. ``secrets.randbits(20)``), never
/// the same id twice.
#[pyclass(module = "kvlease._core", name = "IdIssuer")]
struct PyIdIssuer {
    issuer: Issuer,
}

#[pymethods]
impl PyIdIssuer {
    #[new]
    fn new(series: u32) -> Self {
        PyIdIssuer { issuer: Issuer::new(series) }
    }

    /// The next id.
    fn next_id(&mut self) -> u64 {
        self.issuer.next_id()
    }
}

// ---------------------------------------------------------------- pull

fn read_check_of(answer: &str) -> PyResult<ReadCheck> {
    Ok(match answer {
        "safe" => ReadCheck::Safe,
        "renew_first" => ReadCheck::RenewFirst,
        "no_link" => ReadCheck::NoLink,
        "untracked" => ReadCheck::Untracked,
        "unreachable" => ReadCheck::Unreachable,
        other => return Err(KvleaseError::new_err(format!("not an answer of Renewer.read_check: {other:?}"))),
    })
}

/// A verdict as ``(what, kind, why)``: what is ``"use"``, ``"recompute"`` or ``"fail"``; for the
/// last two, ``kind`` names why in a word (``lease_lost``, ``read_unconfirmed``, ...) and ``why``
/// in words.
/// A pull's verdict for Python: what, kind, why.
type PyVerdict = (&'static str, Option<&'static str>, Option<String>);

fn verdict_of(v: Verdict) -> PyVerdict {
    match v {
        Verdict::Use => ("use", None, None),
        Verdict::Recompute(l) => ("recompute", Some(l.kind()), Some(l.to_string())),
        Verdict::Fail(l) => ("fail", Some(l.kind()), Some(l.to_string())),
    }
}

/// D's pull of one request's KV (SPEC D6) as kvlease-core decides it: wait for a live
/// acknowledgement (``check`` with ``Renewer.read_check``'s answer), read (``reading``: the
/// driver posts the reads itself), wait for P's confirmations (``reads_done``,
/// ``on_read_done_ack``, ``on_deadline``). Verdicts are ``(what, kind, why)`` tuples.
#[pyclass(module = "kvlease._core", name = "Pull")]
struct PyPull {
    pull: Pull,
}

#[pymethods]
impl PyPull {
    /// A pull of a lease ``engine_id`` granted, from ``now_ns``. ``link_wait``: a read whose wait
    /// ran out with no link to P yet waits once more within this many seconds of the start
    /// (default: none). ``confirm_within``: how long P's confirmations are waited for (default:
    /// the config's).
    #[new]
    #[pyo3(signature = (config, engine_id, now_ns, incarnation = 0, fenced = false, link_wait = None, confirm_within = None))]
    fn new(
        config: &PyLeaseConfig,
        engine_id: &str,
        now_ns: u64,
        incarnation: u64,
        fenced: bool,
        link_wait: Option<f64>,
        confirm_within: Option<f64>,
    ) -> PyResult<Self> {
        let mut pull = Pull::new(&config.inner, engine_id, incarnation, fenced, Nanos(now_ns));
        if let Some(s) = link_wait {
            pull = pull.waiting_for_link(duration_of("link_wait", s)?);
        }
        if let Some(s) = confirm_within {
            pull = pull.confirming_within(duration_of("confirm_within", s)?);
        }
        Ok(PyPull { pull })
    }

    /// The read budget (seconds): ``Renewer.read_check``'s.
    #[getter]
    fn read_budget(&self) -> f64 {
        secs(self.pull.read_budget())
    }

    /// Step 1, with ``Renewer.read_check``'s answer: ``("read", None, False, None)``,
    /// ``("wait", until_ns, renew, None)`` (``renew``: wake the renewer first) or
    /// ``("lost", None, False, verdict)``.
    fn check(&mut self, answer: &str, now_ns: u64) -> PyResult<(&'static str, Option<u64>, bool, Option<PyVerdict>)> {
        Ok(match self.pull.check(read_check_of(answer)?, Nanos(now_ns)) {
            Step::Read => ("read", None, false, None),
            Step::Wait { until, renew } => ("wait", Some(until.0), renew, None),
            Step::Lost(lost) => ("lost", None, false, Some(verdict_of(self.pull.finish(Err(lost))))),
        })
    }

    /// Step 2 when the driver posts the reads itself: their deadline (ns), or None when the pull
    /// may not read (it is over).
    fn reading(&mut self, now_ns: u64) -> Option<u64> {
        self.pull.reading(Nanos(now_ns)).ok().map(|n| n.0)
    }

    /// Step 3: ``n`` reads landed (``ok``) or failed (``why``). ``("await", until_ns)`` for P's
    /// confirmations, or ``("decided", verdict)``.
    #[pyo3(signature = (ok, n, now_ns, timed_out = false, why = None))]
    fn reads_done(
        &mut self,
        ok: bool,
        n: u32,
        now_ns: u64,
        timed_out: bool,
        why: Option<String>,
    ) -> (&'static str, Option<u64>, Option<PyVerdict>) {
        let result = if ok { Ok(n) } else { Err(ReadFailure::Transport(why.unwrap_or_else(|| "the read failed".into()))) };
        match self.pull.reads_done(result, timed_out, Nanos(now_ns)) {
            AfterReads::AwaitAcks { until } => ("await", Some(until.0), None),
            AfterReads::Decided(v) => ("decided", None, Some(verdict_of(v))),
        }
    }

    /// One ``ReadDoneAck``: the verdict once decided, else None.
    fn on_read_done_ack(&mut self, live: bool) -> Option<PyVerdict> {
        self.pull.on_read_done_ack(live).map(verdict_of)
    }

    /// The deadline the pull gave passed (or its answer cannot come: the link to P closed): the
    /// verdict.
    fn on_deadline(&mut self) -> PyVerdict {
        verdict_of(self.pull.on_deadline())
    }

    /// SPEC D6, P5: the renewer reported the lease lost. The verdict while no read was posted
    /// (never read); ``None`` once the reads were posted or the pull was decided: their
    /// ``ReadDone`` decides (P also ends a lease on its read's own completion).
    fn lease_lost(&mut self) -> Option<PyVerdict> {
        self.pull.on_lease_lost().map(verdict_of)
    }
}

// ---------------------------------------------------------------- issued leases

/// A held message's turn: its holder, the tag of the connection it came on, and the answer's
/// bytes (none for a `Release` that took effect).
type HeldAnswer = (u32, u64, Option<Py<PyBytes>>);

/// P's lease table when another process issues the ids D names leases by (vLLM's scheduler puts
/// one in ``kv_transfer_params``; its worker grants the lease one engine step later): messages
/// name leases by issued ids (``name`` binds one to a lease), ids on their way are neither lost
/// nor renewed and their ``ReadDone``/``Release`` held for the grant (``answer_due``), and a
/// ``ReadDone`` is a question answered from the live lease or from the leases P ended by their
/// read (``end(..., "transferred")``). Every rule is kvlease-core's ``IssuedLeases``.
#[pyclass(module = "kvlease._core", name = "IssuedLeaseTable")]
struct PyIssuedLeaseTable {
    table: IssuedLeases<Payload>,
    /// L, a grant's lifetime unless told otherwise.
    lease: Duration,
}

#[pymethods]
impl PyIssuedLeaseTable {
    #[new]
    #[pyo3(signature = (config = None, capacity = 0))]
    fn new(config: Option<&PyLeaseConfig>, capacity: usize) -> Self {
        let cfg = config_or_default(config);
        PyIssuedLeaseTable { table: IssuedLeases::new(&cfg, capacity), lease: cfg.lease_duration }
    }

    /// SPEC S5: the holder for an engine; the same name always gets the same holder.
    fn holder(&mut self, engine: &str) -> u32 {
        self.table.holder(engine).0.get()
    }

    /// SPEC P1: a lease from ``now_ns`` for ``lifetime`` seconds (L when None) over ``blocks``
    /// blocks, owning ``payload``. Returns the table's id for it (not named yet).
    #[pyo3(signature = (now_ns, blocks, payload = None, lifetime = None))]
    fn grant(&mut self, py: Python<'_>, now_ns: u64, blocks: u32, payload: Option<Py<PyAny>>, lifetime: Option<f64>) -> PyResult<LeaseId> {
        let life = match lifetime {
            None => self.lease,
            Some(s) => duration_of("lifetime", s)?,
        };
        let payload = payload.unwrap_or_else(|| py.None());
        Ok(self.table.grant(Nanos(now_ns), life, blocks, (PromptDigest::default(), payload)))
    }

    /// The id P's scheduler issued for live lease ``lease_id``, named at ``now_ns`` (a renewal of
    /// it that came before is applied now): ``(whether it now names it, released)``.
    fn name(&mut self, lease_id: LeaseId, issued: u64, now_ns: u64) -> (bool, Vec<PyReleased>) {
        let mut released = Vec::new();
        let named = self.table.name(lease_id, issued, Nanos(now_ns), &mut released);
        (named, released_list(released))
    }

    /// The live lease an issued id names, or None.
    fn lease_of(&self, issued: u64) -> Option<LeaseId> {
        self.table.lease_of(issued)
    }

    /// Whether an issued id may be a lease not granted yet (on its way; see the class).
    fn pending(&self, issued: u64) -> bool {
        self.table.pending(issued)
    }

    /// SPEC P2, P6 for the table's own ids: ``(renewed, lost_ids, released)``.
    fn renew(&mut self, py: Python<'_>, holder: u32, ids: Vec<LeaseId>, now_ns: u64) -> PyResult<(usize, Vec<LeaseId>, Vec<PyReleased>)> {
        let h = holder_of(holder)?;
        let table = &mut self.table;
        Ok(renewing(py, move |lost, released| table.renew(h, &ids, Nanos(now_ns), lost, released)))
    }

    /// P ends a lease itself: ``"transferred"`` (its read completed as the transport reported
    /// it; a ReadDone that comes after is confirmed to its holder) or ``"released"``. Returns
    /// ``(was_live, released)``.
    fn end(&mut self, lease_id: LeaseId, reason: &str, now_ns: u64) -> PyResult<(bool, Vec<PyReleased>)> {
        let reason = match reason {
            "transferred" => ReleaseReason::Transferred,
            "released" => ReleaseReason::Released,
            other => return Err(KvleaseError::new_err(format!("reason must be \"transferred\" or \"released\", not {other:?}"))),
        };
        let mut released = Vec::new();
        let live = self.table.end(lease_id, reason, Nanos(now_ns), &mut released);
        Ok((live, released_list(released)))
    }

    /// A wire message from ``holder`` naming leases by issued ids (SPEC P2, P5, P6, D4, S5):
    /// ``(reply_bytes_or_None, renewed, released)``. With ``hold``, a ReadDone or Release of a
    /// lease on its way is held (no reply now); ``tag`` names the connection it came on, and
    /// comes back with its turn in ``answer_due``. Raises ``WireDecodeError`` for bytes that are
    /// not a message. Runs without the GIL.
    #[pyo3(signature = (holder, data, now_ns, hold = true, tag = 0))]
    fn on_message(
        &mut self,
        py: Python<'_>,
        holder: u32,
        data: &[u8],
        now_ns: u64,
        hold: bool,
        tag: u64,
    ) -> PyResult<(Option<Py<PyBytes>>, usize, Vec<PyReleased>)> {
        let h = holder_of(holder)?;
        let table = &mut self.table;
        on_wire(py, data, move |msg, released| table.on_message_from(h, tag, msg, Nanos(now_ns), hold, released))
    }

    /// The held messages due now (their lease named, or no longer possible, or ``max_age``
    /// seconds passed), in arrival order: ``([(holder, tag, reply_bytes_or_None)], released)``.
    fn answer_due(&mut self, py: Python<'_>, now_ns: u64, max_age: f64) -> PyResult<(Vec<HeldAnswer>, Vec<PyReleased>)> {
        let age = duration_of("max_age", max_age)?;
        let mut released = Vec::new();
        let due = self.table.answer_due(Nanos(now_ns), age, &mut released);
        let due = due.into_iter().map(|d| (d.holder.0.get(), d.tag, d.reply.map(|m| PyBytes::new(py, &m.encode()).unbind()))).collect();
        Ok((due, released_list(released)))
    }

    /// SPEC P4: release every lease whose deadline ≤ ``now_ns``, as expired.
    fn tick(&mut self, py: Python<'_>, now_ns: u64) -> Vec<PyReleased> {
        let table = &mut self.table;
        ending(py, move |released| table.tick(Nanos(now_ns), released))
    }

    /// When the next lease may expire (ns), a lower bound; None when no lease is live.
    fn next_expiry(&self) -> Option<u64> {
        self.table.next_expiry().map(|n| n.0)
    }

    /// The payload of a live lease, or None.
    fn get(&self, py: Python<'_>, lease_id: LeaseId) -> Option<Py<PyAny>> {
        self.table.table().get(lease_id).map(|(_, p)| p.clone_ref(py))
    }

    /// The current deadline (ns) of a live lease.
    fn deadline(&self, lease_id: LeaseId) -> Option<u64> {
        self.table.table().deadline(lease_id).map(|n| n.0)
    }

    /// Live leases.
    #[getter]
    fn live(&self) -> usize {
        self.table.table().live()
    }

    fn __len__(&self) -> usize {
        self.table.table().live()
    }

    /// Messages held for their lease's grant now.
    #[getter]
    fn held(&self) -> usize {
        self.table.held()
    }

    /// SPEC §11 counters: ``granted``, ``renewals``, releases by reason, and ``unknown`` (names
    /// not live, P6), ``early_renewals`` (renewals of ids on their way), ``held_total``.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.table.table().stats();
        let d = PyDict::new(py);
        d.set_item("granted", s.granted)?;
        d.set_item("renewals", s.renewals)?;
        for r in ReleaseReason::ALL {
            d.set_item(r.as_str(), s.released(r))?;
        }
        let i = self.table.stats();
        d.set_item("unknown", i.unknown)?;
        d.set_item("early_renewals", i.early_renewals)?;
        d.set_item("held_total", i.held)?;
        Ok(d)
    }
}

// ---------------------------------------------------------------- renewer

/// Something the driver of a ``Renewer`` must do, in order. ``kind`` is one of
/// ``"handshake"`` (engine_id, host, port), ``"send"`` (engine_id, data, send_kind),
/// ``"lost"`` (request_id, lease_id: apply the load failure policy) and ``"forget"``
/// (engine_id, agents).
#[pyclass(module = "kvlease._core", frozen, get_all, name = "Action")]
struct PyAction {
    kind: &'static str,
    engine_id: Option<String>,
    host: Option<String>,
    port: Option<u16>,
    data: Option<Py<PyBytes>>,
    /// ``"heartbeat"``, ``"read_renewal"``, ``"release"`` or ``"clock_probe"``.
    send_kind: Option<&'static str>,
    request_id: Option<String>,
    lease_id: Option<LeaseId>,
    agents: Option<Vec<String>>,
}

#[pymethods]
impl PyAction {
    fn __repr__(&self) -> String {
        format!(
            "Action(kind={:?}, engine_id={:?}, send_kind={:?}, request_id={:?}, lease_id={:?})",
            self.kind, self.engine_id, self.send_kind, self.request_id, self.lease_id
        )
    }
}

fn action(py: Python<'_>, a: Action) -> PyAction {
    let mut p = PyAction {
        kind: "",
        engine_id: None,
        host: None,
        port: None,
        data: None,
        send_kind: None,
        request_id: None,
        lease_id: None,
        agents: None,
    };
    match a {
        Action::Handshake { engine_id, host, port } => {
            p.kind = "handshake";
            p.engine_id = Some(engine_id);
            p.host = Some(host);
            p.port = Some(port);
        }
        Action::Send { engine_id, bytes, kind } => {
            p.kind = "send";
            p.engine_id = Some(engine_id);
            p.data = Some(PyBytes::new(py, &bytes).unbind());
            p.send_kind = Some(match kind {
                SendKind::Heartbeat { .. } => "heartbeat",
                SendKind::ReadRenewal => "read_renewal",
                SendKind::Release => "release",
                SendKind::ClockProbe => "clock_probe",
            });
        }
        Action::Lost { request_id, lease_id } => {
            p.kind = "lost";
            p.request_id = Some(request_id);
            p.lease_id = Some(lease_id);
        }
        Action::Forget { engine_id, agents } => {
            p.kind = "forget";
            p.engine_id = Some(engine_id);
            p.agents = Some(agents);
        }
        // SPEC O4: releases over P's side channel (kvlease's own, which vLLM's does not
        // speak): the connector has none, and lets such leases expire.
        Action::ReleaseOverSideChannel(r) => {
            p.kind = "release_over_side_channel";
            p.engine_id = Some(r.engine_id);
            p.host = Some(r.host);
            p.port = Some(r.port);
        }
        Action::DuplicateEngine { engine_id, .. } => {
            p.kind = "duplicate_engine";
            p.engine_id = Some(engine_id);
        }
    }
    p
}

/// D's side of the lease (SPEC §5): tracks requests from arrival, renews their leases with one
/// batched heartbeat per P engine per interval, learns from P's acknowledgements whether a lease
/// is safely live before reading, and releases at once what will never be read. Polled:
/// ``poll(now_ns)`` returns the actions due, ``poll_timeout()`` when to poll next.
#[pyclass(module = "kvlease._core", name = "Renewer")]
struct PyRenewer {
    renewer: Renewer,
}

#[pymethods]
impl PyRenewer {
    #[new]
    #[pyo3(signature = (config = None))]
    fn new(config: Option<&PyLeaseConfig>) -> Self {
        let cfg = config_or_default(config);
        PyRenewer { renewer: Renewer::new(&cfg) }
    }

    /// SPEC D1: start renewing ``lease_id`` for ``request_id``, granted by P engine
    /// ``engine_id`` reachable at ``host:port`` (its handshake endpoint), incarnation
    /// ``incarnation`` (0: any).
    #[pyo3(signature = (request_id, engine_id, host, port, lease_id, now_ns, incarnation = 0))]
    #[allow(clippy::too_many_arguments)]
    fn track(&mut self, request_id: &str, engine_id: &str, host: &str, port: u16, lease_id: LeaseId, now_ns: u64, incarnation: u64) {
        let remote = Remote { engine_id: engine_id.to_owned(), host: host.to_owned(), port, incarnation };
        self.renewer.track(request_id, &remote, lease_id, Nanos(now_ns));
    }

    /// SPEC D4: stop tracking; ``abandoned=True`` (D will not read) queues a Release to P.
    #[pyo3(signature = (request_id, abandoned = false))]
    fn untrack(&mut self, request_id: &str, abandoned: bool) {
        self.renewer.untrack(request_id, if abandoned { Untrack::Abandoned } else { Untrack::Transferred });
    }

    /// The handshake with ``engine_id`` finished: ``incarnation`` and ``agents`` when it
    /// succeeded, ``incarnation=None`` when it failed. Returns ``(taken, drop_agents)``.
    #[pyo3(signature = (engine_id, now_ns, incarnation = None, agents = Vec::new()))]
    fn handshake_done(&mut self, engine_id: &str, now_ns: u64, incarnation: Option<u64>, agents: Vec<String>) -> (bool, Vec<String>) {
        let result = incarnation.map(|incarnation| Handshook { incarnation, agents }).ok_or(());
        let t = self.renewer.handshake_done(engine_id, result, Nanos(now_ns));
        (t.taken, t.drop_agents)
    }

    /// The connection to ``engine_id`` broke: handshake again before the next heartbeat.
    /// Returns the agents whose connections to drop.
    fn disconnected(&mut self, engine_id: &str) -> Vec<String> {
        self.renewer.disconnected(engine_id)
    }

    /// A wire message from P engine ``engine_id`` (acks, lost leases, clock answers). Raises
    /// ``WireDecodeError`` for bytes that are not a message.
    fn on_message(&mut self, py: Python<'_>, engine_id: &str, data: &[u8], now_ns: u64) -> PyResult<()> {
        let msg = Message::decode(data).map_err(wire_err)?;
        let renewer = &mut self.renewer;
        py.detach(move || renewer.on_message(engine_id, &msg, Nanos(now_ns)));
        Ok(())
    }

    /// Lease ``lease_id`` of ``engine_id`` was reported lost by other means (e.g. a text
    /// heartbeat answer): feeds a LeaseLost message to the renewer.
    fn lease_lost(&mut self, engine_id: &str, lease_ids: Vec<LeaseId>, now_ns: u64) {
        self.renewer.on_message(engine_id, &Message::LeaseLost { lease_ids }, Nanos(now_ns));
    }

    /// SPEC D6: may the request's lease be read now, finishing within ``budget`` seconds?
    /// ``"safe"``, ``"renew_first"`` (a renewal is queued: poll, wait for the ack, ask again),
    /// ``"no_link"`` (no handshake with P yet; a renewal is queued for when there is one),
    /// ``"untracked"`` or ``"unreachable"``. ``fenced``: the transport refuses reads of dead
    /// leases itself (kvlease's tcp agent; NIXL's READ is not), so only the handshake is needed.
    #[pyo3(signature = (request_id, budget, now_ns, fenced = false))]
    fn read_check(&mut self, request_id: &str, budget: f64, now_ns: u64, fenced: bool) -> PyResult<&'static str> {
        let b = duration_of("budget", budget)?;
        Ok(match self.renewer.read_check(request_id, b, fenced, Nanos(now_ns)) {
            ReadCheck::Safe => "safe",
            ReadCheck::RenewFirst => "renew_first",
            ReadCheck::Untracked => "untracked",
            ReadCheck::Unreachable => "unreachable",
            ReadCheck::NoLink => "no_link",
        })
    }

    /// Everything due at ``now_ns``, in order. Runs without the GIL.
    fn poll(&mut self, py: Python<'_>, now_ns: u64) -> Vec<PyAction> {
        let renewer = &mut self.renewer;
        let out = py.detach(move || {
            let mut out = Vec::new();
            renewer.poll(Nanos(now_ns), &mut out);
            out
        });
        out.into_iter().map(|a| action(py, a)).collect()
    }

    /// When ``poll`` next has something to do (ns); None when nothing is scheduled.
    fn poll_timeout(&self) -> Option<u64> {
        self.renewer.poll_timeout().map(|n| n.0)
    }

    /// Requests being renewed.
    #[getter]
    fn tracked(&self) -> usize {
        self.renewer.tracked()
    }

    fn is_tracked(&self, request_id: &str) -> bool {
        self.renewer.is_tracked(request_id)
    }

    /// Whether the handshake with ``engine_id`` has completed.
    fn is_ready(&self, engine_id: &str) -> bool {
        self.renewer.is_ready(engine_id)
    }
}

// ---------------------------------------------------------------- wire

fn ids_of(d: &Bound<'_, PyDict>, key: &str) -> PyResult<Vec<LeaseId>> {
    item(d, key)?.extract()
}

fn item<'py>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Bound<'py, PyAny>> {
    d.get_item(key)?.ok_or_else(|| KvleaseError::new_err(format!("message dict has no {key:?}")))
}

fn get<'py, T: for<'a> FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<T> {
    item(d, key)?.extract().map_err(Into::into)
}

fn message_of(d: &Bound<'_, PyDict>) -> PyResult<Message> {
    let ty: String = get(d, "type")?;
    Ok(match ty.as_str() {
        "heartbeat" => Message::Heartbeat { seq: get(d, "seq")?, lease_ids: ids_of(d, "lease_ids")? },
        "heartbeat_ack" => Message::HeartbeatAck { seq: get(d, "seq")?, lost_ids: ids_of(d, "lost_ids")? },
        "release" => Message::Release { lease_ids: ids_of(d, "lease_ids")? },
        "lease_lost" => Message::LeaseLost { lease_ids: ids_of(d, "lease_ids")? },
        "read_done" => {
            let digest: Vec<u8> = get(d, "digest")?;
            Message::ReadDone {
                lease_id: get(d, "lease_id")?,
                consumer_rank: get(d, "consumer_rank")?,
                n: get(d, "n")?,
                digest: digest_of(Some(&digest))?,
            }
        }
        "read_done_ack" => Message::ReadDoneAck { lease_id: get(d, "lease_id")?, live: get(d, "live")? },
        "clock_ping" => Message::ClockPing { seq: get(d, "seq")?, t0: get(d, "t0")? },
        "clock_pong" => Message::ClockPong { seq: get(d, "seq")?, t0: get(d, "t0")?, t1: get(d, "t1")?, t2: get(d, "t2")? },
        "hello" => Message::Hello(Hello {
            engine_id: get(d, "engine_id")?,
            incarnation: get(d, "incarnation")?,
            agents: get(d, "agents")?,
            info: get(d, "info")?,
            t_send: get(d, "t_send")?,
            echo: get(d, "echo")?,
            auth: get(d, "auth")?,
            // SPEC S6's notification keys come with per-engine certificates, which the
            // Python connector does not take.
            notif_key: Vec::new(),
        }),
        other => return Err(KvleaseError::new_err(format!("unknown message type {other:?}"))),
    })
}

fn dict_of<'py>(py: Python<'py>, m: &Message) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match m {
        Message::Heartbeat { seq, lease_ids } => {
            d.set_item("type", "heartbeat")?;
            d.set_item("seq", seq)?;
            d.set_item("lease_ids", lease_ids)?;
        }
        Message::HeartbeatAck { seq, lost_ids } => {
            d.set_item("type", "heartbeat_ack")?;
            d.set_item("seq", seq)?;
            d.set_item("lost_ids", lost_ids)?;
        }
        Message::Release { lease_ids } => {
            d.set_item("type", "release")?;
            d.set_item("lease_ids", lease_ids)?;
        }
        Message::LeaseLost { lease_ids } => {
            d.set_item("type", "lease_lost")?;
            d.set_item("lease_ids", lease_ids)?;
        }
        Message::ReadDone { lease_id, consumer_rank, n, digest } => {
            d.set_item("type", "read_done")?;
            d.set_item("lease_id", lease_id)?;
            d.set_item("consumer_rank", consumer_rank)?;
            d.set_item("n", n)?;
            d.set_item("digest", PyBytes::new(py, &digest.0))?;
        }
        Message::ReadDoneAck { lease_id, live } => {
            d.set_item("type", "read_done_ack")?;
            d.set_item("lease_id", lease_id)?;
            d.set_item("live", live)?;
        }
        Message::ClockPing { seq, t0 } => {
            d.set_item("type", "clock_ping")?;
            d.set_item("seq", seq)?;
            d.set_item("t0", t0)?;
        }
        Message::ClockPong { seq, t0, t1, t2 } => {
            d.set_item("type", "clock_pong")?;
            d.set_item("seq", seq)?;
            d.set_item("t0", t0)?;
            d.set_item("t1", t1)?;
            d.set_item("t2", t2)?;
        }
        Message::Hello(h) => {
            d.set_item("type", "hello")?;
            d.set_item("engine_id", &h.engine_id)?;
            d.set_item("incarnation", h.incarnation)?;
            let agents = PyList::empty(py);
            for a in &h.agents {
                agents.append(PyBytes::new(py, a))?;
            }
            d.set_item("agents", agents)?;
            d.set_item("info", PyBytes::new(py, &h.info))?;
            d.set_item("t_send", h.t_send)?;
            d.set_item("echo", h.echo)?;
            d.set_item("auth", PyBytes::new(py, &h.auth))?;
        }
        // kvlease's own side channel (SPEC O4), which the connector does not speak.
        Message::Refused { what, reason } => {
            d.set_item("type", "refused")?;
            d.set_item("what", what)?;
            d.set_item("reason", reason)?;
        }
        Message::SideRelease(r) => {
            d.set_item("type", "side_release")?;
            d.set_item("engine_id", &r.engine_id)?;
            d.set_item("incarnation", r.incarnation)?;
            d.set_item("granted_by", r.granted_by)?;
            d.set_item("lease_ids", &r.lease_ids)?;
        }
        Message::SideReleaseAck { incarnation, lost_ids } => {
            d.set_item("type", "side_release_ack")?;
            d.set_item("incarnation", incarnation)?;
            d.set_item("lost_ids", lost_ids)?;
        }
        // Push mode (SPEC §13), which the connector does not speak yet: named, not unpacked.
        Message::PushRegister(_) => d.set_item("type", "push_register")?,
        Message::PushRegisterAck { .. } => d.set_item("type", "push_register_ack")?,
        Message::PushHeartbeat { .. } => d.set_item("type", "push_heartbeat")?,
        Message::PushRelease { .. } => d.set_item("type", "push_release")?,
        Message::PushLost { .. } => d.set_item("type", "push_lost")?,
        Message::PushWriteDone { .. } => d.set_item("type", "push_write_done")?,
        Message::PushWriteFailed { .. } => d.set_item("type", "push_write_failed")?,
    }
    Ok(d)
}

/// Encodes a message dict (``{"type": "heartbeat", "seq": 1, "lease_ids": [...]}``, ...) into
/// the SPEC §9 wire. Lease-id lists are sorted and deduplicated on the wire.
#[pyfunction]
fn encode<'py>(py: Python<'py>, message: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyBytes>> {
    let m = message_of(message)?;
    Ok(PyBytes::new(py, &m.encode()))
}

/// Decodes SPEC §9 bytes into a message dict. Total: raises ``WireDecodeError`` for anything
/// that is not a message, never crashes.
#[pyfunction]
fn decode<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let m = Message::decode(data).map_err(wire_err)?;
    dict_of(py, &m)
}

/// SPEC D2: splits a heartbeat for sorted, deduplicated ``ids`` into messages of at most
/// ``max_bytes`` each and encodes them (seq ``seq``, ``seq+1``, ...). Runs without the GIL.
#[pyfunction]
fn encode_heartbeats(py: Python<'_>, seq: u64, ids: Vec<LeaseId>, max_bytes: usize) -> PyResult<Vec<Py<PyBytes>>> {
    if ids.windows(2).any(|w| w[0] >= w[1]) {
        return Err(KvleaseError::new_err("heartbeat ids must be sorted and distinct"));
    }
    let msgs = py.detach(move || {
        wire::heartbeat_chunks(&ids, max_bytes)
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let mut out = Vec::new();
                wire::encode_heartbeat(seq.wrapping_add(i as u64), &ids[r], &mut out);
                out
            })
            .collect::<Vec<_>>()
    });
    Ok(msgs.into_iter().map(|b| PyBytes::new(py, &b).unbind()).collect())
}

/// The 16-byte digest of a prompt's token ids alone: a prompt's identity, what a `LeaseTable`
/// payload may carry. Not the digest in kvlease's `kv_transfer_params`, which SPEC S4 also binds
/// to the engine, incarnation, lease id and ordered block list.
#[pyfunction]
fn prompt_digest<'py>(py: Python<'py>, tokens: Vec<u32>) -> Bound<'py, PyBytes> {
    let d = py.detach(move || PromptDigest::of(&tokens));
    PyBytes::new(py, &d.0)
}

/// Whether ``data`` starts like a kvlease wire message (magic ``b"KL"``): how a connector tells
/// kvlease's binary notifications from vLLM's text ones on the same channel.
#[pyfunction]
fn is_kvlease_message(data: &[u8]) -> bool {
    data.starts_with(&wire::MAGIC)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvleaseError", py.get_type::<KvleaseError>())?;
    m.add("WireDecodeError", py.get_type::<WireDecodeError>())?;
    m.add("ConfigInvalid", py.get_type::<ConfigInvalid>())?;
    m.add_class::<PyLeaseConfig>()?;
    m.add_class::<PyKvTransferConfig>()?;
    m.add_class::<PyReleased>()?;
    m.add_class::<PyLeaseTable>()?;
    m.add_class::<PyIssuedLeaseTable>()?;
    m.add_class::<PyPull>()?;
    m.add_class::<PyIdIssuer>()?;
    m.add_class::<PyAction>()?;
    m.add_class::<PyRenewer>()?;
    m.add_function(wrap_pyfunction!(parse_kv_transfer_config, m)?)?;
    m.add_function(wrap_pyfunction!(encode, m)?)?;
    m.add_function(wrap_pyfunction!(decode, m)?)?;
    m.add_function(wrap_pyfunction!(encode_heartbeats, m)?)?;
    m.add_function(wrap_pyfunction!(prompt_digest, m)?)?;
    m.add_function(wrap_pyfunction!(is_kvlease_message, m)?)?;
    m.add("WIRE_VERSION", wire::VERSION)?;
    m.add("DEFAULT_MAX_NOTIF_BYTES", wire::DEFAULT_MAX_NOTIF_BYTES)?;
    Ok(())
}
