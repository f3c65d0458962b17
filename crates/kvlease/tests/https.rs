//! SPEC S6, the HTTP half: `kvlease serve` and `kvlease proxy` take vLLM's `--ssl-keyfile`,
//! `--ssl-certfile`, `--ssl-ca-certs` and `--ssl-cert-reqs` (uvicorn's meanings), and the proxy
//! speaks HTTPS to engines given as `https://host`. Real processes on loopback, a real HTTPS
//! client, and a CA with its certificates made here.

mod common;

use common::{lease_config, post, text_of, Proc, DEADLINE};
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A CA, and certificates it signed, as PEM files in a directory removed at drop.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    /// `ca.pem`; `server.pem`/`server.key` (localhost, 127.0.0.1; server and client use: the
    /// proxy presents it to engines that ask); `client.pem`/`client.key` (client use); and
    /// `other.pem`/`other.key`, of another CA.
    fn new(name: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("kvlease-https-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let (ca, ca_key) = make_ca("kvlease test CA");
        let (other_ca, other_key) = make_ca("another CA");
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        let pki = Pki { dir };
        use ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
        pki.leaf("server", vec![ServerAuth, ClientAuth], &ca, &ca_key);
        pki.leaf("client", vec![ClientAuth], &ca, &ca_key);
        pki.leaf("other", vec![ClientAuth], &other_ca, &other_key);
        pki
    }

    /// `file.pem` and `file.key`: a certificate for localhost and 127.0.0.1 signed by `issuer`
    /// (the key written first, as a rotation writes them one after the other).
    fn leaf(&self, file: &str, uses: Vec<ExtendedKeyUsagePurpose>, issuer: &rcgen::Certificate, issuer_key: &KeyPair) {
        let mut p = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        p.subject_alt_names.push(SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()));
        p.distinguished_name.push(DnType::CommonName, file);
        p.extended_key_usages = uses;
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, issuer, issuer_key).unwrap();
        std::fs::write(self.dir.join(format!("{file}.key")), key.serialize_pem()).unwrap();
        std::fs::write(self.dir.join(format!("{file}.pem")), cert.pem()).unwrap();
    }

    fn path(&self, file: &str) -> String {
        self.dir.join(file).to_str().expect("utf-8 path").to_string()
    }

    /// `--ssl-certfile`, `--ssl-keyfile`, `--ssl-ca-certs`, and `more`.
    fn flags(&self, more: &[&str]) -> Vec<String> {
        let mut f = vec![
            "--ssl-certfile".into(),
            self.path("server.pem"),
            "--ssl-keyfile".into(),
            self.path("server.key"),
            "--ssl-ca-certs".into(),
            self.path("ca.pem"),
        ];
        f.extend(more.iter().map(|s| s.to_string()));
        f
    }

    /// An HTTPS client trusting only the test CA, presenting `identity` (`"client"`, `"other"`)
    /// if given.
    fn client(&self, identity: Option<&str>) -> reqwest::Client {
        self.client_trusting("ca.pem", identity)
    }

    /// As [`Pki::client`], trusting only the CA in `ca_file`; each request on a new connection.
    fn client_trusting(&self, ca_file: &str, identity: Option<&str>) -> reqwest::Client {
        let ca = reqwest::Certificate::from_pem(&std::fs::read(self.dir.join(ca_file)).unwrap()).unwrap();
        let mut b = reqwest::Client::builder()
            .no_proxy()
            .timeout(DEADLINE)
            .pool_max_idle_per_host(0)
            .tls_built_in_root_certs(false)
            .add_root_certificate(ca);
        if let Some(id) = identity {
            let pem =
                [std::fs::read(self.dir.join(format!("{id}.pem"))).unwrap(), std::fs::read(self.dir.join(format!("{id}.key"))).unwrap()]
                    .concat();
            b = b.identity(reqwest::Identity::from_pem(&pem).unwrap());
        }
        b.build().expect("client")
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

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

async fn get(client: &reqwest::Client, url: &str) -> Result<(u16, String), reqwest::Error> {
    let r = client.get(url).send().await?;
    let status = r.status().as_u16();
    Ok((status, r.text().await?))
}

async fn post_with(client: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let r = client.post(url).json(body).send().await.expect("send");
    let status = r.status().as_u16();
    (status, r.json().await.expect("JSON"))
}

async fn metric(client: &reqwest::Client, base: &str, name: &str) -> f64 {
    let (_, text) = get(client, &format!("{base}/metrics")).await.expect("metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).map(|v| v.trim().parse::<f64>().expect("number")))
        .unwrap_or_else(|| panic!("metric {name} not found"))
}

/// SPEC S6: P and D serve HTTPS and require a client certificate (`--ssl-cert-reqs 2`); the proxy
/// serves HTTPS, reaches them as `https://127.0.0.1` trusting `--ssl-ca-certs` and presenting its
/// own certificate; completions through it, streamed or not, equal the local answer, and each
/// lease is transferred (the P leg, the D leg and D's read all happened).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_p_d_and_proxy_over_https_answer_as_local() {
    p_d_and_proxy_over_https("tcp").await;
}

/// The same with P and D on NIXL (`--transport nixl`): HTTPS is the HTTP surface's, whatever
/// moves the KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_nixl_p_d_and_proxy_over_https_answer_as_local() {
    if common::nixl_or_skip() {
        p_d_and_proxy_over_https("nixl").await;
    }
}

async fn p_d_and_proxy_over_https(transport: &str) {
    let pki = Pki::new(&format!("pd-{transport}"));
    let cfg = lease_config(30.0);
    let engine = pki.flags(&["--ssl-cert-reqs", "2", "--kv-transfer-config", &cfg, "--transport", transport]);
    let p = Proc::serve("s6-p", &refs(&engine));
    let d = Proc::serve("s6-d", &refs(&engine));
    assert!(p.url.starts_with("https://127.0.0.1:"), "{}", p.url);
    let local = Proc::serve("s6-local", &[]);
    let proxy = Proc::proxy_with(&[&p], &[&d], &refs(&pki.flags(&[])));
    assert!(proxy.url.starts_with("https://127.0.0.1:"), "{}", proxy.url);
    let client = pki.client(None);
    for (i, (path, chat)) in [("/v1/completions", false), ("/v1/chat/completions", true)].into_iter().enumerate() {
        let prompt = format!("the lease travels over https, turn {i}");
        let body = if chat {
            json!({"model": "kvlease-synthetic", "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "ignore_eos": true})
        } else {
            json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 12, "ignore_eos": true})
        };
        let (status, want) = post(&format!("{}{path}", local.url), &body).await;
        assert_eq!(status, 200, "{want}");
        let want = text_of(&want, chat);
        let (status, got) = post_with(&client, &format!("{}{path}", proxy.url), &body).await;
        assert_eq!(status, 200, "{got}");
        assert_eq!(text_of(&got, chat), want);
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let sse = client.post(format!("{}{path}", proxy.url)).json(&streamed).send().await.expect("send").text().await.expect("stream");
        let (text, _, done) = common::sse_text(&sse, chat).unwrap_or_else(|e| panic!("SSE error {e}"));
        assert!(done, "{sse}");
        assert_eq!(text, want);
    }
    let (status, health) = get(&client, &format!("{}/health", proxy.url)).await.expect("proxy /health");
    assert_eq!(status, 200, "{health}");
    let engine_client = pki.client(Some("client"));
    common::until("P holds no lease", DEADLINE, || async { metric(&engine_client, &p.url, "kvlease_leases_active").await == 0.0 }).await;
    assert_eq!(metric(&engine_client, &p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 4.0);
    assert_eq!(metric(&engine_client, &d.url, "kvlease_recomputed_requests_total").await, 0.0);
}

/// SPEC S6: plain HTTP to an HTTPS port gets no HTTP answer and its connection is closed; a
/// connection that never starts its handshake is closed at the header timeout; the server goes
/// on serving HTTPS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_plain_http_to_an_https_port_is_closed_and_the_server_goes_on() {
    let pki = Pki::new("plain");
    let serve = Proc::serve("s6-plain", &refs(&pki.flags(&["--http-header-timeout", "1"])));
    let addr = serve.url.trim_start_matches("https://").to_string();
    let http_url = format!("http://{addr}/health");
    let plain = common::client().get(&http_url).send().await;
    assert!(plain.is_err(), "plain HTTP got an answer: {plain:?}");

    let mut raw = std::net::TcpStream::connect(&addr).expect("connect");
    raw.set_read_timeout(Some(DEADLINE)).unwrap();
    raw.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
    let mut got = Vec::new();
    // EOF or a reset, after at most a TLS alert.
    let _ = raw.read_to_end(&mut got);
    assert!(!got.starts_with(b"HTTP/"), "an HTTP answer on an HTTPS port: {:?}", String::from_utf8_lossy(&got));
    assert!(got.len() < 64, "more than an alert: {got:?}");

    let t0 = Instant::now();
    let mut silent = std::net::TcpStream::connect(&addr).expect("connect");
    silent.set_read_timeout(Some(DEADLINE)).unwrap();
    let n = silent.read(&mut [0u8; 64]).unwrap_or(0);
    assert_eq!(n, 0, "closed without a word");
    assert!(t0.elapsed() < Duration::from_secs(5), "closed at the 1 s header timeout, not after {:?}", t0.elapsed());

    let (status, body) = get(&pki.client(None), &format!("{}/health", serve.url)).await.expect("HTTPS after all that");
    assert_eq!(status, 200, "{body}");
}

/// SPEC S6 with issue 22's bound: over TLS, a client that never reads its stream is reset at
/// `--http-write-timeout` (2 s, + a quarter, + slack), its request aborted and counted as
/// `write_timeout`; the timeout still reads the TCP socket under the TLS stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_a_never_reading_tls_client_is_cut_at_the_write_timeout() {
    use tokio::io::AsyncWriteExt;
    use tokio_rustls::rustls;
    let pki = Pki::new("unread");
    let serve = Proc::serve(
        "s6-unread",
        &refs(&pki.flags(&["--http-write-timeout", "2", "--decode-ms-per-token", "3", "--num-gpu-blocks", "4096"])),
    );
    let addr: std::net::SocketAddr = serve.url.trim_start_matches("https://").parse().expect("host:port");
    let mut roots = rustls::RootCertStore::empty();
    let ca = rustls::pki_types::pem::PemObject::from_pem_file(pki.dir.join("ca.pem")).expect("CA");
    roots.add(ca).expect("root");
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let tcp = socket.connect(addr).await.expect("connect");
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)).connect(name, tcp).await.expect("handshake");
    let body = json!({"prompt": "hello", "max_tokens": 4000, "ignore_eos": true, "stream": true}).to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: kvlease\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    tls.write_all(format!("{head}{body}").as_bytes()).await.expect("request");
    tls.flush().await.expect("flush");
    let sent = Instant::now();
    let limit = Duration::from_secs_f64(2.0 * 1.25) + Duration::from_secs(3);
    while !matches!(tls.get_ref().0.take_error(), Ok(Some(_))) {
        assert!(sent.elapsed() < limit, "the never-reading TLS client was not reset within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(sent.elapsed() >= Duration::from_secs(2), "cut before the write timeout: {:?}", sent.elapsed());
    let client = pki.client(None);
    let aborted = "kvlease_http_responses_aborted_total{reason=\"write_timeout\"}";
    assert_eq!(metric(&client, &serve.url, aborted).await, 1.0);
    common::until("the request aborted", Duration::from_secs(8), || async {
        metric(&client, &serve.url, "kvlease_requests_running").await == 0.0
    })
    .await;
}

/// SPEC S6, vLLM's `--ssl-cert-reqs 2` (ssl.CERT_REQUIRED): a client without a certificate, or
/// with one another CA signed, is refused; one with a certificate `--ssl-ca-certs` signed is
/// served. With 1 (CERT_OPTIONAL), a client without one is served too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_cert_reqs_2_serves_only_clients_with_a_ca_signed_certificate() {
    let pki = Pki::new("mtls");
    let serve = Proc::serve("s6-mtls", &refs(&pki.flags(&["--ssl-cert-reqs", "2"])));
    let health = format!("{}/health", serve.url);
    for who in [None, Some("other")] {
        let r = get(&pki.client(who), &health).await;
        assert!(r.is_err(), "client {who:?} was served: {r:?}");
    }
    let (status, body) = get(&pki.client(Some("client")), &health).await.expect("a CA-signed client");
    assert_eq!(status, 200, "{body}");

    let optional = Proc::serve("s6-optional", &refs(&pki.flags(&["--ssl-cert-reqs", "1"])));
    let health = format!("{}/health", optional.url);
    for who in [None, Some("client")] {
        let (status, body) = get(&pki.client(who), &health).await.unwrap_or_else(|e| panic!("{who:?}: {e}"));
        assert_eq!(status, 200, "{body}");
    }
    assert!(get(&pki.client(Some("other")), &health).await.is_err(), "a certificate of another CA is refused");
}

/// SPEC S6: `--ssl-*` values that cannot make an HTTPS listener are refused at start-up, exit
/// code 2, with a message naming the flag.
#[test]
fn s6_bad_ssl_flags_are_refused_naming_the_flag() {
    let pki = Pki::new("bad");
    let p = |f: &str| pki.path(f);
    std::fs::write(pki.dir.join("garbage.pem"), "not a certificate\n").unwrap();
    let (cert, key, ca) = (p("server.pem"), p("server.key"), p("ca.pem"));
    let (other_key, client_key, garbage) = (p("other.key"), p("client.key"), p("garbage.pem"));
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["serve", "--ssl-keyfile", &key], "--ssl-keyfile is given without --ssl-certfile"),
        (vec!["serve", "--ssl-certfile", &cert], "--ssl-certfile is given without --ssl-keyfile"),
        (
            vec!["serve", "--ssl-certfile", "/nonexistent/cert.pem", "--ssl-keyfile", &key],
            "--ssl-certfile /nonexistent/cert.pem: cannot read it",
        ),
        (
            vec!["serve", "--ssl-certfile", &cert, "--ssl-keyfile", "/nonexistent/key.pem"],
            "--ssl-keyfile /nonexistent/key.pem: cannot read it",
        ),
        (vec!["serve", "--ssl-certfile", &cert, "--ssl-keyfile", &other_key], "is not the private key of --ssl-certfile"),
        (vec!["serve", "--ssl-certfile", &garbage, "--ssl-keyfile", &key], "--ssl-certfile"),
        (vec!["serve", "--ssl-certfile", &cert, "--ssl-keyfile", &cert], "--ssl-keyfile"),
        (vec!["serve", "--ssl-certfile", &cert, "--ssl-keyfile", &key, "--ssl-cert-reqs", "3"], "--ssl-cert-reqs 3 must be 0"),
        (
            vec!["serve", "--ssl-certfile", &cert, "--ssl-keyfile", &key, "--ssl-cert-reqs", "2"],
            "--ssl-cert-reqs 2 asks clients for certificates: give --ssl-ca-certs",
        ),
        (vec!["serve", "--ssl-certfile", &cert, "--ssl-keyfile", &key, "--ssl-ca-certs", &garbage], "--ssl-ca-certs"),
        (vec!["serve", "--ssl-ca-certs", &ca], "--ssl-ca-certs is given without --ssl-certfile"),
        (vec!["serve", "--enable-ssl-refresh"], "--enable-ssl-refresh is given without --ssl-certfile and --ssl-keyfile"),
        (vec!["proxy", "--prefiller-hosts", "https://127.0.0.1", "--prefiller-ports", "1"], "speaks HTTPS: give --ssl-ca-certs"),
        (vec!["proxy", "--prefiller-hosts", "https://127.0.0.1:8100", "--prefiller-ports", "1"], "--prefiller-hosts"),
        (vec!["proxy", "--ssl-certfile", &cert, "--ssl-keyfile", &client_key], "is not the private key of --ssl-certfile"),
    ];
    for (args, want) in cases {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvlease"))
            .args(&args)
            .args(["--port", "0", "--log-level", "warn"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run kvlease");
        let t0 = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait") {
                break status;
            }
            if t0.elapsed() > DEADLINE {
                let _ = child.kill();
                panic!("{args:?} started instead of being refused");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut stderr = String::new();
        child.stderr.take().expect("stderr").read_to_string(&mut stderr).expect("stderr");
        assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr:?} does not say {want:?}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// vLLM's `--enable-ssl-refresh` (issue 26: operators rotate certificates): `kvlease serve`
/// reads its certificate files again when they change. A rotation to a certificate of another
/// CA, written key first (the moment between the two writes is a mismatched pair, not taken),
/// is served to new connections without a restart; then a broken certificate file is refused
/// with a log line naming the flag, and the last good certificate stays in service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_enable_ssl_refresh_serves_a_rotated_certificate_and_keeps_the_last_good_one() {
    let pki = Pki::new("refresh");
    let log = pki.dir.join("serve.log");
    let logs = std::fs::File::create(&log).expect("log file");
    let serve = Proc::serve_logging_to("s6-refresh", &refs(&pki.flags(&["--enable-ssl-refresh"])), Stdio::from(logs));
    let health = format!("{}/health", serve.url);
    assert_eq!(get(&pki.client(None), &health).await.expect("served with the first certificate").0, 200);

    let (ca2, ca2_key) = make_ca("rotated CA");
    std::fs::write(pki.dir.join("ca2.pem"), ca2.pem()).unwrap();
    pki.leaf("server", vec![ExtendedKeyUsagePurpose::ServerAuth], &ca2, &ca2_key);
    let rotated = pki.client_trusting("ca2.pem", None);
    common::until("the rotated certificate to be served", DEADLINE, || async { get(&rotated, &health).await.is_ok() }).await;
    assert!(get(&pki.client(None), &health).await.is_err(), "the first CA's clients no longer see its certificate");

    std::fs::write(pki.dir.join("server.pem"), "-----BEGIN CERTIFICATE-----\nbroken\n").unwrap();
    common::until("the broken file to be refused in the log", DEADLINE, || async {
        std::fs::read_to_string(&log).unwrap_or_default().contains("--enable-ssl-refresh: --ssl-certfile")
    })
    .await;
    assert_eq!(get(&rotated, &health).await.expect("the last good certificate still served").0, 200);
}

/// vLLM's `--enable-ssl-refresh` on the proxy, its client half (issue 26): the engines were
/// moved to certificates of a new CA, and the proxy, which trusts only `--ssl-ca-certs`, cannot
/// reach them (every request fails, nothing is answered wrong). Once the operator writes the new
/// CA into the proxy's `--ssl-ca-certs` file, the proxy trusts it from its next connection on,
/// without a restart: requests through it answer as a local run. Fails when the proxy's client
/// keeps the CA it started with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_enable_ssl_refresh_makes_the_proxy_trust_a_rotated_engine_ca() {
    let pki = Pki::new("proxy-refresh");
    let (ca2, ca2_key) = make_ca("the engines' new CA");
    std::fs::write(pki.dir.join("ca2.pem"), ca2.pem()).unwrap();
    pki.leaf("engine", vec![ExtendedKeyUsagePurpose::ServerAuth], &ca2, &ca2_key);
    std::fs::copy(pki.dir.join("ca.pem"), pki.dir.join("proxy-ca.pem")).unwrap();
    let cfg = lease_config(30.0);
    let engine = ["--ssl-certfile", &pki.path("engine.pem"), "--ssl-keyfile", &pki.path("engine.key"), "--kv-transfer-config", &cfg];
    let p = Proc::serve("s6-pr-p", &engine);
    let d = Proc::serve("s6-pr-d", &engine);
    let local = Proc::serve("s6-pr-local", &[]);
    let proxy_flags = [
        "--ssl-certfile",
        &pki.path("server.pem"),
        "--ssl-keyfile",
        &pki.path("server.key"),
        "--ssl-ca-certs",
        &pki.path("proxy-ca.pem"),
        "--enable-ssl-refresh",
    ];
    let proxy = Proc::proxy_with(&[&p], &[&d], &proxy_flags);
    let client = pki.client(None);
    let body = json!({"model": "kvlease-synthetic", "prompt": "a rotated CA", "max_tokens": 6, "ignore_eos": true});
    let (status, want) = post(&format!("{}/v1/completions", local.url), &body).await;
    assert_eq!(status, 200, "{want}");
    let want = text_of(&want, false);
    let url = format!("{}/v1/completions", proxy.url);
    let (status, _) = post_with(&client, &url, &body).await;
    assert!(status >= 500, "the proxy does not trust the engines' new CA yet: {status}");

    std::fs::write(pki.dir.join("proxy-ca.pem"), ca2.pem()).unwrap();
    common::until("the proxy to trust the new CA", DEADLINE, || async {
        let (status, got) = post_with(&client, &url, &body).await;
        status == 200 && text_of(&got, false) == want
    })
    .await;
}
