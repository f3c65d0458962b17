//! Push mode (SPEC §13): P **writes** a request's KV into destination blocks D allocated and
//! registered, instead of D reading P's blocks. Both sides now hold memory for the other — P its
//! source blocks until the writes land, D its destination blocks until they are filled — so each
//! side has a machine here, beside the pull machines ([`crate::holder`], [`crate::renewer`],
//! [`crate::pull`]), under the same lease rules (§4, §5, §8 with the read replaced by P's write):
//!
//! * [`source::PushSource`], on P: the lease over the source blocks, keyed by the transfer's
//!   [`PushKey`] (U1), kept and renewed from before the grant (U2), answered lost at once when
//!   gone (U3); the gate every write passes right before it is posted (U4, U8, U11); the tally of
//!   completions that ends the lease as `transferred` exactly once (U5); a failure report with
//!   P's totals for every way a write can fail (U6).
//! * [`sink::PushSink`], on D: renewal from admission (U2), the registration (U1, U8, U11), the
//!   tally of expected writes per destination rank and pipeline stage (U7), D's own renewable
//!   deadline (U10), the release on any abort (U9), and when the destination blocks may be
//!   reused (U8).
//!
//! A transfer, end to end, with the messages of [`crate::wire`]:
//!
//! ```text
//! D: PushSink::admit            ── PushHeartbeat{key} every I ──▶  P: PushSource::on_message (kept, U2)
//! D: PushSink::register         ── PushRegister ───────────────▶  P: on_message → PushRegisterAck{granted: false}
//!                                                                  P: PushSource::grant (P1) → renewal applied,
//!                                  ◀── PushRegisterAck{granted} ──     registration paired → WriteJob
//!                                                                  P: begin_write / end_write per rank × stage
//! D: on_message (tally, U7)     ◀── PushWriteDone ×n ───────────  P: last one → lease `transferred` (U5)
//! D: PushAction::Ready → decode
//! ```
//!
//! On a failure P sends `PushWriteFailed{done, failed}`, and D applies `kv_load_failure_policy`
//! once every write stopped; on any abort D sends `PushRelease`, which P answers `PushLost` once
//! nothing is in flight (then D reuses the blocks, U8).
//!
//! Which rule lives where:
//!
//! | id | P ([`source`]) | D ([`sink`]) |
//! |---|---|---|
//! | U1 | pairing by key, duplicate acknowledged, a key granted once | the key in every message |
//! | U2 | renewal and registration kept before the grant, applied at it | heartbeats from admission |
//! | U3 | `PushLost` at once for an ended or foreign key (once no write is in flight) | a lost key fails over; the registration sent again until P pairs it |
//! | U4 | the write gate; blocks held by writes in flight, also by one given up on that the transport cannot cancel (until it ends or the quarantine passes) | |
//! | U5 | `transferred` on the last write of every rank × stage | |
//! | U6 | `PushWriteFailed` with totals (again to a duplicate registration), `PushLost` | the tally closes on them |
//! | U7 | | ready only when all done and none failed; policy after all stopped |
//! | U8 | no write posted within the margin of D's deadline | blocks reused only when safe (after a `TimedOut` write: recompute elsewhere, reuse on `PushLost` or the deadline plus the quarantine) |
//! | U9 | a release ends the lease (after writes in flight) | `PushRelease` on any abort |
//! | U10 | | D's deadline, pushed back by P's progress |
//! | U11 | digest and incarnation checked; a newer registration supersedes | old completions ignored |

pub mod sink;
pub mod source;

pub use crate::wire::{PushFailure, PushKey, PushRegistration, PushRenewal};

#[cfg(test)]
mod tests;
