//! HTTPS for `kvlease serve` and `kvlease proxy` (SPEC S6, the HTTP half): vLLM's
//! `--ssl-keyfile`, `--ssl-certfile`, `--ssl-ca-certs` and `--ssl-cert-reqs`, with uvicorn's
//! meanings, served with rustls (ring). Everything is read and checked at start-up, so a bad
//! file or value is refused there, naming its flag.
//!
//! * `--ssl-certfile` (a PEM chain, leaf first) and `--ssl-keyfile` (its PEM private key): the
//!   listener speaks HTTPS. One without the other, or a key that is not the certificate's, is
//!   refused.
//! * `--ssl-cert-reqs`: Python's `ssl.CERT_NONE` (0, the default: no client certificate asked),
//!   `CERT_OPTIONAL` (1: one is asked for and, if given, must be signed by `--ssl-ca-certs`) or
//!   `CERT_REQUIRED` (2: a client without a certificate signed by `--ssl-ca-certs` is refused).
//! * `--ssl-ca-certs` (PEM): the CAs client certificates are checked against; for the proxy also
//!   the CAs its `https://` upstreams' certificates are checked against (the proxy trusts no
//!   other root), and the proxy presents its own `--ssl-certfile` to upstreams that ask for a
//!   client certificate.
//! * `--enable-ssl-refresh` (vLLM's): the listener's certificate, key and CAs are read again
//!   when any of their files changes ([`Tls::refresh_on_change`]); new handshakes use them,
//!   open connections keep theirs, and the proxy's client to its upstreams trusts the new CAs
//!   and presents the new certificate from its next request on. A set that does not load (a
//!   key written before its certificate, a broken file) is logged naming the flag and the
//!   current one stays.

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;
use tokio_rustls::rustls;

/// The `--ssl-*` flags as given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFlags {
    pub keyfile: Option<PathBuf>,
    pub certfile: Option<PathBuf>,
    pub ca_certs: Option<PathBuf>,
    /// `--ssl-cert-reqs`: 0, 1 or 2 (Python's `ssl.CERT_*`); `None` if not given (0).
    pub cert_reqs: Option<i64>,
}

/// Why the `--ssl-*` flags were refused; every message names the flag.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{given} is given without {missing}: HTTPS needs both the certificate (--ssl-certfile) and its private key (--ssl-keyfile)")]
    Half { given: &'static str, missing: &'static str },
    #[error("{flag} {}: cannot read it: {source}", path.display())]
    Read { flag: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{flag} {}: {what}", path.display())]
    Pem { flag: &'static str, path: PathBuf, what: String },
    #[error("--ssl-keyfile {} is not the private key of --ssl-certfile {}: {why}", key.display(), cert.display())]
    Mismatch { key: PathBuf, cert: PathBuf, why: String },
    #[error("--ssl-cert-reqs {0} must be 0 (ssl.CERT_NONE), 1 (ssl.CERT_OPTIONAL) or 2 (ssl.CERT_REQUIRED)")]
    CertReqs(i64),
    #[error("--ssl-cert-reqs {0} asks clients for certificates: give --ssl-ca-certs, the CA that signs them")]
    NoClientCa(i64),
    #[error("{flag} is given without --ssl-certfile and --ssl-keyfile: the listener would not speak HTTPS")]
    NoServerCert { flag: &'static str },
    #[error("--ssl-ca-certs {}: {why}", path.display())]
    Ca { path: PathBuf, why: String },
    /// The proxy's client cannot take the roots or the identity it was given.
    #[error("{flag}: {why}")]
    Client { flag: &'static str, why: String },
}

/// The HTTPS side of a listener: what accepts TLS connections (replaced when the files are
/// refreshed).
#[derive(Clone)]
pub struct ServerTls(Arc<RwLock<tokio_rustls::TlsAcceptor>>);

impl ServerTls {
    fn new(acceptor: tokio_rustls::TlsAcceptor) -> ServerTls {
        ServerTls(Arc::new(RwLock::new(acceptor)))
    }

    /// What accepts the next connection.
    pub(crate) fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        self.0.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn replace(&self, fresh: &ServerTls) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = fresh.acceptor();
    }
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerTls")
    }
}

/// What the proxy's client to its upstreams trusts and presents; with `--enable-ssl-refresh`
/// replaced when the files change ([`Tls::refresh_on_change`]), each replacement counted so
/// the proxy knows to build its client again.
#[derive(Debug, Clone, Default)]
pub struct ClientTls(Arc<RwLock<ClientPems>>);

#[derive(Debug, Clone, Default)]
struct ClientPems {
    /// `--ssl-ca-certs` as PEM: the only roots an `https://` upstream's certificate may chain to.
    roots_pem: Option<Vec<u8>>,
    /// `--ssl-certfile` and `--ssl-keyfile` as one PEM, presented to upstreams that ask.
    identity_pem: Option<Vec<u8>>,
    /// How many times the files were read again.
    generation: u64,
}

impl ClientTls {
    fn pems(&self) -> std::sync::RwLockReadGuard<'_, ClientPems> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the proxy can check an `https://` upstream's certificate.
    pub fn has_roots(&self) -> bool {
        self.pems().roots_pem.is_some()
    }

    /// Bumped each time the files are read again: a client built before is out of date.
    pub(crate) fn generation(&self) -> u64 {
        self.pems().generation
    }

    fn replace(&self, fresh: &ClientTls) {
        let fresh = fresh.pems().clone();
        let mut pems = self.0.write().unwrap_or_else(PoisonError::into_inner);
        *pems = ClientPems { generation: pems.generation + 1, ..fresh };
    }

    /// A client configuration trusting only these roots and presenting this identity (as they
    /// are now); the connector sets ALPN.
    pub(crate) fn config(&self) -> Result<rustls::ClientConfig, TlsError> {
        let pems = self.pems();
        let mut roots = rustls::RootCertStore::empty();
        if let Some(pem) = &pems.roots_pem {
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|e| TlsError::Client { flag: "--ssl-ca-certs", why: format!("not PEM certificates ({e})") })?;
                roots.add(cert).map_err(|e| TlsError::Client { flag: "--ssl-ca-certs", why: format!("not a CA certificate: {e}") })?;
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Client { flag: "--ssl-ca-certs", why: e.to_string() })?
            .with_root_certificates(roots);
        const IDENTITY: &str = "--ssl-certfile/--ssl-keyfile";
        let config = match &pems.identity_pem {
            None => builder.with_no_client_auth(),
            Some(pem) => {
                let chain = CertificateDer::pem_slice_iter(pem)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| TlsError::Client { flag: IDENTITY, why: format!("not PEM certificates ({e})") })?;
                let key = PrivateKeyDer::from_pem_slice(pem)
                    .map_err(|e| TlsError::Client { flag: IDENTITY, why: format!("no PEM private key ({e})") })?;
                builder.with_client_auth_cert(chain, key).map_err(|e| TlsError::Client { flag: IDENTITY, why: e.to_string() })?
            }
        };
        Ok(config)
    }
}

/// The listener's and the upstream client's TLS, from the flags.
#[derive(Debug, Clone, Default)]
pub struct Tls {
    /// `None`: the listener speaks plain HTTP.
    pub server: Option<ServerTls>,
    pub client: ClientTls,
}

/// Python's `ssl.CERT_*`, as `--ssl-cert-reqs` gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CertReqs {
    None,
    Optional,
    Required,
}

impl Tls {
    /// Reads and checks every file the flags name.
    pub fn load(flags: &TlsFlags) -> Result<Tls, TlsError> {
        let reqs = match flags.cert_reqs.unwrap_or(0) {
            0 => CertReqs::None,
            1 => CertReqs::Optional,
            2 => CertReqs::Required,
            n => return Err(TlsError::CertReqs(n)),
        };
        let ca = match &flags.ca_certs {
            Some(path) => Some((path, read("--ssl-ca-certs", path)?)),
            None => None,
        };
        let roots = match &ca {
            Some((path, pem)) => {
                let certs = certs("--ssl-ca-certs", path, pem)?;
                let mut roots = rustls::RootCertStore::empty();
                for cert in certs {
                    roots.add(cert).map_err(|e| TlsError::Ca { path: (*path).clone(), why: format!("not a CA certificate: {e}") })?;
                }
                Some(roots)
            }
            None => None,
        };
        let server = match (&flags.certfile, &flags.keyfile) {
            (None, None) => {
                if reqs != CertReqs::None {
                    return Err(TlsError::NoServerCert { flag: "--ssl-cert-reqs" });
                }
                None
            }
            (Some(_), None) => return Err(TlsError::Half { given: "--ssl-certfile", missing: "--ssl-keyfile" }),
            (None, Some(_)) => return Err(TlsError::Half { given: "--ssl-keyfile", missing: "--ssl-certfile" }),
            (Some(cert_path), Some(key_path)) => {
                let cert_pem = read("--ssl-certfile", cert_path)?;
                let key_pem = read("--ssl-keyfile", key_path)?;
                let chain = certs("--ssl-certfile", cert_path, &cert_pem)?;
                let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Pem {
                    flag: "--ssl-keyfile",
                    path: key_path.clone(),
                    what: format!("no PEM private key in it ({e})"),
                })?;
                let provider = Arc::new(rustls::crypto::ring::default_provider());
                let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
                    .with_safe_default_protocol_versions()
                    .map_err(|e| TlsError::Mismatch { key: key_path.clone(), cert: cert_path.clone(), why: e.to_string() })?;
                let builder = match (reqs, &roots) {
                    (CertReqs::None, _) => builder.with_no_client_auth(),
                    (_, None) => return Err(TlsError::NoClientCa(flags.cert_reqs.unwrap_or(0))),
                    (reqs, Some(roots)) => {
                        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots.clone()), provider);
                        let verifier = if reqs == CertReqs::Optional { verifier.allow_unauthenticated() } else { verifier };
                        let verifier = verifier.build().map_err(|e| TlsError::Ca {
                            path: flags.ca_certs.clone().unwrap_or_default(),
                            why: format!("cannot check client certificates with it: {e}"),
                        })?;
                        builder.with_client_cert_verifier(verifier)
                    }
                };
                let mut config = builder.with_single_cert(chain, key).map_err(|e| TlsError::Mismatch {
                    key: key_path.clone(),
                    cert: cert_path.clone(),
                    why: e.to_string(),
                })?;
                // The listener speaks HTTP/1.1 only.
                config.alpn_protocols = vec![b"http/1.1".to_vec()];
                Some((ServerTls::new(tokio_rustls::TlsAcceptor::from(Arc::new(config))), [cert_pem, key_pem].concat()))
            }
        };
        let (server, identity_pem) = match server {
            Some((s, identity)) => (Some(s), Some(identity)),
            None => (None, None),
        };
        let client = ClientPems { roots_pem: ca.map(|(_, pem)| pem), identity_pem, generation: 0 };
        Ok(Tls { server, client: ClientTls(Arc::new(RwLock::new(client))) })
    }

    /// `--enable-ssl-refresh`: looks at the files `flags` name every `every`; when any changed
    /// (modified, resized or replaced), reads them all again and, if they make a listener,
    /// accepts new connections with them, and the proxy's client to its upstreams trusts and
    /// presents them from its next request on. Runs until the task is dropped with the runtime.
    pub fn refresh_on_change(&self, flags: TlsFlags, every: Duration) -> tokio::task::JoinHandle<()> {
        let tls = self.clone();
        let files = [&flags.certfile, &flags.keyfile, &flags.ca_certs].into_iter().flatten().cloned().collect();
        kvlease_transport::tls::watch_files(files, every, move || match (Tls::load(&flags), &tls.server) {
            (Ok(Tls { server: Some(fresh), client }), Some(server)) => {
                server.replace(&fresh);
                tls.client.replace(&client);
                tracing::info!("--enable-ssl-refresh: the certificate files changed; new connections use them");
                true
            }
            (Ok(_), _) => {
                tracing::error!("--enable-ssl-refresh: the flags name no certificate any more");
                false
            }
            (Err(e), _) => {
                tracing::error!("--enable-ssl-refresh: {e}; still serving the certificate loaded before");
                false
            }
        })
    }
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { flag, path: path.to_path_buf(), source })
}

/// The certificates of a PEM file: at least one, every one well formed.
fn certs(flag: &'static str, path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem).collect::<Result<Vec<_>, _>>().map_err(|e| TlsError::Pem {
        flag,
        path: path.to_path_buf(),
        what: format!("not PEM certificates: {e}"),
    })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            flag,
            path: path.to_path_buf(),
            what: "no PEM certificate (-----BEGIN CERTIFICATE-----) in it".into(),
        });
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(cert: Option<&str>, key: Option<&str>, ca: Option<&str>, reqs: Option<i64>) -> TlsFlags {
        TlsFlags { certfile: cert.map(PathBuf::from), keyfile: key.map(PathBuf::from), ca_certs: ca.map(PathBuf::from), cert_reqs: reqs }
    }

    fn refused(f: TlsFlags) -> String {
        Tls::load(&f).expect_err("refused").to_string()
    }

    /// SPEC S6: no flags, plain HTTP; flags that cannot make an HTTPS listener are refused
    /// naming the flag, before any file is needed.
    #[test]
    fn s6_flags_are_checked_naming_the_flag() {
        assert!(Tls::load(&TlsFlags::default()).unwrap().server.is_none());
        assert!(refused(flags(Some("c"), None, None, None)).starts_with("--ssl-certfile is given without --ssl-keyfile"));
        assert!(refused(flags(None, Some("k"), None, None)).starts_with("--ssl-keyfile is given without --ssl-certfile"));
        assert!(refused(flags(None, None, None, Some(3))).starts_with("--ssl-cert-reqs 3 must be 0"));
        assert!(refused(flags(None, None, None, Some(2))).starts_with("--ssl-cert-reqs is given without --ssl-certfile"));
        let e = refused(flags(None, None, Some("/nonexistent/ca.pem"), None));
        assert!(e.starts_with("--ssl-ca-certs /nonexistent/ca.pem: cannot read it"), "{e}");
    }
}
