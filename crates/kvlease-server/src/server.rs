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
//! * `Busy`: a request is in flight. No connection deadline (a response may stream for minutes);
//!   the handler reads the body within `body_timeout` or answers 408, and bodies still arriving
//!   share one byte budget ([`crate::body`]).
//!
//! At `max_connections`, a new connection closes the open connection that is not busy and is
//! nearest its deadline (it was about to be closed anyway); only when every connection is busy
//! is the newcomer answered 503 and closed. A request in flight is never cut for a newcomer.
//!
//! This module owns sockets, connection tasks and their timers; it knows nothing of the routes.

use crate::body::{BodyBudget, BodyLimits};
use crate::error::ApiError;
use axum::body::{Body, Bytes, HttpBody};
use axum::http::{Request, Response};
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::{poll_fn, Future};
use std::io;
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

/// Serves `router` on `listener` within `limits` until `shutdown` resolves; then stops
/// accepting, closes connections that are not busy, lets busy ones finish their request, and
/// returns when every connection is closed.
pub(crate) async fn run(listener: TcpListener, router: Router, limits: HttpLimits, shutdown: impl Future<Output = ()>) -> io::Result<()> {
    raise_open_files_limit();
    warn_if_files_are_short(limits.max_connections);
    let server = Arc::new(Server {
        budget: Arc::new(BodyBudget::new(limits.max_buffered_body_bytes)),
        limits,
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
    budget: Arc<BodyBudget>,
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
            let _ = tokio::time::timeout(REFUSE_TIME, refuse(stream, server.limits.max_connections)).await;
            server.refusing.fetch_sub(1, Ordering::AcqRel);
        });
    }

    /// Serves one connection until it ends, its phase's deadline passes, it is evicted, or the
    /// server stops (then a busy connection finishes its request first).
    async fn connection(self: Arc<Self>, id: u64, slot: Arc<Slot>, stream: TcpStream, router: Router, mut stop: watch::Receiver<()>) {
        let _registered = Registered { server: &self, id };
        let service = ConnectionService {
            router: TowerToHyperService::new(router),
            slot: slot.clone(),
            budget: self.budget.clone(),
            body_timeout: self.limits.body_timeout,
        };
        let io = TokioIo::new(Watched { stream, slot: slot.clone() });
        let mut builder = http1::Builder::new();
        builder.max_buf_size(MAX_CONNECTION_BUFFER).header_read_timeout(None);
        let mut conn = pin!(builder.serve_connection(io, service));
        let mut timer = pin!(tokio::time::sleep(Duration::ZERO));
        let mut evicted = pin!(slot.evicted.notified());
        let mut stopped = pin!(stop.changed());
        let mut draining = false;
        let ended = poll_fn(|cx| {
            // Hyper closes a connection after the request in flight, once its response is
            // flushed; one with no request in flight is closed here at once (hyper would wait
            // for a head on a fresh connection).
            if !draining && stopped.as_mut().poll(cx).is_ready() {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
            if let Poll::Ready(r) = conn.as_mut().poll(cx) {
                return Poll::Ready(r.map_err(|e| e.to_string()));
            }
            // Only to be woken: the phase says whether this connection was evicted.
            let _ = evicted.as_mut().poll(cx);
            loop {
                let phase = *slot.phase();
                if draining && phase.evictable() {
                    return Poll::Ready(Err("the server is shutting down".into()));
                }
                let Some(due) = phase.deadline(&self.limits) else { return Poll::Pending };
                if due <= Instant::now() {
                    return Poll::Ready(Err(phase.cut_reason().into()));
                }
                if timer.deadline() != due {
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
/// end), its task (deadlines) and the accept loop (eviction).
#[derive(Debug)]
struct Slot {
    phase: Mutex<Phase>,
    evicted: Notify,
}

impl Slot {
    fn new() -> Slot {
        Slot { phase: Mutex::new(Phase::Head { since: Instant::now() }), evicted: Notify::new() }
    }

    fn phase(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|e| e.into_inner())
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
        Box::pin(async move {
            let response = response.await?;
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
async fn refuse(mut stream: TcpStream, max_connections: usize) -> io::Result<()> {
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
            budget: Arc::new(BodyBudget::new(0)),
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

    #[test]
    fn reads_the_open_files_limit() {
        let text = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1024                 524288               files\n";
        assert_eq!(open_files_limit(text), Some(1024));
        assert_eq!(open_files_limit("Max open files            unlimited            unlimited            files"), None);
    }
}
