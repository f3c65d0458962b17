//! kvlease-core: the KV-cache lease protocol of SPEC.md as a sans-io library.
//!
//! Nothing in this crate touches a socket, a thread or a clock. Time comes in as an argument
//! ([`Nanos`], monotonic nanoseconds on the caller's clock); messages come in and go out as bytes
//! or as [`wire::Message`] values. The serving runtime and the simulator drive the same types, so
//! every rule of the protocol is written once, here, and tested here.
//!
//! * [`auth`] — the challenge-response proving the cluster secret on every channel (SPEC S2).
//! * [`config`] — `--kv-transfer-config` parsing (SPEC §2).
//! * [`digest`] — the prompt digest that binds a lease to its prompt (SPEC S4).
//! * [`lease_table`] — P's leases: grant, renew, complete, release, reap (SPEC §4).
//! * [`holder`] — P's side as one machine: the lease table, the quarantine and the cached turns
//!   behind grant, message, read, release, evict and the reaper's poll (SPEC §4, S4, B1).
//! * [`issued`] — P's leases when another process issues the ids D names them by (vLLM's
//!   scheduler): names, leases on their way to the table, completions the transport reports.
//! * [`params`] — `kv_transfer_params`: parsing, P's signature (S1), the prompt binding (S4),
//!   and what D does with a request's params (admission: read, recompute or refuse; O3, O4).
//! * [`peers`] — handshake validation and the registry of remote engines (SPEC D5, S5, T1).
//! * [`push`] — push mode (SPEC §13): P's writes into D's registered blocks, both sides' machines.
//! * [`pull`] — D's pull of a request's KV: waits, deadlines, the fencing verdict (SPEC D6).
//! * [`quarantine`] — blocks an unfenced READ may still target, held until safe (SPEC P5).
//! * [`route`] — the routing proxy's rules: legs, retries, releases, the turn cache (SPEC O2–O4, B1).
//! * [`renewer`] — D's tracking, batched heartbeats, handshake states, read safety (SPEC §5).
//! * [`wire`] — the notification codec (SPEC §9).
//! * [`clock`] — clock-offset estimation for bidirectional transfer (SPEC B2).
//! * [`turn`] — multi-turn: whether P reads a cached turn back from D, and how much (B2, B4).
//! * [`tp`] — which ranks read which heads under heterogeneous tensor parallelism (SPEC T1, T2).

pub mod auth;
pub mod clock;
pub mod config;
pub mod digest;
pub mod holder;
pub mod issued;
pub mod lease_table;
pub mod params;
pub mod peers;
pub mod pull;
pub mod push;
pub mod quarantine;
pub mod renewer;
pub mod route;
mod time;
pub mod tp;
pub mod turn;
pub mod wire;

pub use time::Nanos;

/// A lease's fencing token, assigned by P, never reused within one incarnation (SPEC §3).
pub type LeaseId = u64;
