//! Per-engine certificates on the transfer plane (SPEC S6): mutual TLS for the tcp agents and
//! the side channel, with the engine id taken from the peer's certificate.
//!
//! Every engine holds a certificate signed by the cluster CA (`--kv-transfer-tls-cert`,
//! `--kv-transfer-tls-key`, `--kv-transfer-tls-ca`). Its engine id is the one URI subject
//! alternative name of the form `kvlease://engine/<engine id>` ([`ENGINE_URI`]); a certificate
//! without exactly one such name is refused. Both sides of every connection present theirs and
//! check the other's chain against the cluster CA; then the caller compares the id in the
//! peer's certificate with the id the peer claims (its agent name, its Hello, its release) and
//! refuses a mismatch naming both. So a name proves nothing by itself any more: an engine that
//! holds the certificate of X can only ever be X (S5 against insiders).
//!
//! Why a URI name and not the CN or a DNS name: engine ids are free-form strings (a UUID, a
//! host name, `prefill-0`), which a DNS name cannot always carry; a URI with a scheme of its own
//! cannot be mistaken for a host's certificate used elsewhere, and the CN is deprecated for
//! names. The host name is not checked: engines are found through `kv_transfer_params`, and the
//! certificate vouches for the engine, not for an address.
//!
//! Reload ([`TransferTls::refresh_on_change`]): the files are read again when any of them
//! changes ([`watch_files`], shared with the HTTPS listener); new connections use the new set,
//! open ones keep theirs. A set that does not load is logged and the current one stays.

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, SystemTime};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::rustls;
use tokio_rustls::rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::{DigitallySignedStruct, SignatureScheme};

/// How a certificate names its engine: this, then the engine id, as a URI subject alternative name.
pub const ENGINE_URI: &str = "kvlease://engine/";

/// The `--kv-transfer-tls-*` flags as given: all three or none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferTlsFlags {
    /// `--kv-transfer-tls-cert`: this engine's certificate (PEM chain, leaf first).
    pub cert: PathBuf,
    /// `--kv-transfer-tls-key`: its private key (PEM).
    pub key: PathBuf,
    /// `--kv-transfer-tls-ca`: the cluster CA (PEM) every peer's certificate must chain to.
    pub ca: PathBuf,
}

/// Why the `--kv-transfer-tls-*` files were refused; every message names the flag.
#[derive(Debug, thiserror::Error)]
pub enum TransferTlsError {
    #[error("{flag} {}: cannot read it: {source}", path.display())]
    Read { flag: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{flag} {}: {what}", path.display())]
    Pem { flag: &'static str, path: PathBuf, what: String },
    #[error("--kv-transfer-tls-cert {}: {why}", path.display())]
    Identity { path: PathBuf, why: String },
    #[error("--kv-transfer-tls-key {} is not the private key of --kv-transfer-tls-cert {}: {why}", key.display(), cert.display())]
    Mismatch { key: PathBuf, cert: PathBuf, why: String },
    #[error("--kv-transfer-tls-ca {}: {why}", path.display())]
    Ca { path: PathBuf, why: String },
}

/// Why a connection's TLS handshake or identity check failed.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// The TLS handshake failed: no certificate, one of another CA, expired, a broken stream.
    #[error("mutual TLS handshake failed: {0} (is its --kv-transfer-tls-cert signed by our --kv-transfer-tls-ca?)")]
    Handshake(std::io::Error),
    /// The chain is good but names no engine.
    #[error("its certificate names no engine: {0}")]
    NoIdentity(String),
    /// The certificate is another engine's than the one claimed.
    #[error("its certificate is engine {cert:?}'s but it claims to be engine {claimed:?}")]
    Mismatch { cert: String, claimed: String },
}

impl PeerError {
    /// The peer closed before the handshake was done, without an alert: a port probe (a health
    /// check, a scan) or a peer giving up; not worth a warning nor a count.
    pub fn is_silent_close(&self) -> bool {
        matches!(self, PeerError::Handshake(e) if e.kind() == std::io::ErrorKind::UnexpectedEof)
    }
}

/// This engine's certificate, key and cluster CA, ready to accept and dial; cheap to clone, and
/// replaced in place by a refresh.
#[derive(Clone)]
pub struct TransferTls {
    loaded: Arc<RwLock<Loaded>>,
    flags: Arc<TransferTlsFlags>,
}

#[derive(Clone)]
struct Loaded {
    engine_id: String,
    acceptor: tokio_rustls::TlsAcceptor,
    connector: tokio_rustls::TlsConnector,
}

impl std::fmt::Debug for TransferTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferTls").field("engine_id", &self.engine_id()).field("flags", &self.flags).finish()
    }
}

impl TransferTls {
    /// Reads and checks the three files: the certificate must chain to the CA and name exactly
    /// one engine, and the key must be its key.
    pub fn load(flags: &TransferTlsFlags) -> Result<TransferTls, TransferTlsError> {
        Ok(TransferTls { loaded: Arc::new(RwLock::new(Loaded::read(flags)?)), flags: Arc::new(flags.clone()) })
    }

    /// The engine id our own certificate names.
    pub fn engine_id(&self) -> String {
        self.current().engine_id
    }

    fn current(&self) -> Loaded {
        self.loaded.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The server side of a connection: TLS with a client certificate the cluster CA signed.
    /// Returns the stream and the engine id the peer's certificate names.
    pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: S,
    ) -> Result<(tokio_rustls::server::TlsStream<S>, String), PeerError> {
        let tls = self.current().acceptor.accept(stream).await.map_err(PeerError::Handshake)?;
        let id = peer_engine(tls.get_ref().1.peer_certificates())?;
        Ok((tls, id))
    }

    /// The client side of a connection to the engine `expect`: TLS presenting our certificate,
    /// and the server's must be `expect`'s, signed by the cluster CA.
    pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: S,
        expect: &str,
    ) -> Result<tokio_rustls::client::TlsStream<S>, PeerError> {
        // Not checked (see the module doc): the engine id in the certificate is.
        let name = ServerName::try_from("kvlease-engine").expect("a valid DNS name");
        let tls = self.current().connector.connect(name, stream).await.map_err(PeerError::Handshake)?;
        let id = peer_engine(tls.get_ref().1.peer_certificates())?;
        check_claim(&id, expect)?;
        Ok(tls)
    }

    /// Reads the files again whenever one changes ([`watch_files`]); new connections use the
    /// new set. A set that does not load, or names another engine, is logged and ignored.
    pub fn refresh_on_change(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let tls = self.clone();
        let files = vec![self.flags.cert.clone(), self.flags.key.clone(), self.flags.ca.clone()];
        watch_files(files, every, move || match Loaded::read(&tls.flags) {
            Ok(fresh) if fresh.engine_id != tls.engine_id() => {
                tracing::error!(
                    "--kv-transfer-tls-cert changed to engine {:?}'s certificate, but this engine is {:?}; keeping the one loaded before",
                    fresh.engine_id,
                    tls.engine_id()
                );
                false
            }
            Ok(fresh) => {
                *tls.loaded.write().unwrap_or_else(PoisonError::into_inner) = fresh;
                tracing::info!("--kv-transfer-tls-*: the certificate files changed; new transfer connections use them");
                true
            }
            Err(e) => {
                tracing::error!("--kv-transfer-tls-*: {e}; still using the certificates loaded before");
                false
            }
        })
    }
}

/// Refuses an engine whose certificate is not the one of the engine it claims to be.
pub fn check_claim(cert: &str, claimed: &str) -> Result<(), PeerError> {
    if cert == claimed {
        Ok(())
    } else {
        Err(PeerError::Mismatch { cert: cert.to_owned(), claimed: claimed.to_owned() })
    }
}

/// The engine id of a tcp agent's name (`{engine_id}/{incarnation}/{rank}`).
pub fn agent_engine(agent: &str) -> &str {
    agent.rsplitn(3, '/').nth(2).unwrap_or(agent)
}

fn peer_engine(certs: Option<&[CertificateDer<'static>]>) -> Result<String, PeerError> {
    let leaf = certs.and_then(|c| c.first()).ok_or_else(|| PeerError::NoIdentity("it presented no certificate".into()))?;
    engine_of(leaf).map_err(PeerError::NoIdentity)
}

/// The engine id a certificate names: its one `kvlease://engine/<id>` URI name.
pub fn engine_of(cert: &CertificateDer<'_>) -> Result<String, String> {
    let uris = der::san_uris(cert).ok_or_else(|| "its subject alternative names cannot be read".to_string())?;
    let ids: Vec<&str> = uris.iter().filter_map(|u| u.strip_prefix(ENGINE_URI)).collect();
    match ids.as_slice() {
        [id] if !id.is_empty() => Ok((*id).to_owned()),
        [] | [_] => Err(format!("no URI subject alternative name {ENGINE_URI}<engine id> (found {uris:?})")),
        _ => Err(format!("several engine names {ids:?}: a certificate is one engine's")),
    }
}

impl Loaded {
    fn read(flags: &TransferTlsFlags) -> Result<Loaded, TransferTlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let ca_pem = read("--kv-transfer-tls-ca", &flags.ca)?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in certs("--kv-transfer-tls-ca", &flags.ca, &ca_pem)? {
            roots.add(cert).map_err(|e| TransferTlsError::Ca { path: flags.ca.clone(), why: format!("not a CA certificate: {e}") })?;
        }
        let roots = Arc::new(roots);
        let cert_pem = read("--kv-transfer-tls-cert", &flags.cert)?;
        let chain = certs("--kv-transfer-tls-cert", &flags.cert, &cert_pem)?;
        let engine_id = engine_of(&chain[0]).map_err(|why| TransferTlsError::Identity { path: flags.cert.clone(), why })?;
        // Our own certificate must pass the check every peer will make of it.
        let verifier = ClusterCa { roots: roots.clone(), provider: provider.clone() };
        verifier.verify_chain(&chain[0], &chain[1..]).map_err(|e| TransferTlsError::Identity {
            path: flags.cert.clone(),
            why: format!("not signed by --kv-transfer-tls-ca {}: {e}", flags.ca.display()),
        })?;
        let key_pem = read("--kv-transfer-tls-key", &flags.key)?;
        let key = || {
            PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TransferTlsError::Pem {
                flag: "--kv-transfer-tls-key",
                path: flags.key.clone(),
                what: format!("no PEM private key in it ({e})"),
            })
        };
        let mismatch =
            |e: rustls::Error| TransferTlsError::Mismatch { key: flags.key.clone(), cert: flags.cert.clone(), why: e.to_string() };
        let client_verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| TransferTlsError::Ca { path: flags.ca.clone(), why: format!("cannot check certificates with it: {e}") })?;
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(mismatch)?
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(chain.clone(), key()?)
            .map_err(mismatch)?;
        let client = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(mismatch)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_auth_cert(chain, key()?)
            .map_err(mismatch)?;
        Ok(Loaded {
            engine_id,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(server)),
            connector: tokio_rustls::TlsConnector::from(Arc::new(client)),
        })
    }
}

/// The dialer's check of a server's certificate: its chain to the cluster CA, as webpki checks
/// any server's, but no host name (the engine id is checked after the handshake).
#[derive(Debug)]
struct ClusterCa {
    roots: Arc<rustls::RootCertStore>,
    provider: Arc<CryptoProvider>,
}

impl ClusterCa {
    fn verify_chain(&self, leaf: &CertificateDer<'_>, intermediates: &[CertificateDer<'_>]) -> Result<(), rustls::Error> {
        let parsed = rustls::server::ParsedCertificate::try_from(leaf)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            UnixTime::now(),
            self.provider.signature_verification_algorithms.all,
        )
    }
}

impl ServerCertVerifier for ClusterCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.verify_chain(end_entity, intermediates)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TransferTlsError> {
    std::fs::read(path).map_err(|source| TransferTlsError::Read { flag, path: path.to_path_buf(), source })
}

/// The certificates of a PEM file: at least one, every one well formed.
fn certs(flag: &'static str, path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TransferTlsError> {
    let certs = CertificateDer::pem_slice_iter(pem).collect::<Result<Vec<_>, _>>().map_err(|e| TransferTlsError::Pem {
        flag,
        path: path.to_path_buf(),
        what: format!("not PEM certificates: {e}"),
    })?;
    if certs.is_empty() {
        return Err(TransferTlsError::Pem {
            flag,
            path: path.to_path_buf(),
            what: "no PEM certificate (-----BEGIN CERTIFICATE-----) in it".into(),
        });
    }
    Ok(certs)
}

/// What identifies a file's current content without reading it: modification time, length and
/// inode (a file replaced by a rename has a new one); `None` while it is missing.
pub type FileStamp = Option<(Option<SystemTime>, u64, u64)>;

/// The stamps of `files`, in order.
pub fn stamp(files: &[PathBuf]) -> Vec<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    files.iter().map(|p| std::fs::metadata(p).ok().map(|m| (m.modified().ok(), m.len(), m.ino()))).collect()
}

/// Looks at `files` every `every`; when any changed (modified, resized or replaced) since the
/// last set `reload` accepted or the last one it was tried on, calls `reload`, which says whether
/// it took the new set. Runs until the task is aborted or dropped with the runtime. The HTTPS
/// listener's `--enable-ssl-refresh` and the transfer plane's certificates both reload this way.
pub fn watch_files(files: Vec<PathBuf>, every: Duration, mut reload: impl FnMut() -> bool + Send + 'static) -> tokio::task::JoinHandle<()> {
    // Stamped now, not when the task first runs: a change made meanwhile is a change.
    let mut loaded = stamp(&files);
    let mut tried = loaded.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            let now = stamp(&files);
            if now == loaded || now == tried {
                continue;
            }
            tried = now.clone();
            if reload() {
                loaded = now;
            }
        }
    })
}

/// Just enough DER to find a certificate's URI subject alternative names. The certificate has
/// passed webpki's chain check (or is our own, checked at load) before this reads it.
mod der {
    const SEQUENCE: u8 = 0x30;
    const EXTENSIONS: u8 = 0xa3;
    const OID: u8 = 0x06;
    const OCTETS: u8 = 0x04;
    const URI: u8 = 0x86;
    /// 2.5.29.17, subjectAltName.
    const SAN: [u8; 3] = [0x55, 0x1d, 0x11];

    /// One TLV at the start of `b`: its tag, its value, and what follows.
    fn tlv(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
        let (&tag, rest) = b.split_first()?;
        let (&first, rest) = rest.split_first()?;
        let (len, rest) = if first < 0x80 {
            (first as usize, rest)
        } else {
            let n = (first & 0x7f) as usize;
            if n == 0 || n > 4 || rest.len() < n {
                return None;
            }
            (rest[..n].iter().fold(0usize, |l, &x| (l << 8) | x as usize), &rest[n..])
        };
        (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
    }

    fn items(mut b: &[u8]) -> impl Iterator<Item = (u8, &[u8])> {
        std::iter::from_fn(move || {
            let (tag, value, rest) = tlv(b)?;
            b = rest;
            Some((tag, value))
        })
    }

    /// The URI names of the certificate's subjectAltName extension; empty without one, `None` if
    /// it is not DER this understands.
    pub(super) fn san_uris(cert: &[u8]) -> Option<Vec<String>> {
        let (SEQUENCE, cert, _) = tlv(cert)? else { return None };
        let (SEQUENCE, tbs, _) = tlv(cert)? else { return None };
        let Some((_, exts)) = items(tbs).find(|(tag, _)| *tag == EXTENSIONS) else { return Some(Vec::new()) };
        let (SEQUENCE, exts, _) = tlv(exts)? else { return None };
        for (_, ext) in items(exts) {
            let mut fields = items(ext);
            let Some((OID, oid)) = fields.next() else { return None };
            if oid != SAN {
                continue;
            }
            let (_, value) = fields.find(|(tag, _)| *tag == OCTETS)?;
            let (SEQUENCE, names, _) = tlv(value)? else { return None };
            return Some(items(names).filter(|(tag, _)| *tag == URI).map(|(_, v)| String::from_utf8_lossy(v).into_owned()).collect());
        }
        Some(Vec::new())
    }
}

#[cfg(test)]
pub(crate) mod tests;
