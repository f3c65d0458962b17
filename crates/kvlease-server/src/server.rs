//! The HTTP/1 server under `kvlease serve` and `kvlease proxy`: an accept loop over hyper's
//! connection builder that bounds what one client can hold (issue "trust on the wire").
//!
//! `axum::serve` has no limits: a client that never finished its request head, a body sent a
//! byte at a time, a thousand idle connections — each held its share as long as the client
//! liked. Here every connection is in one [`Phase`], and every phase but `Busy` has a deadline:
//!
//! * `Head`: the request head must be complete within `header_timeout` of the connection opening
//!   or of the first byte after an idle spell (slowloris);
//! * `Idle`: a kept-alive connection gets its next request within `idle_timeout`;
//! * `Busy`: a request is in flight. No deadline on the whole (a response may stream for
//!   minutes); the handler reads the body within `body_timeout` or answers 408, and bodies still
//!   arriving share one byte budget ([`crate::body`]).
//!
//! In any phase, a response the client stops taking is cut (issue 22): while response bytes wait
//! in the socket, the client has `write_timeout` to acknowledge some of them, or the connection is
//! closed, and with it the request (an engine aborts it, the proxy drops its upstream). A
//! streamed response's producer is driven here even while the socket is full, within its bound
//! ([`crate::outbox`]). Both cuts are counted ([`HttpMetrics`]) and logged once.
//!
//! At `max_connections`, a new connection closes the open connection that is not busy and is
//! nearest its deadline (it was about to be closed anyway); only when every connection is busy
//! is the newcomer answered 503 and closed. A request in flight is never cut for a newcomer.
//!
//! With `--ssl-certfile` (SPEC S6) every connection is TLS ([`crate::tls`]): its handshake is
//! part of the `Head` phase (done within `header_timeout`, cut if evicted or the server stops),
//! then the same phases run over the TLS stream. The write timeout still reads the TCP socket's
//! counters: TLS leaves the socket as it is, and a client that stops reading fills it the same.
//! A client that fails the handshake (plain HTTP, no client certificate where one is required)
//! is closed after rustls's alert.
//!
//! This module owns sockets, connection tasks and their timers; it knows nothing of the routes.

use crate::body::{BodyBudget, BodyLimits};
use crate::error::ApiError;
use crate::ids::REQUEST_ID;
use crate::outbox::{Driven, Outbox};
use crate::tls::ServerTls;
use axum::body::{Body, Bytes, HttpBody};
use axum::http::{HeaderValue, Request, Response};
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use kvlease_engine::metrics::{labelled_counters, OneLabel, Registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::{poll_fn, Future};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// What one HTTP listener allows its clients (`--http-*` flags).
#[derive(Debug, Clone, PartialEq)]
pub struct HttpLimits {
    /// A request head must be complete within this of the connection opening, or of its first
    /// byte after the connection was idle.
    pub header_timeout: Duration,
    /// A request body must be complete within this of its head; else 408.
    pub body_timeout: Duration,
    /// A kept-alive connection is closed after this long without a request.
    pub idle_timeout: Duration,
    /// Response bytes wait in the socket and the client acknowledges none of them for this long:
    /// the connection is reset and its request ends.
    pub write_timeout: Duration,
    /// Open connections at most.
    pub max_connections: usize,
    /// Bytes buffered for request bodies still arriving, across all connections (each body's
    /// first [`crate::body::UNCOUNTED_BODY_BYTES`] aside); beyond, 503.
    pub max_buffered_body_bytes: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            // Longer than the 30 s a client pool (ours in `proxy`, most HTTP libraries') keeps an
            // idle connection, so the client closes first and never sends on a closing socket.
            idle_timeout: Duration::from_secs(60),
            // Far above what a reading client leaves between two reads; a client that stopped
            // reading holds its slot and its request at most this long (issue 22 asks 8 such
            // streams cut within 60 s).
            write_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_buffered_body_bytes: 64 << 20,
        }
    }
}

/// Largest read buffer hyper keeps per connection, which is also the largest request head (431
/// beyond, as Node's default). With each body's uncounted bytes, what a connection can make the
/// server hold outside the body budget.
const MAX_CONNECTION_BUFFER: usize = 16 << 10;

/// Connections over the cap being answered 503 at once; beyond, they are closed unanswered.
const MAX_REFUSING: usize = 64;

/// How long a connection over the cap has to send its request head and take its 503.
const REFUSE_TIME: Duration = Duration::from_secs(1);

/// The file descriptors a process needs besides its HTTP connections (engine, agents, upstreams).
const OTHER_FILES: u64 = 64;

/// Looks at a socket with response bytes in it this many times per `write_timeout`: a client that
/// stopped taking them is cut at most a quarter of the timeout late, never early.
const LOOKS_PER_WRITE_TIMEOUT: u32 = 4;

/// Why a response was cut before its end: the `reason` of `kvlease_http_responses_aborted_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Abort {
    /// Bytes waited in the socket, and the client acknowledged none, for `write_timeout`.
    WriteTimeout,
    /// More of a stream was produced and not taken than its outbox's bound.
    BufferFull { max_bytes: usize },
}

impl Abort {
    const LABELS: [&'static str; 2] = ["write_timeout", "buffer_full"];

    fn index(self) -> usize {
        match self {
            Abort::WriteTimeout => 0,
            Abort::BufferFull { .. } => 1,
        }
    }

    fn label(self) -> &'static str {
        Abort::LABELS[self.index()]
    }
}

/// What one HTTP listener counts, for the `/metrics` of the routes it serves.
#[derive(Debug)]
pub(crate) struct HttpMetrics {
    family: Family<OneLabel, Counter>,
    aborted: [Counter; Abort::LABELS.len()],
}

impl Default for HttpMetrics {
    fn default() -> Self {
        let (family, aborted) = labelled_counters("reason", Abort::LABELS);
        HttpMetrics { family, aborted }
    }
}

impl HttpMetrics {
    fn count(&self, why: Abort) {
        self.aborted[why.index()].inc();
    }

    /// Registers `kvlease_http_responses_aborted_total` into `registry`.
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "kvlease_http_responses_aborted",
            "Responses cut before their end because the client did not take them (its request ended): no write progress for --http-write-timeout (write_timeout), or a stream over --http-max-buffered-stream-bytes (buffer_full)",
            self.family.clone(),
        );
    }
}

/// Serves `router` on `listener` within `limits`, over TLS if `tls` is given, until `shutdown`
/// resolves; then stops accepting, closes connections that are not busy, lets busy ones finish
/// their request, and returns when every connection is closed.
pub(crate) async fn run(
    listener: TcpListener,
    router: Router,
    limits: HttpLimits,
    tls: Option<ServerTls>,
    metrics: Arc<HttpMetrics>,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    raise_open_files_limit();
    warn_if_files_are_short(limits.max_connections);
    let server = Arc::new(Server {
        budget: Arc::new(BodyBudget::new(limits.max_buffered_body_bytes)),
        metrics,
        limits,
        tls,
        connections: Mutex::new(HashMap::new()),
        next_id: AtomicU64::new(0),
        refusing: AtomicUsize::new(0),
    });
    let (stop_tx, stop_rx) = watch::channel(());
    let mut tasks = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            Some(ended) = tasks.join_next(), if !tasks.is_empty() => {
                if let Err(e) = ended {
                    tracing::warn!("an HTTP connection task failed: {e}");
                }
                continue;
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    // Out of file descriptors, most likely: wait for connections to close.
                    tracing::warn!("cannot accept HTTP connections: {e}");
                    tokio::select! {
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(Duration::from_millis(100)) => continue,
                    }
                }
            },
        };
        // Responses are written whole or as SSE events; Nagle would only delay them.
        let _ = stream.set_nodelay(true);
        match server.admit() {
            Some((id, slot)) => {
                tasks.spawn(server.clone().connection(id, slot, stream, router.clone(), stop_rx.clone()));
            }
            None => server.refuse(stream, &mut tasks),
        }
    }
    drop(listener);
    drop(stop_tx);
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// Errors that concern one connection only; the listener is fine.
fn is_connection_error(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset)
}

struct Server {
    limits: HttpLimits,
    tls: Option<ServerTls>,
    budget: Arc<BodyBudget>,
    metrics: Arc<HttpMetrics>,
    connections: Mutex<HashMap<u64, Arc<Slot>>>,
    next_id: AtomicU64,
    refusing: AtomicUsize,
}

impl Server {
    fn connections(&self) -> MutexGuard<'_, HashMap<u64, Arc<Slot>>> {
        self.connections.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for a new connection, evicting the connection nearest its deadline that is not
    /// busy if the server is full; `None` if every connection is busy.
    fn admit(&self) -> Option<(u64, Arc<Slot>)> {
        let mut connections = self.connections();
        if connections.len() >= self.limits.max_connections {
            let mut open = 0;
            let mut nearest: Option<(Instant, &Arc<Slot>)> = None;
            for slot in connections.values() {
                let phase = *slot.phase();
                if phase == Phase::Evicted {
                    continue;
                }
                open += 1;
                if let Some(due) = phase.deadline(&self.limits).filter(|_| phase.evictable()) {
                    if nearest.is_none_or(|(d, _)| due < d) {
                        nearest = Some((due, slot));
                    }
                }
            }
            if open >= self.limits.max_connections {
                let evicted = nearest.is_some_and(|(_, slot)| slot.evict());
                if !evicted {
                    return None;
                }
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot::new());
        connections.insert(id, slot.clone());
        Some((id, slot))
    }

    /// Answers a connection over the cap with a 503, or closes it if many are being answered.
    fn refuse(self: &Arc<Self>, stream: TcpStream, tasks: &mut JoinSet<()>) {
        if self.refusing.fetch_add(1, Ordering::AcqRel) >= MAX_REFUSING {
            self.refusing.fetch_sub(1, Ordering::AcqRel);
            return;
        }
        let server = self.clone();
        tasks.spawn(async move {
            let max = server.limits.max_connections;
            let _ = tokio::time::timeout(REFUSE_TIME, async {
                match &server.tls {
                    None => refuse(stream, max).await,
                    Some(tls) => refuse(tls.acceptor().accept(stream).await?, max).await,
                }
            })
            .await;
            server.refusing.fetch_sub(1, Ordering::AcqRel);
        });
    }

    /// Serves one connection until it ends, its phase's deadline passes, its client stops taking
    /// its response, it is evicted, or the server stops (then a busy connection finishes its
    /// request first).
    async fn connection(self: Arc<Self>, id: u64, slot: Arc<Slot>, stream: TcpStream, router: Router, mut stop: watch::Receiver<()>) {
        let _registered = Registered { server: &self, id };
        let fd = stream.as_raw_fd();
        let watched = Watched { stream, slot: slot.clone() };
        let Some(tls) = &self.tls else {
            return self.serve_connection(slot, fd, watched, router, stop).await;
        };
        // SPEC S6: the handshake is part of the wait for the first request head.
        let due = slot.phase().deadline(&self.limits).unwrap_or_else(Instant::now);
        let handshake = tokio::select! {
            shaken = tls.acceptor().accept(watched) => shaken,
            () = tokio::time::sleep_until(due) => {
                tracing::debug!("HTTP connection closed: no TLS handshake within the header timeout");
                return;
            }
            () = slot.evicted.notified() => return,
            _ = stop.changed() => return,
        };
        match handshake {
            Ok(stream) => self.serve_connection(slot, fd, stream, router, stop).await,
            Err(e) => tracing::debug!("HTTP connection closed: TLS handshake failed: {e}"),
        }
    }

    /// [`Server::connection`] once the connection's bytes are HTTP: `io` is the socket `fd`,
    /// or a TLS stream over it.
    async fn serve_connection<I>(&self, slot: Arc<Slot>, fd: RawFd, io: I, router: Router, mut stop: watch::Receiver<()>)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let service = ConnectionService {
            router: TowerToHyperService::new(router),
            slot: slot.clone(),
            budget: self.budget.clone(),
            body_timeout: self.limits.body_timeout,
        };
        let io = TokioIo::new(io);
        let mut builder = http1::Builder::new();
        builder.max_buf_size(MAX_CONNECTION_BUFFER).header_read_timeout(None);
        let mut conn = pin!(builder.serve_connection(io, service));
        let mut timer = pin!(tokio::time::sleep(Duration::ZERO));
        let mut evicted = pin!(slot.evicted.notified());
        let mut stopped = pin!(stop.changed());
        let mut draining = false;
        let mut stall = StallWatch::default();
        let ended = poll_fn(|cx| {
            // Hyper closes a connection after the request in flight, once its response is
            // flushed; one with no request in flight is closed here at once (hyper would wait
            // for a head on a fresh connection).
            if !draining && stopped.as_mut().poll(cx).is_ready() {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
            loop {
                if let Poll::Ready(r) = conn.as_mut().poll(cx) {
                    return Poll::Ready(r.map_err(|e| e.to_string()));
                }
                // A streamed response is produced whether or not hyper has room for it.
                match slot.drive(cx) {
                    Driven::Idle => break,
                    Driven::Ready => continue,
                    Driven::Overflowed { max_bytes } => return Poll::Ready(Err(self.abort(&slot, fd, Abort::BufferFull { max_bytes }))),
                }
            }
            // Only to be woken: the phase says whether this connection was evicted.
            let _ = evicted.as_mut().poll(cx);
            loop {
                let phase = *slot.phase();
                if draining && phase.evictable() {
                    return Poll::Ready(Err("the server is shutting down".into()));
                }
                // An evicted connection's deadline is the instant it is asked for: ask first.
                let phase_due = phase.deadline(&self.limits);
                let now = Instant::now();
                if phase_due.is_some_and(|due| due <= now) {
                    return Poll::Ready(Err(phase.cut_reason().into()));
                }
                let responses = slot.responses.load(Ordering::Relaxed);
                let look_due = match stall.look(responses, phase.writing(), self.limits.write_timeout, now, || sent(fd)) {
                    Look::Settled => None,
                    Look::At(due) => Some(due),
                    Look::Cut => return Poll::Ready(Err(self.abort(&slot, fd, Abort::WriteTimeout))),
                };
                let Some(due) = [phase_due, look_due].into_iter().flatten().min() else { return Poll::Pending };
                // A timer that fires early only makes the deadlines be looked at again: it is
                // moved earlier at once, later only once it has fired (not on every request).
                if due < timer.deadline() || timer.is_elapsed() {
                    timer.as_mut().reset(due);
                }
                if timer.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
        })
        .await;
        if let Err(why) = ended {
            tracing::debug!("HTTP connection closed: {why}");
        }
    }
}

/// The connection task's watch over what its socket holds for the client. From the start of each
/// response until a look finds the socket empty with no response being written, it reads the
/// socket's TCP counters every quarter of the write timeout: bytes the client acknowledged since
/// the last look, or none waiting, are progress; bytes waiting and none acknowledged for the
/// whole timeout are a client that stopped reading. A look is one `getsockopt`, at most four per
/// write timeout per connection however many requests it carries; the writes themselves are not
/// touched.
#[derive(Debug)]
struct StallWatch {
    /// The slot's response count when last seen: a new response starts the watch.
    responses: u64,
    watching: bool,
    /// Bytes the client had acknowledged at the last look.
    acked: Option<u64>,
    /// The last look that saw progress (or the watch's start).
    took_at: Instant,
    next_look: Instant,
}

impl Default for StallWatch {
    fn default() -> Self {
        let now = Instant::now();
        StallWatch { responses: 0, watching: false, acked: None, took_at: now, next_look: now }
    }
}

/// What [`StallWatch::look`] found.
#[derive(Debug, PartialEq, Eq)]
enum Look {
    /// Nothing is being written or waits in the socket: no look is due.
    Settled,
    /// Look again at this instant.
    At(Instant),
    /// Bytes have waited for the client, and it acknowledged none, for the write timeout.
    Cut,
}

impl StallWatch {
    /// `responses`: begun on the connection so far; `writing`: a response is being written (more
    /// may come however empty the socket is); `sent`: the socket's counters, read only when a
    /// look is due.
    fn look(&mut self, responses: u64, writing: bool, timeout: Duration, now: Instant, sent: impl FnOnce() -> Option<Sent>) -> Look {
        let every = (timeout / LOOKS_PER_WRITE_TIMEOUT).max(Duration::from_millis(10));
        if responses != self.responses {
            self.responses = responses;
            if !self.watching {
                self.watching = true;
                self.took_at = now;
                self.next_look = now + every;
            }
        }
        if !self.watching {
            return Look::Settled;
        }
        if self.next_look > now {
            return Look::At(self.next_look);
        }
        // Looks keep to their schedule, so the fourth after the last progress is the timeout.
        let scheduled = self.next_look;
        self.next_look = if scheduled + every > now { scheduled + every } else { now + every };
        match sent() {
            Some(Sent { acked, waiting }) => {
                if waiting == 0 || self.acked.is_none_or(|before| acked > before) {
                    self.took_at = scheduled;
                }
                self.acked = Some(acked);
                if waiting == 0 && !writing {
                    self.watching = false;
                    return Look::Settled;
                }
            }
            // Nothing to see (an old kernel, another system): no cut, and no more looks.
            None => {
                self.watching = false;
                return Look::Settled;
            }
        }
        if now >= self.took_at + timeout {
            return Look::Cut;
        }
        Look::At(self.next_look)
    }
}

/// A socket's TCP counters: bytes the peer has acknowledged, and bytes waiting for it (sent and
/// not acknowledged, or not sent for want of room in its window).
#[derive(Debug, PartialEq, Eq)]
struct Sent {
    acked: u64,
    waiting: u64,
}

#[cfg(all(target_os = "linux", any(target_env = "gnu", target_env = "musl")))]
fn sent(fd: RawFd) -> Option<Sent> {
    // SAFETY: tcp_info is plain integers, for which all zeroes is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: TCP_INFO writes at most `len` bytes into `info` and the length it wrote into `len`;
    // `fd` is the connection's socket, open while its task runs (hyper owns the stream until the
    // task drops it).
    let ok = unsafe { libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, (&mut info as *mut libc::tcp_info).cast(), &mut len) } == 0;
    // `tcpi_notsent_bytes` came last, in Linux 4.6.
    if !ok || (len as usize) < std::mem::offset_of!(libc::tcp_info, tcpi_min_rtt) {
        return None;
    }
    let unacked = u64::from(info.tcpi_unacked) * u64::from(info.tcpi_snd_mss.max(1));
    Some(Sent { acked: info.tcpi_bytes_acked, waiting: unacked + u64::from(info.tcpi_notsent_bytes) })
}

/// Elsewhere nothing is seen, and no response is cut for its client's pace.
#[cfg(not(all(target_os = "linux", any(target_env = "gnu", target_env = "musl"))))]
fn sent(_fd: RawFd) -> Option<Sent> {
    None
}

impl Server {
    /// Counts and logs a response cut because its client did not take it, and makes the socket's
    /// close a reset: what the kernel still holds for the client is dropped at once (a client that
    /// does not read would never see a FIN queued behind it), and the client's next read fails.
    fn abort(&self, slot: &Slot, fd: RawFd, why: Abort) -> String {
        self.metrics.count(why);
        let request_id = slot.request_id();
        let request_id = request_id.as_deref().unwrap_or("-");
        match why {
            Abort::WriteTimeout => tracing::info!(
                request_id,
                "response cut: its client took nothing for {} s (--http-write-timeout); its request ends",
                self.limits.write_timeout.as_secs_f64()
            ),
            Abort::BufferFull { max_bytes } => tracing::info!(
                request_id,
                "stream cut: its client left more than {max_bytes} bytes untaken (--http-max-buffered-stream-bytes); its request ends"
            ),
        }
        reset_on_close(fd);
        format!("response aborted: {}", why.label())
    }
}

/// Sets `SO_LINGER` to zero: closing the socket resets the connection.
fn reset_on_close(fd: RawFd) {
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: SO_LINGER reads one `linger` from the pointer for the given length; `fd` is the
    // connection's socket, open while its task runs. A failure leaves an orderly close.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// Removes a connection from the server's table when its task ends, however it ends.
struct Registered<'a> {
    server: &'a Server,
    id: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.server.connections().remove(&self.id);
    }
}

/// Where a connection is in its request cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for a request head, since the connection opened or its first byte arrived.
    Head { since: Instant },
    /// Kept alive between requests, since the last response ended; `flushed` once hyper has
    /// written all of it to the socket (until then the connection must not be dropped).
    Idle { since: Instant, flushed: bool },
    /// `requests` in flight: from the head's arrival to the response's last byte.
    Busy { requests: usize },
    /// Closed to make room for a new connection.
    Evicted,
}

impl Phase {
    /// When the connection is to be closed if nothing changes (now if evicted); `None` if busy.
    fn deadline(self, limits: &HttpLimits) -> Option<Instant> {
        match self {
            Phase::Head { since } => Some(since + limits.header_timeout),
            Phase::Idle { since, .. } => Some(since + limits.idle_timeout),
            Phase::Busy { .. } => None,
            Phase::Evicted => Some(Instant::now()),
        }
    }

    /// A response is being written: more may come, however empty the socket is.
    fn writing(self) -> bool {
        matches!(self, Phase::Busy { .. } | Phase::Idle { flushed: false, .. })
    }

    fn evictable(self) -> bool {
        matches!(self, Phase::Head { .. } | Phase::Idle { flushed: true, .. })
    }

    fn cut_reason(self) -> &'static str {
        match self {
            Phase::Head { .. } => "no complete request head within the header timeout",
            Phase::Idle { .. } => "idle for the idle timeout",
            Phase::Busy { .. } => "busy",
            Phase::Evicted => "closed to make room for a new connection",
        }
    }
}

/// One connection's phase, shared by its socket (bytes arrive), its service (requests begin and
/// end, responses start), its task (deadlines) and the accept loop (eviction).
struct Slot {
    phase: Mutex<Phase>,
    evicted: Notify,
    /// Responses begun on the connection (each starts its task's watch over the socket).
    responses: AtomicU64,
    current: Mutex<Current>,
}

/// The response a connection is writing: its request's id (for the log; kept until the next
/// response, as a cut may come while its end is still being flushed) and its outbox if it streams.
#[derive(Default)]
struct Current {
    request_id: Option<HeaderValue>,
    outbox: Option<Outbox>,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            phase: Mutex::new(Phase::Head { since: Instant::now() }),
            evicted: Notify::new(),
            responses: AtomicU64::new(0),
            current: Mutex::new(Current::default()),
        }
    }

    fn phase(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn current(&self) -> MutexGuard<'_, Current> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A response is ready to be written: it becomes the connection's current one.
    fn on_response(&self, response: &mut Response<Body>) {
        let outbox = response.extensions_mut().remove::<Outbox>();
        let request_id = response.headers().get(REQUEST_ID).cloned();
        *self.current() = Current { request_id, outbox };
        self.responses.fetch_add(1, Ordering::Relaxed);
    }

    fn request_id(&self) -> Option<String> {
        self.current().request_id.as_ref().and_then(|v| v.to_str().ok()).map(str::to_owned)
    }

    /// Drives the current response's outbox, if it streams.
    fn drive(&self, cx: &mut Context<'_>) -> Driven {
        match &self.current().outbox {
            Some(outbox) => outbox.drive(cx),
            None => Driven::Idle,
        }
    }

    /// Bytes arrived: an idle connection is now receiving a request head.
    fn on_bytes(&self) {
        let mut phase = self.phase();
        if let Phase::Idle { flushed: true, .. } = *phase {
            *phase = Phase::Head { since: Instant::now() };
        }
    }

    /// Hyper has written everything it had to the socket.
    fn on_flushed(&self) {
        let mut phase = self.phase();
        if let Phase::Idle { flushed: false, .. } = *phase {
            *phase = Phase::Idle { since: Instant::now(), flushed: true };
        }
    }

    /// A request's head has arrived; `None` if the connection was just evicted.
    fn begin(self: &Arc<Self>) -> Option<InFlight> {
        let mut phase = self.phase();
        *phase = match *phase {
            Phase::Evicted => return None,
            Phase::Busy { requests } => Phase::Busy { requests: requests + 1 },
            Phase::Head { .. } | Phase::Idle { .. } => Phase::Busy { requests: 1 },
        };
        Some(InFlight(self.clone()))
    }

    fn end(&self) {
        let mut phase = self.phase();
        if let Phase::Busy { requests } = *phase {
            *phase =
                if requests > 1 { Phase::Busy { requests: requests - 1 } } else { Phase::Idle { since: Instant::now(), flushed: false } };
            if requests == 1 {
                self.current().outbox = None;
            }
        }
    }

    /// Marks the connection for closing unless a request is in flight or a response is still
    /// being written.
    fn evict(&self) -> bool {
        let mut phase = self.phase();
        if !phase.evictable() {
            return false;
        }
        *phase = Phase::Evicted;
        self.evicted.notify_one();
        true
    }
}

/// A request in flight on a connection; dropped with the response body (or the handler, if the
/// client leaves first).
struct InFlight(Arc<Slot>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// The router, as hyper calls it on one connection: each request is marked in flight until its
/// response body is done, and carries its body's limits.
#[derive(Clone)]
struct ConnectionService {
    router: TowerToHyperService<Router>,
    slot: Arc<Slot>,
    budget: Arc<BodyBudget>,
    body_timeout: Duration,
}

type ResponseFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for ConnectionService {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn call(&self, mut req: Request<Incoming>) -> ResponseFuture {
        let Some(in_flight) = self.slot.begin() else {
            return Box::pin(std::future::ready(Ok(axum::response::IntoResponse::into_response(ApiError::overloaded(
                "the connection is closing: retry on a new one",
            )))));
        };
        req.extensions_mut().insert(BodyLimits {
            deadline: Instant::now() + self.body_timeout,
            timeout: self.body_timeout,
            budget: self.budget.clone(),
        });
        let response = hyper::service::Service::call(&self.router, req);
        let slot = self.slot.clone();
        Box::pin(async move {
            let mut response = response.await?;
            slot.on_response(&mut response);
            Ok(response.map(|body| Body::new(Tracked { body, _in_flight: in_flight })))
        })
    }
}

/// A response body that keeps its request in flight until it is done or dropped.
struct Tracked {
    body: Body,
    _in_flight: InFlight,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// The socket, telling its slot when bytes arrive.
struct Watched {
    stream: TcpStream,
    slot: Arc<Slot>,
}

impl AsyncRead for Watched {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.slot.on_bytes();
        }
        read
    }
}

impl AsyncWrite for Watched {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Hyper flushes the socket only once its own buffer is empty.
        let flushed = Pin::new(&mut self.stream).poll_flush(cx);
        if let Poll::Ready(Ok(())) = flushed {
            self.slot.on_flushed();
        }
        flushed
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The 503 for a connection over the cap. Written after the request head has arrived (a client
/// may take an answer that comes before its request for a broken connection), and followed by
/// reading what else the client sends, so that closing does not reset the answer away.
async fn refuse<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, max_connections: usize) -> io::Result<()> {
    let mut head = Vec::new();
    let mut chunk = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_CONNECTION_BUFFER {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&chunk[..n]);
    }
    let error =
        ApiError::overloaded(format!("the server has {max_connections} connections open, each with a request in flight: retry shortly"));
    let body = error.body().to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await?;
    while stream.read(&mut chunk).await? > 0 {}
    Ok(())
}

/// Warns when the open-file limit cannot hold `max_connections` sockets and the rest.
/// Raises the soft open-file limit to the hard one (issue 9: a proxy out of descriptors failed
/// hundreds of requests with the default 1024). Logged either way.
pub fn raise_open_files_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit read/write the struct we own; no other memory is touched.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        tracing::warn!("cannot read the open-file limit: {}", io::Error::last_os_error());
        return;
    }
    if lim.rlim_cur >= lim.rlim_max {
        return;
    }
    let before = lim.rlim_cur;
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: as above.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } == 0 {
        tracing::info!("open-file limit raised from {before} to {}", lim.rlim_max);
    } else {
        tracing::warn!("cannot raise the open-file limit from {before}: {}", io::Error::last_os_error());
    }
}

fn warn_if_files_are_short(max_connections: usize) {
    let Some(soft) = std::fs::read_to_string("/proc/self/limits").ok().and_then(|l| open_files_limit(&l)) else { return };
    if (max_connections as u64).saturating_add(OTHER_FILES) > soft {
        tracing::warn!(
            "the open-file limit ({soft}) is too low for --http-max-connections {max_connections}: raise it (ulimit -n) or lower the flag, or accept() will fail before the cap is reached"
        );
    }
}

/// The soft "Max open files" of a `/proc/<pid>/limits` text (`None` if unlimited or absent).
fn open_files_limit(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.trim_start_matches("Max open files").split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_connections: usize) -> HttpLimits {
        HttpLimits { max_connections, ..HttpLimits::default() }
    }

    fn server(max_connections: usize) -> Server {
        Server {
            limits: limits(max_connections),
            tls: None,
            budget: Arc::new(BodyBudget::new(0)),
            metrics: Arc::default(),
            connections: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            refusing: AtomicUsize::new(0),
        }
    }

    /// Issue "bounded HTTP": a connection's deadline follows its phase — header timeout while a
    /// head arrives, idle timeout between requests, none while a request is in flight.
    #[test]
    fn deadlines_follow_the_phase() {
        let l = HttpLimits::default();
        let slot = Arc::new(Slot::new());
        let Phase::Head { since } = *slot.phase() else { panic!("a new connection waits for a head") };
        assert_eq!(slot.phase().deadline(&l), Some(since + l.header_timeout));
        slot.on_bytes();
        assert_eq!(*slot.phase(), Phase::Head { since }, "bytes of a head do not extend its deadline");
        let first = slot.begin().expect("not evicted");
        assert_eq!(slot.phase().deadline(&l), None, "no deadline while busy");
        slot.on_bytes();
        assert!(matches!(*slot.phase(), Phase::Busy { requests: 1 }), "body bytes keep it busy");
        drop(first);
        assert!(matches!(*slot.phase(), Phase::Idle { flushed: false, .. }));
        assert!(!slot.evict(), "not evicted before the response is on the wire");
        slot.on_flushed();
        let Phase::Idle { since, flushed: true } = *slot.phase() else { panic!("idle after the response") };
        assert_eq!(slot.phase().deadline(&l), Some(since + l.idle_timeout));
        slot.on_bytes();
        assert!(matches!(*slot.phase(), Phase::Head { .. }), "the next head's clock starts");
    }

    /// Issue "bounded HTTP": at the cap, the connection nearest its deadline that is not busy
    /// makes room; a busy one never does, and when all are busy the newcomer is refused.
    #[test]
    fn a_full_server_evicts_the_nearest_deadline_and_never_a_busy_connection() {
        let s = server(3);
        let (_, busy) = s.admit().unwrap();
        let _request = busy.begin().unwrap();
        let (_, older) = s.admit().unwrap();
        let (_, newer) = s.admit().unwrap();
        *newer.phase() = Phase::Head { since: Instant::now() + Duration::from_secs(1) };
        let (_, fourth) = s.admit().expect("room is made");
        assert_eq!(*older.phase(), Phase::Evicted, "the head nearest its deadline goes");
        assert!(matches!(*busy.phase(), Phase::Busy { .. }));
        assert!(matches!(*newer.phase(), Phase::Head { .. }));
        assert!(older.begin().is_none(), "an evicted connection takes no request");
        let _r2 = newer.begin().unwrap();
        let _r3 = fourth.begin().unwrap();
        assert!(s.admit().is_none(), "every open connection is busy: refused");
        assert_eq!(s.connections().len(), 4, "the evicted one leaves when its task ends");
    }

    /// Issue 22: a socket whose bytes wait and are never acknowledged is cut at the write timeout
    /// after the first look (a quarter late, never early: the first look of a connection has
    /// nothing to compare with); progress (bytes acknowledged, or none
    /// waiting) starts the clock again; a socket found empty with no response being written is
    /// no longer looked at, until the next response.
    #[test]
    fn the_write_timeout_counts_from_the_last_progress() {
        let t = Duration::from_secs(4);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let stuck = || Some(Sent { acked: 100, waiting: 5000 });
        let mut w = StallWatch::default();
        assert_eq!(w.look(0, false, t, at(0), || panic!("no response yet: no look")), Look::Settled);
        assert_eq!(w.look(1, true, t, at(0), || panic!("not due")), Look::At(at(1000)));
        for s in 1..=4 {
            assert_eq!(w.look(1, true, t, at(s * 1000), stuck), Look::At(at(s * 1000 + 1000)), "{s} s");
        }
        assert_eq!(w.look(1, true, t, at(4999), || panic!("not due")), Look::At(at(5000)));
        assert_eq!(w.look(1, true, t, at(5010), stuck), Look::Cut, "nothing taken for 4 s since the first look");

        // A client that takes a little every few seconds is never cut.
        let mut w = StallWatch::default();
        w.look(1, true, t, at(0), || None);
        let mut acked = 0;
        for s in 1..=20 {
            if s % 3 == 0 {
                acked += 10;
            }
            let look = w.look(1, true, t, at(s * 1000), || Some(Sent { acked, waiting: 5000 }));
            assert_eq!(look, Look::At(at(s * 1000 + 1000)), "{s} s");
        }
        // Then it stops taking: cut 4 s after the last look that saw progress (18 s).
        let still = || Some(Sent { acked: 60, waiting: 5000 });
        assert_eq!(w.look(1, true, t, at(21_000), still), Look::At(at(22_000)));
        assert_eq!(w.look(1, true, t, at(22_000), still), Look::Cut);

        // Nothing waiting is progress; once the response is written, an empty socket settles.
        let mut w = StallWatch::default();
        w.look(1, true, t, at(0), || None);
        for s in 1..=6 {
            assert_eq!(w.look(1, true, t, at(s * 1000), || Some(Sent { acked: 7, waiting: 0 })), Look::At(at(s * 1000 + 1000)));
        }
        assert_eq!(w.look(1, false, t, at(7000), || Some(Sent { acked: 7, waiting: 0 })), Look::Settled);
        assert_eq!(w.look(1, false, t, at(9000), || panic!("settled: no look")), Look::Settled);
        assert_eq!(w.look(2, true, t, at(9000), || panic!("not due")), Look::At(at(10_000)), "the next response");
    }

    /// Issue 22: the socket counters are read from a real connection: bytes a client leaves
    /// unread wait, and are not acknowledged once its window is full.
    #[tokio::test]
    async fn reads_what_waits_in_a_socket() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        let empty = sent(server.as_raw_fd());
        if cfg!(all(target_os = "linux", any(target_env = "gnu", target_env = "musl"))) {
            assert_eq!(empty.map(|s| s.waiting), Some(0));
        }
        let chunk = vec![b'x'; 64 << 10];
        while tokio::time::timeout(Duration::from_millis(200), server.write_all(&chunk)).await.is_ok() {}
        let Some(mut before) = sent(server.as_raw_fd()) else { return };
        // The client's kernel takes what its window holds, then nothing.
        let t0 = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let now = sent(server.as_raw_fd()).expect("counters");
            assert!(now.waiting > 0, "{now:?}");
            if now.acked == before.acked {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "the client's window never filled: {now:?}");
            before = now;
        }
        drop(client);
    }

    #[test]
    fn reads_the_open_files_limit() {
        let text = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1024                 524288               files\n";
        assert_eq!(open_files_limit(text), Some(1024));
        assert_eq!(open_files_limit("Max open files            unlimited            unlimited            files"), None);
    }
}
