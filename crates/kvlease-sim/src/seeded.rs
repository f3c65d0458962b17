//! What the seeded simulators ([`crate::cluster`], [`crate::connector`], [`crate::push`]) share:
//! the event queue of the discrete-event ones, the shape of a run's [`Outcome`], and the loop
//! that runs seed after seed ([`run_seeds`], [`search`]) and reports a run ([`report`]).

use kvlease_core::Nanos;
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::fmt::Debug;
use std::fmt::Write as _;
use std::time::Duration;

/// A simulator whose every run — engines, workload, faults — is drawn from one seed.
pub trait Seeded: Sized {
    /// A bug the run may plant on purpose (the simulator's own tests).
    type Planted: Copy + Debug;
    /// What a run counts besides the shape every simulator shares.
    type Counts: Counts;
    /// The run drawn from `seed`.
    fn from_seed(seed: u64) -> Self;
    fn plant(&mut self, bug: Option<Self::Planted>);
    /// Runs the workload to its end, checking every invariant.
    fn run(&self) -> Outcome<Self::Counts>;
}

/// A simulator's own counts of a run.
pub trait Counts: Clone + Default + Debug + PartialEq {
    /// `kvlease sim`'s flag that runs the simulator (`--cluster`, …).
    const FLAG: &'static str;
    /// Adds another run's counts to these (the totals over seeds).
    fn add(&mut self, other: &Self);
}

/// What one run found.
#[derive(Debug, Clone, Default)]
pub struct Outcome<C> {
    pub seed: u64,
    pub requests: usize,
    /// The simulator's own counts.
    pub counts: C,
    pub violations: Vec<String>,
    /// What happened, in simulated time.
    pub trace: Vec<String>,
    /// Simulated time the run covered.
    pub simulated: Duration,
}

impl<C: Counts> Outcome<C> {
    /// The command that replays this run.
    pub fn replay(&self) -> String {
        format!("cargo run -p kvlease -- sim {} --seed {}", C::FLAG, self.seed)
    }

    /// Adds another run to these totals (its violations and trace are not kept).
    fn add(&mut self, other: &Self) {
        self.requests += other.requests;
        self.simulated += other.simulated;
        self.counts.add(&other.counts);
    }
}

/// A run as a report: its violations, the replay command, and its trace.
pub fn report<C: Counts>(out: &Outcome<C>) -> String {
    let mut s = String::new();
    if out.violations.is_empty() {
        let _ = writeln!(s, "seed {} kept every invariant:", out.seed);
    } else {
        let _ = writeln!(s, "seed {} broke {} invariant(s):", out.seed, out.violations.len());
    }
    for v in &out.violations {
        let _ = writeln!(s, "  {v}");
    }
    let _ = writeln!(s, "replay: {}", out.replay());
    let _ = writeln!(s, "trace:");
    for line in &out.trace {
        let _ = writeln!(s, "  {line}");
    }
    s
}

/// Runs seeds `from..from + count` of `S` with `planted`, handing each run that kept every
/// invariant to `each`; returns their totals (requests, simulated time, counts), or the first run
/// that broke an invariant.
pub fn run_seeds<S: Seeded>(
    from: u64,
    count: u64,
    planted: Option<S::Planted>,
    mut each: impl FnMut(&Outcome<S::Counts>),
) -> Result<Outcome<S::Counts>, Box<Outcome<S::Counts>>> {
    let mut total = Outcome::default();
    for seed in from..from.saturating_add(count) {
        let mut sim = S::from_seed(seed);
        sim.plant(planted);
        let out = sim.run();
        if !out.violations.is_empty() {
            return Err(Box::new(out));
        }
        total.add(&out);
        each(&out);
    }
    Ok(total)
}

/// Runs seeds `from..from + count` of `S` with `planted`; returns the requests simulated, or the
/// first run that broke an invariant.
pub fn search<S: Seeded>(from: u64, count: u64, planted: Option<S::Planted>) -> Result<u64, Box<Outcome<S::Counts>>> {
    run_seeds::<S>(from, count, planted, |_| {}).map(|total| total.requests as u64)
}

/// The events of a discrete-event simulation: they pop earliest first, and in the order they were
/// pushed at a tie, so one seed gives one order.
pub(crate) struct EventQueue<E> {
    heap: BinaryHeap<Queued<E>>,
    seq: u64,
}

struct Queued<E> {
    t: Nanos,
    seq: u64,
    ev: E,
}

impl<E> PartialEq for Queued<E> {
    fn eq(&self, o: &Self) -> bool {
        (self.t, self.seq) == (o.t, o.seq)
    }
}
impl<E> Eq for Queued<E> {}
impl<E> PartialOrd for Queued<E> {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl<E> Ord for Queued<E> {
    /// Earliest first (a max-heap of reversed order), in order of scheduling at a tie.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.t, o.seq).cmp(&(self.t, self.seq))
    }
}

impl<E> EventQueue<E> {
    pub(crate) fn new() -> Self {
        EventQueue { heap: BinaryHeap::new(), seq: 0 }
    }

    /// Schedules `ev` at `t`, after every event already scheduled at `t`.
    pub(crate) fn push(&mut self, t: Nanos, ev: E) {
        self.seq += 1;
        self.heap.push(Queued { t, seq: self.seq, ev });
    }

    /// The earliest event and its time.
    pub(crate) fn pop(&mut self) -> Option<(Nanos, E)> {
        self.heap.pop().map(|q| (q.t, q.ev))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The event queue runs earliest first, in scheduling order at a tie.
    #[test]
    fn events_run_in_time_then_scheduling_order() {
        let mut q = EventQueue::new();
        for (t, name) in [(5, "a"), (3, "b"), (5, "c"), (3, "d"), (4, "e")] {
            q.push(Nanos(t), name);
        }
        let order: Vec<(u64, &str)> = std::iter::from_fn(|| q.pop().map(|(t, name)| (t.0, name))).collect();
        assert_eq!(order, vec![(3, "b"), (3, "d"), (4, "e"), (5, "a"), (5, "c")]);
    }
}
