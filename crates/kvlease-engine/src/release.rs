//! Releasing a lease outside a request's own path (SPEC O3, issue 9), so that no lease is held
//! to expiry because a leg failed:
//!
//! * P: [`EngineHandle::release_by_params`] — a router whose decode leg failed before the decoder
//!   took the request hands back the (signed) `kv_transfer_params` P gave it, and the lease ends
//!   at once as `released`. Only a lease no decoder holds yet can be released this way (SPEC S5:
//!   the first holder to touch a lease owns it), so a router cannot pull a lease from under a
//!   decoder that is reading it. In push mode (SPEC §13) the params are the decode leg's (P's
//!   coordinates and the transfer's key, U1): the lease under that key ends at once while no
//!   decoder holds it, and a key not granted yet is refused at its grant.
//! * D: [`EngineHandle::release_refused`] — D refuses a request that carries P's params before
//!   admitting it; P's lease is released at once through the renewer (as a client that goes away
//!   does, SPEC D4) instead of waiting for its expiry.

use crate::engine::EngineHandle;
use crate::lease_holder;
use crate::state::Inner;
use crate::RequestError;
use kvlease_core::params::{KvRole, Refusal, Whose};
use serde_json::Value;
use std::sync::Arc;

impl EngineHandle {
    /// P: releases the lease these params (this engine's, signed when a secret is set) describe.
    /// `Ok(true)` if it was live and is now released; `Ok(false)` if it had already ended or a
    /// decoder holds it.
    pub fn release_by_params(&self, params: &Value) -> Result<bool, RequestError> {
        by_params(self.inner(), params)
    }

    /// D: a request carrying P's params was refused before admission: release P's lease now
    /// (SPEC O3), as the core's [`kvlease_core::params::Admission::releases_on_refusal`] decides.
    /// Returns whether a release was queued.
    pub fn release_refused(&self, params: Option<&Value>, refusal: Refusal) -> bool {
        let inner = self.inner();
        let Ok(KvRole::DecodeRemote(rk)) = KvRole::parse(params) else { return false };
        match inner.admission().releases_on_refusal(&rk, refusal) {
            None => return false,
            // A kv_both engine handed its own params: its own lease, ended here.
            Some(Whose::Ours) => return crate::lease_holder::release_own(inner, rk.lease_id),
            Some(Whose::Theirs) => {}
        }
        let remote = rk.remote();
        inner.renewer.with(|r| {
            // A refused replay of params another request here is pulling with: the lease is
            // that request's, not this one's to release.
            if r.tracks_lease(&rk.engine_id, rk.lease_id, rk.incarnation) {
                return false;
            }
            r.release(&remote, rk.lease_id, inner.now());
            true
        })
    }
}

/// P: [`EngineHandle::release_by_params`] on the engine's state (also the lease of an answer
/// nobody read: `RequestStream`'s drop).
pub(crate) fn by_params(inner: &Arc<Inner>, params: &Value) -> Result<bool, RequestError> {
    let bad = |m: String| RequestError::bad_request(Some("kv_transfer_params"), m);
    let rk = match KvRole::parse(Some(params)).map_err(|e| bad(e.to_string()))? {
        KvRole::DecodeRemote(rk) => rk,
        KvRole::DecodePush(pr) => {
            if !inner.cfg.transfer.push_mode() {
                return Err(bad("push-mode params, but this engine runs pull mode: it holds no push lease".into()));
            }
            if pr.engine_id != inner.cfg.engine_id || (pr.incarnation != 0 && pr.incarnation != inner.incarnation) {
                return Err(bad(format!("these params name engine {:?}, not this one", pr.engine_id)));
            }
            return Ok(crate::push::with_source(inner, |s, now, out| s.release_unheld(&pr.key, now, out)));
        }
        _ => return Err(bad("not the kv_transfer_params of a lease (do_remote_prefill must be true)".into())),
    };
    inner.admission().names_our_lease(&rk).map_err(|e| bad(e.to_string()))?;
    Ok(lease_holder::release_own(inner, rk.lease_id))
}
