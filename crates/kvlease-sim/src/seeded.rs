//! What the seeded simulators share: the event queue of the discrete-event ones
//! ([`crate::connector`], [`crate::push`]).

use kvlease_core::Nanos;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

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
