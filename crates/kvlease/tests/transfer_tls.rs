//! SPEC S6, the transfer half: per-engine certificates (`--kv-transfer-tls-cert`, `-key`, `-ca`).
//! Real `kvlease serve` processes on loopback with certificates made here (rcgen), and an
//! insider — a test-side engine holding the cluster secret and a valid certificate for another
//! engine — that attacks them with the real side-channel and tcp-agent code.

mod common;

use common::*;
use kvlease_core::auth::ClusterKey;
use kvlease_core::peers::{Geometry, NOTIF_KEY_LEN};
use kvlease_core::wire::{Hello, Message, SideRelease};
use kvlease_engine::side_channel;
use kvlease_transport::tls::{TransferTls, TransferTlsFlags};
use kvlease_transport::{tcp, Agent, AgentEvent, BlockArena, OpenGate, ReadOp, Segment, TransportError};
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// A cluster CA, and engine certificates it (or another CA) signed, as PEM files in a directory
/// removed at drop.
struct Pki {
    dir: PathBuf,
    ca: (rcgen::Certificate, KeyPair),
}

impl Pki {
    fn new(name: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("kvlease-transfer-tls-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let ca = make_ca("kvlease cluster CA");
        std::fs::write(dir.join("ca.pem"), ca.0.pem()).unwrap();
        Pki { dir, ca }
    }

    /// Engine `id`'s certificate (`kvlease://engine/<id>`), signed by the cluster CA or, if
    /// `foreign`, by a CA of its own (which it then trusts instead of the cluster's).
    fn files(&self, id: &str, foreign: bool) -> TransferTlsFlags {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(DnType::CommonName, id);
        p.subject_alt_names.push(SanType::URI(format!("kvlease://engine/{id}").try_into().unwrap()));
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().unwrap();
        let (cert, ca) = if foreign {
            let other = make_ca("another CA");
            std::fs::write(self.dir.join(format!("{id}-ca.pem")), other.0.pem()).unwrap();
            (p.signed_by(&key, &other.0, &other.1).unwrap(), self.dir.join(format!("{id}-ca.pem")))
        } else {
            (p.signed_by(&key, &self.ca.0, &self.ca.1).unwrap(), self.dir.join("ca.pem"))
        };
        std::fs::write(self.dir.join(format!("{id}.key")), key.serialize_pem()).unwrap();
        std::fs::write(self.dir.join(format!("{id}.pem")), cert.pem()).unwrap();
        TransferTlsFlags { cert: self.dir.join(format!("{id}.pem")), key: self.dir.join(format!("{id}.key")), ca }
    }

    /// The `--kv-transfer-tls-*` flags of engine `id`.
    fn flags(&self, id: &str, foreign: bool) -> Vec<String> {
        let f = self.files(id, foreign);
        let s = |p: PathBuf| p.to_str().expect("utf-8 path").to_string();
        vec!["--kv-transfer-tls-cert".into(), s(f.cert), "--kv-transfer-tls-key".into(), s(f.key), "--kv-transfer-tls-ca".into(), s(f.ca)]
    }

    /// Engine `id`'s certificate, loaded as an engine loads it (for the insider).
    fn tls(&self, id: &str) -> TransferTls {
        TransferTls::load(&self.files(id, false)).expect("loads")
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

fn with(flags: &[String], more: &[&str]) -> Vec<String> {
    flags.iter().cloned().chain(more.iter().map(|s| s.to_string())).collect()
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn completion(prompt: &str, max_tokens: u32, params: Option<&Value>) -> Value {
    let mut body = json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true});
    if let Some(p) = params {
        body["kv_transfer_params"] = p.clone();
    }
    body
}

async fn text(url: &str, body: &Value) -> String {
    let (status, got) = post(&format!("{url}/v1/completions"), body).await;
    assert_eq!(status, 200, "{got}");
    text_of(&got, false)
}

/// The prefill leg: P's `kv_transfer_params` for `prompt`.
async fn prefill(p: &Proc, prompt: &str) -> Value {
    let (status, body) = post(&format!("{}/v1/completions", p.url), &completion(prompt, 1, Some(&json!({"do_remote_decode": true})))).await;
    assert_eq!(status, 200, "{body}");
    body["kv_transfer_params"].clone()
}

/// SPEC S6 (1): P and D with certificates of the cluster CA; requests through the proxy, some
/// with prompts of many blocks, answer exactly as a local run, every lease is `transferred`
/// (D pulled over mutual TLS on the tcp agents) and D recomputed nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_p_d_over_mutual_tls_answer_as_local() {
    p_d_over_mutual_tls("tcp").await;
}

/// SPEC S6 (1) over NIXL: the side channel (Hello, releases) runs mutual TLS as over tcp; NIXL's
/// own notifications and reads are not under TLS (they keep the secret's per-notification
/// proof), so this proves the certificates do not stop a NIXL pair, not that its data plane is
/// encrypted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_nixl_p_d_with_certificates_answer_as_local() {
    if nixl_or_skip() {
        p_d_over_mutual_tls("nixl").await;
    }
}

async fn p_d_over_mutual_tls(transport: &str) {
    let pki = Pki::new(&format!("pd-{transport}"));
    let cfg = lease_config(30.0);
    let more = ["--kv-transfer-config", &cfg, "--transport", transport];
    let p = Proc::serve("s6-p", &refs(&with(&pki.flags("s6-p", false), &more)));
    let d = Proc::serve("s6-d", &refs(&with(&pki.flags("s6-d", false), &more)));
    let local = Proc::serve("s6-local", &[]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    let long = "many blocks of prompt ".repeat(40);
    let prompts: Vec<String> = (0..6).map(|i| if i % 2 == 0 { format!("over mutual tls {i}") } else { format!("{long}{i}") }).collect();
    for prompt in &prompts {
        let want = text(&local.url, &completion(prompt, 8, None)).await;
        assert_eq!(text(&proxy.url, &completion(prompt, 8, None)).await, want, "{prompt}");
    }
    until("P holds no lease", DEADLINE, || async { metric(&p.url, "kvlease_leases_active").await == 0.0 }).await;
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, prompts.len() as f64);
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, 0.0);
    assert_eq!(metric(&p.url, "kvlease_messages_rejected_total{reason=\"unauthenticated\"}").await, 0.0);
}

/// SPEC S6 (2), O4: a decoder whose certificate another CA signed (same secret) gets no
/// connection: it recomputes and answers right, says why in its log, and both engines count the
/// refusal. It cannot release P's lease either (no path to P accepts it), so the lease ends at
/// its deadline, as `expired`, never `released` by a stranger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_a_decoder_of_another_ca_transfers_nothing() {
    decoder_of_another_ca("tcp").await;
}

/// SPEC S6 (2) over NIXL: the refused side channel introduces no NIXL agent, so nothing is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_nixl_a_decoder_of_another_ca_transfers_nothing() {
    if nixl_or_skip() {
        decoder_of_another_ca("nixl").await;
    }
}

async fn decoder_of_another_ca(transport: &str) {
    let pki = Pki::new(&format!("ca-{transport}"));
    let cfg = lease_config(2.0);
    let p = Proc::serve("s6ca-p", &refs(&with(&pki.flags("s6ca-p", false), &["--kv-transfer-config", &cfg, "--transport", transport])));
    let log = pki.dir.join("d.log");
    let d = Proc::serve_logging_to(
        "s6ca-d",
        &refs(&with(&pki.flags("s6ca-d", true), &["--kv-transfer-config", &cfg, "--log-level", "warn", "--transport", transport])),
        std::fs::File::create(&log).expect("log file").into(),
    );
    let local = Proc::serve("s6ca-local", &[]);
    let want = text(&local.url, &completion("another CA", 6, None)).await;
    let params = prefill(&p, "another CA").await;
    assert_eq!(text(&d.url, &completion("another CA", 6, Some(&params))).await, want);
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, 1.0);
    assert!(metric(&d.url, "kvlease_handshakes_refused_total{reason=\"certificate\"}").await >= 1.0);
    until("P counts the stranger's certificate", DEADLINE, || async {
        metric(&p.url, "kvlease_handshakes_refused_total{reason=\"certificate\"}").await >= 1.0
            && metric(&p.url, "kvlease_messages_rejected_total{reason=\"unauthenticated\"}").await >= 1.0
    })
    .await;
    until("D's log says why", DEADLINE, || async {
        std::fs::read_to_string(&log).unwrap_or_default().contains("mutual TLS handshake failed")
    })
    .await;
    until("the lease expires on P", DEADLINE, || async {
        metric(&p.url, "kvlease_leases_released_total{reason=\"expired\"}").await == 1.0
    })
    .await;
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"released\"}").await, 0.0, "a stranger released nothing");
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 0.0);
}

/// The default engine geometry (`kvlease serve` without model flags), as a Hello carries it.
fn geometry() -> Geometry {
    Geometry { tp_size: 1, num_layers: 2, num_kv_heads: 4, head_dim: 16, dtype_bytes: 2, block_size: 16, push: false }
}

fn hello(engine_id: &str, incarnation: u64, agents: Vec<Vec<u8>>) -> Hello {
    Hello {
        engine_id: engine_id.into(),
        incarnation,
        agents,
        info: geometry().to_info(),
        t_send: 1,
        echo: (0, 0),
        auth: vec![],
        notif_key: vec![],
    }
}

/// The insider's side-channel connection to engine `expect` at `addr`, under its certificate.
async fn side_stream(tls: &TransferTls, addr: &str, expect: &str) -> impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tls.connect(tcp, expect).await.expect("mutual TLS with a cluster member")
}

fn key() -> ClusterKey {
    ClusterKey::new(Some(SECRET.as_bytes()))
}

/// A tcp agent named `name`, holding the cluster secret and `tls`.
async fn insider_agent(name: &str, tls: TransferTls) -> (Arc<tcp::TcpAgent>, tokio::sync::mpsc::UnboundedReceiver<AgentEvent>) {
    let (events, rx) = tokio::sync::mpsc::unbounded_channel();
    let options = tcp::TcpOptions {
        secret: Some(SECRET.as_bytes().to_vec()),
        tls: Some(tls),
        connect_timeout: Duration::from_secs(3),
        ..Default::default()
    };
    let agent = tcp::TcpAgent::start_with(name.into(), "127.0.0.1", BlockArena::new(4, 16384), Arc::new(OpenGate), events, options)
        .await
        .expect("insider agent");
    (agent, rx)
}

fn hex16(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

/// D1's lease on P that an insider attacks: D1's request for it waits in D1's queue behind a
/// long one, renewing (`held`), until the insider is done.
struct Target {
    pki: Pki,
    p: Proc,
    d1: Proc,
    _local: Proc,
    params: Value,
    lease: u64,
    d1_inc: u64,
    want: String,
    held: tokio::task::JoinHandle<String>,
    busy: tokio::task::JoinHandle<String>,
}

impl Target {
    /// P and D1 over `transport`, engine ids prefixed `tag`.
    async fn new(tag: &str, transport: &str) -> Target {
        let pki = Pki::new(tag);
        let cfg = lease_config(3.0); // I = 0.5 s: D1 claims the lease within a second of arrival
        let (p_id, d1_id) = (format!("{tag}-p"), format!("{tag}-d1"));
        let p = Proc::serve(&p_id, &refs(&with(&pki.flags(&p_id, false), &["--kv-transfer-config", &cfg, "--transport", transport])));
        let d1_flags = with(
            &pki.flags(&d1_id, false),
            &["--kv-transfer-config", &cfg, "--max-num-seqs", "1", "--decode-ms-per-token", "100", "--transport", transport],
        );
        let d1 = Proc::serve(&d1_id, &refs(&d1_flags));
        let local = Proc::serve(&format!("{tag}-local"), &[]);
        let prompt = "the insider's target";
        let want = text(&local.url, &completion(prompt, 4, None)).await;
        let params = prefill(&p, prompt).await;
        let lease: u64 = params["remote_lease_id"].as_u64().or_else(|| params["remote_lease_id"].as_str()?.parse().ok()).expect("lease id");
        // D1's incarnation, as any HTTP client learns it from D1's own params.
        let d1_params = prefill(&d1, "d1's own").await;
        let d1_inc: u64 = d1_params["remote_incarnation"].as_str().and_then(|s| s.parse().ok()).expect("incarnation");

        // D1 is busy for ~6 s; the request waits in its queue, renewing.
        let busy = tokio::spawn({
            let url = d1.url.clone();
            async move { text(&url, &completion("a long one", 60, None)).await }
        });
        until("D1 to run its long request", DEADLINE, || async { metric(&d1.url, "kvlease_requests_running").await == 1.0 }).await;
        let held = tokio::spawn({
            let (url, body) = (d1.url.clone(), completion(prompt, 4, Some(&params)));
            async move { text(&url, &body).await }
        });
        until("D1 to renew the lease", DEADLINE, || async { metric(&p.url, "kvlease_lease_renewals_total").await >= 1.0 }).await;
        Target { pki, p, d1, _local: local, params, lease, d1_inc, want, held, busy }
    }

    /// P's side channel.
    fn side(&self) -> String {
        format!("{}:{}", self.params["remote_host"].as_str().expect("host"), self.params["remote_port"])
    }

    /// The digest of D1's prompt, as a `ReadDone` names it.
    fn digest(&self) -> kvlease_core::digest::PromptDigest {
        let digest = hex16(self.params["kvlease_prompt_digest"].as_str().expect("digest"));
        let mut d = [0u8; 16];
        d.copy_from_slice(&digest);
        kvlease_core::digest::PromptDigest(d)
    }

    /// A heartbeat, a release and a `ReadDone` of D1's lease: what an insider sends as D1.
    fn attacks(&self) -> [Message; 3] {
        [
            Message::Heartbeat { seq: 1, lease_ids: vec![self.lease] },
            Message::Release { lease_ids: vec![self.lease] },
            Message::ReadDone { lease_id: self.lease, consumer_rank: 0, n: 1, digest: self.digest() },
        ]
    }

    /// After the attacks: D1's lease is untouched, D1 pulls its KV (nothing recomputed) and the
    /// lease ends once, as `transferred`.
    async fn untouched(self) {
        assert_eq!(metric(&self.p.url, "kvlease_leases_active").await, 1.0, "D1's lease is untouched");
        assert_eq!(self.held.await.expect("D1's request"), self.want);
        self.busy.await.expect("the long request");
        assert_eq!(metric(&self.d1.url, "kvlease_recomputed_requests_total").await, 0.0, "D1 pulled its KV");
        until("the lease transferred", DEADLINE, || async {
            metric(&self.p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await == 1.0
        })
        .await;
        assert_eq!(metric(&self.p.url, "kvlease_leases_released_total{reason=\"released\"}").await, 0.0);
    }
}

/// Waits for the next notification `events` brings and decodes it.
async fn answer(events: &mut tokio::sync::mpsc::UnboundedReceiver<AgentEvent>) -> Message {
    tokio::time::timeout(DEADLINE, async {
        loop {
            if let Some(AgentEvent::Notification { bytes, .. }) = events.recv().await {
                return Message::decode(&bytes).expect("P's answer");
            }
        }
    })
    .await
    .expect("P answers")
}

/// The lease ids P's answer says are lost.
fn lost(answer: Message) -> Vec<u64> {
    match answer {
        Message::HeartbeatAck { lost_ids, .. } => lost_ids,
        Message::LeaseLost { lease_ids } => lease_ids,
        Message::ReadDoneAck { lease_id, live: false } => vec![lease_id],
        other => panic!("unexpected answer {other:?}"),
    }
}

/// SPEC S6 (3), S5 against insiders: D1 holds a lease on P (its request waits in D1's queue,
/// renewing). An insider holds the cluster secret and a valid certificate, but for engine X.
/// As D1 it can do nothing: its Hello and its release claiming D1 are refused at the side
/// channel, naming both engines, and its agent named for D1 is refused by P's agent. As X (the
/// only engine it can be) its heartbeat, release and `ReadDone` for D1's lease are answered
/// lost, and its read of it is refused. D1 then pulls its KV untouched: nothing recomputed, the
/// lease released once, as `transferred`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_an_insider_with_a_valid_certificate_cannot_act_as_another_engine() {
    let t = Target::new("s6i", "tcp").await;
    let (p, lease, d1_inc, side) = (&t.p, t.lease, t.d1_inc, t.side());
    let x = t.pki.tls("s6i-x");
    let rejected = |p: &Proc| {
        let url = p.url.clone();
        async move { metric(&url, "kvlease_handshakes_refused_total{reason=\"certificate\"}").await }
    };

    // As D1 on the side channel: a Hello, then a release of D1's lease, each refused naming both.
    let (as_d1, _) = insider_agent(&format!("s6i-d1/{d1_inc:x}/0"), x.clone()).await;
    let e = side_channel::exchange(side_stream(&x, &side, "s6i-p").await, &side, &key(), hello("s6i-d1", d1_inc, vec![as_d1.metadata()]))
        .await
        .expect_err("refused")
        .to_string();
    assert!(e.contains("its certificate is engine \"s6i-x\"'s but it claims to be engine \"s6i-d1\""), "{e}");
    let release = SideRelease {
        engine_id: "s6i-d1".into(),
        incarnation: d1_inc,
        granted_by: 0,
        lease_ids: vec![lease],
        what: "no_handshake".into(),
        why: "an insider's".into(),
        auth: vec![],
    };
    let e = side_channel::release(side_stream(&x, &side, "s6i-p").await, &side, &key(), release).await.expect_err("refused").to_string();
    assert!(e.contains("its certificate is engine \"s6i-x\"'s but it claims to be engine \"s6i-d1\""), "{e}");
    assert!(rejected(p).await >= 2.0);

    // As X, the engine it is: P accepts it, and tells it P's agents.
    let (agent, mut events) = insider_agent("s6i-x/1/0", x.clone()).await;
    let ours = Hello { notif_key: vec![0; NOTIF_KEY_LEN], ..hello("s6i-x", 1, vec![agent.metadata()]) };
    let p_hello =
        side_channel::exchange(side_stream(&x, &side, "s6i-p").await, &side, &key(), ours).await.expect("an honest Hello is answered");
    let p_agent = agent.add_peer(&p_hello.agents[0]).await.expect("X's agent connects as X");

    // Dial as D1: P's agent refuses the agent named for D1 under X's certificate.
    let e = as_d1.add_peer(&p_hello.agents[0]).await.expect_err("refused").to_string();
    assert!(e.contains("our certificate is not the engine our agent is named for"), "{e}");

    // Renew, release, complete and read D1's lease, as X.
    for msg in t.attacks() {
        agent.send_notif(&p_agent, msg.encode()).expect("sent");
        assert_eq!(lost(answer(&mut events).await), vec![lease], "{msg:?} is answered lost for X");
    }
    let block = t.params["remote_block_ids"][0].as_u64().expect("a block") as u32;
    let read = ReadOp {
        lease_id: lease,
        segments: vec![Segment { remote_block: block, remote_offset: 0, local_block: 0, local_offset: 0, len: 64 }],
        notif: None,
        tag: t.digest().0.to_vec(),
    };
    assert!(matches!(agent.read(&p_agent, read).await, Err(TransportError::Refused { .. })), "X's read of D1's lease is refused");
    t.untouched().await;
}

/// SPEC S6 (3) over NIXL, S5 against insiders: NIXL's notifications carry no certificate, and
/// under the secret alone every member can tag one as any engine. With certificates, P tags
/// what it takes from D1 under a key it handed D1 alone, inside mutual TLS. An insider with the
/// cluster secret and a valid certificate for X runs a NIXL agent named for D1 and sends P a
/// heartbeat, a release and a `ReadDone` of D1's lease, tagged under the secret (what P took
/// before keys were bound to certificates: the release ended D1's lease): P drops all three as
/// unauthenticated. As X, with the key P handed X, the same three are answered lost. D1 then
/// pulls its KV untouched. (A NIXL READ cannot be refused, so an insider holding P's metadata
/// can read P's blocks: P5/D6 keep anyone from using bytes P did not confirm; README, security.)
#[cfg(feature = "nixl")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_nixl_an_insider_cannot_tag_notifications_as_another_engine() {
    use kvlease_transport::auth::PeerKeys;
    use kvlease_transport::nixl::{NixlAgent, NixlOptions};
    if !nixl_or_skip() {
        return;
    }
    let t = Target::new("s6n", "nixl").await;
    let (p, lease, side) = (&t.p, t.lease, t.side());
    let x = t.pki.tls("s6n-x");
    let nixl_agent = |name: String, keys: Option<Arc<PeerKeys>>| async move {
        let (events, rx) = tokio::sync::mpsc::unbounded_channel();
        let options = NixlOptions { secret: Some(SECRET.as_bytes().to_vec()), peer_keys: keys, ..Default::default() };
        let agent = NixlAgent::start_with(name, BlockArena::new(4, 16384), Arc::new(OpenGate), events, options).await.expect("NIXL agent");
        (agent, rx)
    };

    // X's honest handshake: P hands X its agents and the key X must tag its notifications with.
    let keys = Arc::new(PeerKeys::new("s6n-x").expect("keys"));
    let (agent, mut events) = nixl_agent("s6n-x/1/0".into(), Some(keys.clone())).await;
    let ours = Hello { notif_key: keys.ours_for("s6n-p").to_vec(), ..hello("s6n-x", 1, vec![agent.metadata()]) };
    let p_hello =
        side_channel::exchange(side_stream(&x, &side, "s6n-p").await, &side, &key(), ours).await.expect("an honest Hello is answered");
    keys.learn("s6n-p", p_hello.notif_key.as_slice().try_into().expect("P hands X a key"));

    // As D1: an agent named for D1, tagging under the cluster secret.
    let (as_d1, _) = nixl_agent(format!("s6n-d1/{:x}/0", t.d1_inc), None).await;
    let p_agent = as_d1.add_peer(&p_hello.agents[0]).await.expect("P's metadata loads");
    let unauthenticated = "kvlease_messages_rejected_total{reason=\"unauthenticated\"}";
    let before = metric(&p.url, unauthenticated).await;
    // Counters above any D1 has used (it renews twice a second): not refused as replays, so
    // only the tag can stop them (it did not, under keys derived from the secret).
    let padding = (0..64).map(|seq| Message::Heartbeat { seq, lease_ids: vec![] });
    let sent: Vec<Message> = padding.chain(t.attacks()).collect();
    for msg in &sent {
        as_d1.send_notif(&p_agent, msg.encode()).expect("sent");
    }
    until("P drops every forgery", DEADLINE, || async { metric(&p.url, unauthenticated).await >= before + sent.len() as f64 }).await;
    assert_eq!(metric(&p.url, "kvlease_leases_active").await, 1.0, "D1's lease is untouched");

    // As X, the engine it is: answered lost.
    let p_agent = agent.add_peer(&p_hello.agents[0]).await.expect("X's agent adds P's");
    for msg in t.attacks() {
        agent.send_notif(&p_agent, msg.encode()).expect("sent");
        assert_eq!(lost(answer(&mut events).await), vec![lease], "{msg:?} is answered lost for X");
    }
    t.untouched().await;
}

/// SPEC S6 (4): a certificate whose engine is not the claimed engine id is refused, naming both:
/// at start-up (`--engine-id` against `--kv-transfer-tls-cert`), and at the handshake (a Hello
/// claiming another engine than the dialer's certificate, above). Without `--engine-id` the
/// engine is its certificate's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_a_certificate_of_another_engine_is_refused_naming_both() {
    let pki = Pki::new("names");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvlease"))
        .args(["serve", "--port", "0", "--engine-id", "s6n-y"])
        .args(pki.flags("s6n-x", false))
        .env_remove("KVLEASE_TRANSFER_SECRET")
        .output()
        .expect("run kvlease");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--engine-id \"s6n-y\" is not the engine --kv-transfer-tls-cert") && err.contains("(\"s6n-x\")"), "{err}");

    // A certificate naming no engine, or a missing flag: refused naming the flag.
    let mut half = pki.flags("s6n-z", false);
    half.truncate(4);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvlease")).args(["serve", "--port", "0"]).args(&half).output().expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--kv-transfer-tls-ca"), "{}", String::from_utf8_lossy(&out.stderr));

    // Without --engine-id, the engine id is the certificate's; the side channel names both on a
    // mismatch.
    let flags = pki.flags("s6n-p", false);
    let mut args = vec!["serve", "--port", "0", "--log-level", "warn"];
    args.extend(refs(&flags));
    let p = Proc::start("s6n-p", &args);
    let params = prefill(&p, "whose id").await;
    assert_eq!(params["remote_engine_id"], "s6n-p");
    let side = format!("{}:{}", params["remote_host"].as_str().expect("host"), params["remote_port"]);
    let x = pki.tls("s6n-x");
    let e = side_channel::exchange(side_stream(&x, &side, "s6n-p").await, &side, &key(), hello("s6n-y", 1, vec![]))
        .await
        .expect_err("refused")
        .to_string();
    assert!(e.contains("its certificate is engine \"s6n-x\"'s but it claims to be engine \"s6n-y\""), "{e}");
    // Dialing an engine under another engine's name: the dialer refuses the server's certificate.
    let tcp = tokio::net::TcpStream::connect(&side).await.expect("connect");
    let e = x.connect(tcp, "s6n-q").await.expect_err("refused").to_string();
    assert_eq!(e, "its certificate is engine \"s6n-p\"'s but it claims to be engine \"s6n-q\"");
}

/// Replaces `to` by `from`'s content in one rename, as a rotation tool does.
fn replace(from: &std::path::Path, to: &std::path::Path) {
    let tmp = to.with_extension("new");
    std::fs::copy(from, &tmp).expect("copy");
    std::fs::rename(&tmp, to).expect("rename");
}

/// SPEC S6: certificates rotate without a restart. The cluster moves to a new CA; P already has
/// its certificate of the new CA, D still the old one, so D cannot handshake with P and
/// recomputes. D's three files are then replaced in place (key, certificate, CA, one after the
/// other, so D sees broken sets on the way and keeps its old one meanwhile); D's next handshake
/// uses the new set and pulls from P.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_rotated_certificates_are_used_for_new_connections_without_a_restart() {
    let (old, new) = (Pki::new("rotate-old"), Pki::new("rotate-new"));
    let cfg = lease_config(30.0);
    let p = Proc::serve("s6r-p", &refs(&with(&new.flags("s6r-p", false), &["--kv-transfer-config", &cfg])));
    let d = Proc::serve("s6r-d", &refs(&with(&old.flags("s6r-d", false), &["--kv-transfer-config", &cfg])));
    let local = Proc::serve("s6r-local", &[]);
    let run = |i: usize| {
        let (p, d, local) = (p.url.clone(), d.url.clone(), local.url.clone());
        async move {
            let prompt = format!("rotation {i}");
            let want = text(&local, &completion(&prompt, 4, None)).await;
            let (status, body) =
                post(&format!("{p}/v1/completions"), &completion(&prompt, 1, Some(&json!({"do_remote_decode": true})))).await;
            assert_eq!(status, 200, "{body}");
            assert_eq!(text(&d, &completion(&prompt, 4, Some(&body["kv_transfer_params"]))).await, want);
        }
    };
    run(0).await;
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, 1.0, "the old CA cannot reach P");

    let fresh = new.files("s6r-d", false);
    let (cert, key, ca) = (old.dir.join("s6r-d.pem"), old.dir.join("s6r-d.key"), old.dir.join("ca.pem"));
    replace(&fresh.key, &key);
    replace(&fresh.cert, &cert);
    replace(&fresh.ca, &ca);
    let transferred = "kvlease_leases_released_total{reason=\"transferred\"}";
    let mut i = 1;
    until("D pulls from P with its rotated certificate", DEADLINE, || {
        i += 1;
        let go = run(i);
        let p = p.url.clone();
        async move {
            go.await;
            metric(&p, transferred).await >= 1.0
        }
    })
    .await;
}
