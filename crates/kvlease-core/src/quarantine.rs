//! SPEC P5, D6 where the transport cannot fence reads (NIXL): blocks a READ may still target sit
//! out for a while before they are used again. Push mode holds here the same way a WRITE that P
//! gave up on but the transport cannot cancel (SPEC U4: its source blocks, until the transport
//! says it ended or the hold passes, [`crate::push::source::PushSource::abandon_write`]).
//!
//! A READ is posted only within the read budget of an acknowledged deadline and abandoned after
//! the read timeout; [`LeaseConfig::quarantine`] outlasts both with a margin. Where the transport
//! refuses reads of dead leases and never touches memory after a read ends (tcp, mem), there is
//! nothing to wait for and blocks come back at once.
//!
//! This is state with release times, polled like the lease table: the driver calls
//! [`Quarantine::poll`] when [`Quarantine::next_release`] is due.

use crate::config::LeaseConfig;
use crate::Nanos;
use std::collections::VecDeque;
use std::time::Duration;

/// Items held until a release time. Every item is held for the same span, so release times are
/// in insertion order and a queue is enough.
#[derive(Debug)]
pub struct Quarantine<T> {
    hold: Duration,
    held: VecDeque<(Nanos, T)>,
}

impl<T> Quarantine<T> {
    /// `reads_fenced`: whether the transport refuses reads of dead leases (then nothing is held).
    pub fn new(cfg: &LeaseConfig, reads_fenced: bool) -> Quarantine<T> {
        Quarantine { hold: if reads_fenced { Duration::ZERO } else { cfg.quarantine() }, held: VecDeque::new() }
    }

    /// Holds `item` from `now`; returns it at once when nothing needs holding.
    pub fn hold(&mut self, now: Nanos, item: T) -> Option<T> {
        if self.hold.is_zero() {
            return Some(item);
        }
        self.held.push_back((now + self.hold, item));
        None
    }

    /// Appends to `out` everything whose hold has ended by `now`.
    pub fn poll(&mut self, now: Nanos, out: &mut Vec<T>) {
        while self.held.front().is_some_and(|(until, _)| *until <= now) {
            if let Some((_, item)) = self.held.pop_front() {
                out.push(item);
            }
        }
    }

    /// Takes out, before its hold ended, the first item `pred` picks (what it guarded is known
    /// to be safe now: the transfer it waited for ended).
    pub fn take(&mut self, mut pred: impl FnMut(&T) -> bool) -> Option<T> {
        let i = self.held.iter().position(|(_, item)| pred(item))?;
        self.held.remove(i).map(|(_, item)| item)
    }

    /// When the next item comes out.
    pub fn next_release(&self) -> Option<Nanos> {
        self.held.front().map(|(until, _)| *until)
    }

    /// Everything still held, at once (shutdown: the process's memory goes with it).
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.held.drain(..).map(|(_, item)| item)
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Everything held, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.held.iter().map(|(_, item)| item)
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SPEC P5: unfenced, blocks come back only after the quarantine; fenced, at once.
    #[test]
    fn p5_unfenced_blocks_sit_out_the_quarantine() {
        let cfg = LeaseConfig::with_lease_secs(30.0).unwrap();
        let mut q = Quarantine::new(&cfg, false);
        let t0 = Nanos(1_000);
        assert_eq!(q.hold(t0, 1), None);
        assert_eq!(q.hold(t0 + Duration::from_secs(1), 2), None);
        assert_eq!(q.next_release(), Some(t0 + cfg.quarantine()));
        let mut out = Vec::new();
        q.poll(t0 + cfg.quarantine() - Duration::from_nanos(1), &mut out);
        assert!(out.is_empty());
        q.poll(t0 + cfg.quarantine(), &mut out);
        assert_eq!(out, vec![1]);
        let mut fenced = Quarantine::new(&cfg, true);
        assert_eq!(fenced.hold(t0, 3), Some(3));
        assert!(fenced.is_empty());
    }
}
