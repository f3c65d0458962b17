//! The engine's shared state: what every task of one engine reads, and who owns each part.
//!
//! * `holder` (P): the lease table, the quarantine and the cached turns, kvlease-core's
//!   `LeaseHolder`, driven by [`crate::lease_holder`];
//! * `renewer` (D): the renewer and, inside it, the registry of remote engines, owned by
//!   [`crate::renewal`] and [`crate::handshake`];
//! * `read_acks` (D): pulls waiting for `ReadDoneAck`s, owned by [`crate::pull`];
//! * `push_source` (P) and `push_sink` (D), push mode's machines, owned by [`crate::push`];
//! * `tasks`: every task the engine runs, and the one signal that stops them all.
//!
//! No logic lives here beyond accessors: this module imports no other module of the engine but
//! the pool and metrics, so nothing imports in a circle.

use crate::metrics::Metrics;
use crate::pool::{BlockPool, Blocks};
use crate::EngineConfig;
use kvlease_core::holder::LeaseHolder;
use kvlease_core::params::Admission;
use kvlease_core::push::sink::{PushAction, PushSink};
use kvlease_core::push::source::PushSource;
use kvlease_core::renewer::Renewer;
use kvlease_core::wire::{Message, PushKey};
use kvlease_core::Nanos;
use kvlease_transport::{Agent, BlockArena};
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;
use tokio::sync::{oneshot, Notify};
use tokio::task::JoinSet;

/// Locks a mutex, riding over poisoning: every critical section leaves its state consistent.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// State one task drives and others change: the lock and the wake-up travel together, so a
/// change made through [`Woken::with`] always wakes the task that acts on it, and a look through
/// [`Woken::lock`] never does.
pub(crate) struct Woken<T> {
    value: Mutex<T>,
    wake: Notify,
}

impl<T> Woken<T> {
    pub fn new(value: T) -> Self {
        Woken { value: Mutex::new(value), wake: Notify::new() }
    }

    /// Changes the state and wakes the task that drives it.
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let r = f(&mut lock(&self.value));
        self.wake.notify_one();
        r
    }

    /// Looks at (or changes, without waking anyone) the state: for the task that drives it, and
    /// for readers.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        lock(&self.value)
    }

    /// Wakes the driving task without a change (it re-reads the state).
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Completes after the next [`Woken::with`] or [`Woken::wake`] (or at once if one came since
    /// the last wait).
    pub fn woken(&self) -> tokio::sync::futures::Notified<'_> {
        self.wake.notified()
    }
}

/// A timer task: `poll` does what is due and says whether work is left over (polled again at
/// once, after giving the thread back) and when it next wants to run; in between the task
/// sleeps until then, or until `woken` is (`None`: until woken). A wake-up between a poll and
/// the sleep is not lost (`Notify` keeps it).
pub(crate) async fn run_timer<T>(inner: &Inner, woken: &Woken<T>, mut poll: impl FnMut() -> (bool, Option<Nanos>)) {
    loop {
        let (more, next) = poll();
        if more {
            tokio::task::yield_now().await;
            continue;
        }
        let notified = woken.woken();
        match next {
            Some(t) => {
                let _ = tokio::time::timeout_at(inner.instant(t), notified).await;
            }
            None => notified.await,
        }
    }
}

/// One rank: its shard of the heads, its memory, its agent.
pub(crate) struct Rank {
    pub heads: Range<u32>,
    pub arena: Arc<BlockArena>,
    pub agent: Arc<dyn Agent>,
}

/// A pull's wait for one `ReadDoneAck`: (our rank, P's agent, lease id).
pub(crate) type AckKey = (usize, String, u64);

pub(crate) struct Inner {
    pub cfg: EngineConfig,
    pub incarnation: u64,
    /// The engine's clock: tokio's, so it is virtual under a paused runtime (the simulator).
    pub origin: tokio::time::Instant,
    /// Added to every reading of the clock (see [`Inner::now`]).
    pub clock_base: u64,
    pub metrics: Arc<Metrics>,
    pub pool: Arc<BlockPool>,
    pub ranks: OnceLock<Vec<Rank>>,
    pub kv_addr: OnceLock<SocketAddr>,
    /// SPEC S6, with certificates only: the notification keys this engine hands its peers in
    /// its Hellos and the ones they handed it (NIXL's notifications carry no certificate).
    pub peer_keys: Option<Arc<kvlease_transport::auth::PeerKeys>>,
    /// P: leases on our blocks, and blocks an unfenced READ may still target (SPEC P5, D6); the
    /// reaper is woken when the holder's next wake-up may have moved earlier.
    pub holder: Woken<LeaseHolder<Blocks>>,
    /// D: renewals of leases on remote blocks, and the registry of remote engines.
    pub renewer: Woken<Renewer>,
    /// Signalled on every acknowledgement, lost lease or peer introduced, for pulls waiting to
    /// read and pushes waiting to write. A `Notify`, not a `watch`: a watch wakes its waiters in
    /// a random order, and the simulator needs the same order every run.
    pub news: Notify,
    /// D: pulls waiting for `ReadDoneAck`s.
    pub read_acks: Mutex<BTreeMap<AckKey, oneshot::Sender<bool>>>,
    /// P, push mode (SPEC §13): leases over source blocks P writes from, driven by
    /// [`crate::push`]; its reaper is woken when its next wake-up may have moved earlier.
    pub push_source: Woken<PushSource<Blocks>>,
    /// D, push mode: requests waiting for P's writes, driven by [`crate::push`].
    pub push_sink: Woken<PushSink>,
    /// D, push mode: what the sink decided for the scheduler (ready, failed, blocks free).
    pub push_actions: OnceLock<tokio::sync::mpsc::UnboundedSender<PushAction>>,
    /// D, push mode: messages for P engines whose handshake is still under way, sent when it
    /// completes (bounded per engine; the sink's deadline covers what is dropped).
    pub push_parked: Mutex<BTreeMap<String, Vec<Message>>>,
    /// D, push mode: requests the sink tracks, with the P engine whose link each keeps up.
    pub push_linked: Mutex<BTreeMap<String, String>>,
    /// P, push mode: prefills running under a push key, for early writes (SPEC U4).
    pub push_prefills: Mutex<HashMap<PushKey, crate::push::Prefilling>>,
    pub tasks: Tasks,
}

impl Inner {
    /// The engine's monotonic clock, as the protocol sees it: time since start, plus a base
    /// (and, in tests, a skew: `debug_clock_skew`) that keeps it far from 0 either way.
    pub fn now(&self) -> Nanos {
        Nanos((self.origin.elapsed().as_nanos() as u64).saturating_add(self.clock_base))
    }

    /// What this engine knows of itself to decide on a request's params (SPEC S1, S4, O3, O4).
    pub fn admission(&self) -> Admission<'_> {
        let cfg = &self.cfg;
        Admission {
            secret: cfg.secret.as_deref(),
            engine_id: &cfg.engine_id,
            incarnation: self.incarnation,
            block_size: cfg.model.block_size,
            num_kv_heads: cfg.model.num_kv_heads,
            policy: cfg.transfer.lease.load_failure_policy,
        }
    }

    pub fn ranks(&self) -> &[Rank] {
        self.ranks.get().map(Vec::as_slice).unwrap_or(&[])
    }

    /// Heads per rank on this engine.
    pub fn heads_per_rank(&self) -> u32 {
        self.cfg.model.num_kv_heads / self.cfg.tp_size
    }

    pub fn bump_news(&self) {
        self.news.notify_waiters();
    }

    /// The tokio instant of a core deadline.
    pub fn instant(&self, at: Nanos) -> tokio::time::Instant {
        self.origin + Duration::from_nanos(at.0.saturating_sub(self.clock_base))
    }
}

/// Every task of one engine, and the one signal they all see. A task spawned here ends when
/// the engine stops, at the latest: none is orphaned.
#[derive(Default)]
pub(crate) struct Tasks {
    stop: Arc<Stop>,
    set: Mutex<JoinSet<()>>,
}

/// The stop signal: a flag and the waiters to wake when it is set.
#[derive(Default)]
struct Stop {
    set: AtomicBool,
    waiters: Notify,
}

impl Stop {
    fn signal(&self) {
        self.set.store(true, Ordering::SeqCst);
        self.waiters.notify_waiters();
    }

    async fn wait(&self) {
        let notified = self.waiters.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.set.load(Ordering::SeqCst) {
            return;
        }
        notified.await;
    }
}

impl Tasks {
    /// Runs `fut` until it ends or the engine stops.
    pub fn spawn(&self, fut: impl Future<Output = ()> + Send + 'static) {
        if self.is_stopped() {
            return;
        }
        let stop = Arc::clone(&self.stop);
        let mut set = lock(&self.set);
        // Reap what has finished, so the set holds only what runs.
        while set.try_join_next().is_some() {}
        set.spawn(async move {
            tokio::select! {
                biased;
                _ = stop.wait() => {}
                _ = fut => {}
            }
        });
    }

    pub fn is_stopped(&self) -> bool {
        self.stop.set.load(Ordering::SeqCst)
    }

    /// Signals every task to stop and waits (up to `within`) until they have; any left are
    /// aborted.
    pub async fn stop(&self, within: Duration) {
        self.stop.signal();
        let mut set = std::mem::take(&mut *lock(&self.set));
        let _ = tokio::time::timeout(within, async { while set.join_next().await.is_some() {} }).await;
        set.abort_all();
    }

    /// Stops every task at once, without waiting (the engine's last handle went away, or the
    /// simulator crashes it).
    pub fn abort(&self) {
        self.stop.signal();
        lock(&self.set).abort_all();
    }
}
