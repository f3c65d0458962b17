//! kvlease-server: the HTTP surface of kvlease.
//!
//! * [`serve`]: the OpenAI API (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
//!   `/health`, `/metrics`) in front of one engine, with vLLM's `kv_transfer_params` (SPEC §10).
//! * [`proxy`]: the P/D routing proxy, flag- and behaviour-compatible with vLLM's toy proxy.
//! * [`tls`]: HTTPS on both, and from the proxy to its engines (vLLM's `--ssl-*`, SPEC S6).
//! * [`etcd`]: cluster membership: engines register in etcd, the proxy routes to what is there.
//!
//! Both run on [`server`]'s accept loop, which bounds what a client can hold ([`HttpLimits`]):
//! header, body, idle and write timeouts, a connection cap, a budget for bodies still arriving;
//! and `serve` bounds what a streamed answer holds for a client that does not take it
//! ([`outbox`]).
//!
//! Bad input always gets a 4xx in the OpenAI error shape ([`ApiError`]), never a 5xx or a panic.

mod api;
mod body;
mod choice;
mod drain;
mod error;
pub mod etcd;
pub mod ids;
mod openai;
mod outbox;
mod proxy;
mod server;
mod sse;
pub mod tls;

pub use api::{router, serve, ServeOptions, DEFAULT_MAX_BUFFERED_STREAM_BYTES, MIN_BUFFERED_STREAM_BYTES, REQUEST_ID};
pub use body::{MAX_BODY_BYTES, UNCOUNTED_BODY_BYTES};
pub use drain::Drain;
pub use error::ApiError;
pub use openai::DEFAULT_MAX_TOKENS;
pub use proxy::{proxy, router as proxy_router, Membership, ProxyConfig, ProxyError, TransferMode, Upstream};
pub use server::{raise_open_files_limit, HttpLimits};
pub use tls::{Tls, TlsError, TlsFlags};
