use super::*;
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType};

/// A CA and certificates it signed, as PEM files in a directory removed at drop.
pub(crate) struct Pki {
    pub(crate) dir: PathBuf,
    ca: (rcgen::Certificate, KeyPair),
}

impl Pki {
    pub(crate) fn new(name: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("kvlease-tls-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = make_ca("cluster CA");
        std::fs::write(dir.join("ca.pem"), ca.0.pem()).unwrap();
        Pki { dir, ca }
    }

    /// `file.pem`/`file.key`: a certificate naming `uris` (`kvlease://engine/<id>` for an engine),
    /// signed by the cluster CA, or by a CA of its own if `foreign`.
    pub(crate) fn leaf(&self, file: &str, uris: &[&str], foreign: bool) -> TransferTlsFlags {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(DnType::CommonName, file);
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        for u in uris {
            p.subject_alt_names.push(SanType::URI((*u).try_into().unwrap()));
        }
        let key = KeyPair::generate().unwrap();
        let other;
        let (issuer, issuer_key) = if foreign {
            other = make_ca("another CA");
            std::fs::write(self.dir.join(format!("{file}-ca.pem")), other.0.pem()).unwrap();
            (&other.0, &other.1)
        } else {
            (&self.ca.0, &self.ca.1)
        };
        let cert = p.signed_by(&key, issuer, issuer_key).unwrap();
        std::fs::write(self.dir.join(format!("{file}.key")), key.serialize_pem()).unwrap();
        std::fs::write(self.dir.join(format!("{file}.pem")), cert.pem()).unwrap();
        TransferTlsFlags {
            cert: self.dir.join(format!("{file}.pem")),
            key: self.dir.join(format!("{file}.key")),
            ca: self.dir.join("ca.pem"),
        }
    }

    pub(crate) fn engine(&self, id: &str) -> TransferTls {
        TransferTls::load(&self.leaf(id, &[&format!("{ENGINE_URI}{id}")], false)).unwrap()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn make_ca(name: &str) -> (rcgen::Certificate, KeyPair) {
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, name);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let key = KeyPair::generate().unwrap();
    (p.self_signed(&key).unwrap(), key)
}

fn refused(flags: &TransferTlsFlags) -> String {
    TransferTls::load(flags).expect_err("refused").to_string()
}

/// SPEC S6: the engine id is the certificate's one `kvlease://engine/<id>` URI name; files that
/// cannot make an engine's identity are refused naming the flag.
#[test]
fn s6_the_engine_id_is_the_certificates_uri_and_bad_files_name_their_flag() {
    let pki = Pki::new("load");
    assert_eq!(pki.engine("prefill-0").engine_id(), "prefill-0");
    let f = pki.leaf("two", &["https://example.com/", "kvlease://engine/d/with/slashes"], false);
    assert_eq!(TransferTls::load(&f).unwrap().engine_id(), "d/with/slashes");

    let e = refused(&pki.leaf("none", &["https://example.com/"], false));
    assert!(e.starts_with("--kv-transfer-tls-cert") && e.contains("no URI subject alternative name kvlease://engine/"), "{e}");
    let e = refused(&pki.leaf("both", &["kvlease://engine/a", "kvlease://engine/b"], false));
    assert!(e.contains("several engine names"), "{e}");
    let e = refused(&pki.leaf("foreign", &["kvlease://engine/x"], true));
    assert!(e.starts_with("--kv-transfer-tls-cert") && e.contains("not signed by --kv-transfer-tls-ca"), "{e}");

    let good = pki.leaf("good", &["kvlease://engine/g"], false);
    let e = refused(&TransferTlsFlags { key: pki.dir.join("none.key"), ..good.clone() });
    assert!(e.starts_with("--kv-transfer-tls-key") && e.contains("is not the private key of --kv-transfer-tls-cert"), "{e}");
    let e = refused(&TransferTlsFlags { ca: pki.dir.join("missing.pem"), ..good.clone() });
    assert!(e.starts_with("--kv-transfer-tls-ca") && e.contains("cannot read it"), "{e}");
    let e = refused(&TransferTlsFlags { cert: pki.dir.join("good.key"), ..good });
    assert!(e.starts_with("--kv-transfer-tls-cert") && e.contains("no PEM certificate"), "{e}");
}

async fn pair(server: &TransferTls, client: &TransferTls, expect: &str) -> (Result<String, PeerError>, Result<(), PeerError>) {
    let (a, b) = tokio::io::duplex(64 * 1024);
    let (s, c) = tokio::join!(server.accept(a), client.connect(b, expect));
    (s.map(|(_, id)| id), c.map(|_| ()))
}

/// SPEC S6: both ends learn the other's engine id from its certificate; a dialer refuses a
/// server whose certificate is another engine's than the one it meant, naming both; a
/// certificate of another CA gets no connection either way.
#[tokio::test]
async fn s6_each_side_learns_the_other_from_its_certificate() {
    let pki = Pki::new("pair");
    let (p, d) = (pki.engine("p"), pki.engine("d"));
    let (s, c) = pair(&p, &d, "p").await;
    assert_eq!(s.unwrap(), "d");
    c.unwrap();

    let (_, c) = pair(&p, &d, "q").await;
    let e = c.unwrap_err().to_string();
    assert_eq!(e, "its certificate is engine \"p\"'s but it claims to be engine \"q\"");

    let stranger =
        TransferTls::load(&TransferTlsFlags { ca: pki.dir.join("x-ca.pem"), ..pki.leaf("x", &["kvlease://engine/x"], true) }).unwrap();
    let (s, c) = pair(&p, &stranger, "p").await;
    assert!(s.is_err() && c.is_err(), "another CA's engine is refused, and refuses");
    assert!(s.unwrap_err().to_string().starts_with("mutual TLS handshake failed"));
    let (s, c) = pair(&stranger, &d, "x").await;
    assert!(s.is_err() && c.unwrap_err().to_string().starts_with("mutual TLS handshake failed"));
}

/// SPEC S6: reload — new connections use the files as they are now.
#[tokio::test]
async fn s6_a_changed_certificate_is_used_for_new_connections() {
    let pki = Pki::new("reload");
    let flags = pki.leaf("p", &["kvlease://engine/p"], false);
    let p = TransferTls::load(&flags).unwrap();
    let _watch = p.refresh_on_change(Duration::from_millis(20));
    let before = std::fs::read(&flags.cert).unwrap();
    pki.leaf("p", &["kvlease://engine/p"], false);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let d = pki.engine("d");
    loop {
        let (a, b) = tokio::io::duplex(64 * 1024);
        let (_, c) = tokio::join!(p.accept(a), d.connect(b, "p"));
        let served = c.unwrap().get_ref().1.peer_certificates().unwrap()[0].to_vec();
        let now = CertificateDer::pem_slice_iter(&std::fs::read(&flags.cert).unwrap()).next().unwrap().unwrap().to_vec();
        if served == now && now != CertificateDer::pem_slice_iter(&before).next().unwrap().unwrap().to_vec() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the new certificate was never served");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
