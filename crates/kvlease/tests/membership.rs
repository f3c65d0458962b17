//! Issue 12 part 3: membership through etcd. Engines started with `--etcd` register under an
//! etcd lease; `kvlease proxy --etcd` routes to what is registered, with its own health checks
//! on top. A real etcd (Debian's `etcd-server`) per test on free loopback ports with a temporary
//! data directory, real `kvlease` processes.
//!
//! The etcd binary comes from `KVLEASE_ETCD` (set by `scripts/test.sh`, which fetches it with
//! `scripts/install-etcd.sh`) or `etcd` on the PATH; without either, the tests fail and say how
//! to get it.

mod common;

use common::*;
use kvlease_server::etcd::Etcd;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The engines' etcd lease in these tests, seconds.
const TTL: &str = "2";
const PREFIX: &str = "/kvlease/";

/// An etcd server on loopback, killed (and its data directory removed) when dropped.
struct EtcdServer {
    child: Option<Child>,
    url: String,
    peer: String,
    dir: PathBuf,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port()
}

impl EtcdServer {
    /// An etcd on free ports. The ports are found free and then handed to etcd, so another
    /// process may take one in between: etcd then exits at once, and new ports are tried.
    async fn start() -> EtcdServer {
        for _ in 0..5 {
            let (client, peer) = (free_port(), free_port());
            let dir = std::env::temp_dir().join(format!("kvlease-etcd-{}-{client}", std::process::id()));
            let mut e =
                EtcdServer { child: None, url: format!("http://127.0.0.1:{client}"), peer: format!("http://127.0.0.1:{peer}"), dir };
            if e.try_spawn().await {
                return e;
            }
        }
        panic!("etcd exited at start five times over (its ports taken?)");
    }

    /// Starts etcd again on its ports (after an outage).
    async fn spawn(&mut self) {
        assert!(self.try_spawn().await, "etcd exited at start (its port taken meanwhile?)");
    }

    /// Starts etcd on its ports with an empty data directory; waits until it answers (true) or
    /// exits (false).
    async fn try_spawn(&mut self) -> bool {
        let _ = std::fs::remove_dir_all(&self.dir);
        let child = Command::new(server_binary("KVLEASE_ETCD", "etcd", "scripts/install-etcd.sh"))
            .args(["--name", "default", "--data-dir"])
            .arg(&self.dir)
            .args(["--listen-client-urls", &self.url, "--advertise-client-urls", &self.url])
            .args(["--listen-peer-urls", &self.peer, "--initial-advertise-peer-urls", &self.peer])
            .arg(format!("--initial-cluster=default={}", self.peer))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn etcd");
        self.child = Some(child);
        let health = format!("{}/health", self.url);
        let deadline = std::time::Instant::now() + DEADLINE;
        loop {
            if let Ok(r) = client().get(&health).send().await {
                if r.json::<Value>().await.is_ok_and(|v| v["health"] == "true") {
                    return true;
                }
            }
            if self.child.as_mut().is_some_and(|c| c.try_wait().is_ok_and(|s| s.is_some())) {
                self.child = None;
                return false;
            }
            assert!(std::time::Instant::now() < deadline, "etcd did not answer within {DEADLINE:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGSTOP: etcd keeps its connections open and answers nothing (a hung member).
    fn freeze(&self) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        assert!(Command::new("kill").args(["-STOP", &pid]).status().expect("kill").success());
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn client(&self) -> Etcd {
        Etcd::new(&self.url).expect("etcd url")
    }

    /// The registered keys.
    async fn keys(&self) -> Vec<String> {
        self.client().range_prefix(PREFIX).await.expect("etcd range").0.into_iter().map(|(k, _)| k).collect()
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An engine registered in etcd (`--etcd members`) as `role` (`kv_producer`, `kv_consumer`),
/// with `extra` flags.
fn engine(name: &str, role: &str, members: &str, extra: &[&str]) -> Proc {
    let cfg = format!(r#"{{"kv_connector":"NixlConnector","kv_role":"{role}"}}"#);
    let mut args = vec!["--kv-transfer-config", &cfg, "--etcd", members, "--etcd-ttl", TTL];
    args.extend_from_slice(extra);
    Proc::serve(name, &args)
}

fn proxy(members: &str, logs: Stdio) -> Proc {
    Proc::proxy_etcd(members, &["--health-interval", "0.2", "--log-level", "warn"], logs)
}

/// The upstreams the proxy routes `role` (`prefill`, `decode`) to now, as its `/metrics` lists them.
async fn routed(proxy: &Proc, role: &str) -> Vec<String> {
    let text = client().get(format!("{}/metrics", proxy.url)).send().await.expect("metrics").text().await.expect("text");
    let head = format!("kvlease_proxy_upstream_healthy{{role=\"{role}\",upstream=\"");
    let mut ups: Vec<String> =
        text.lines().filter_map(|l| l.strip_prefix(&head)).filter_map(|r| r.split_once('"')).map(|(u, _)| u.to_string()).collect();
    ups.sort();
    ups
}

async fn until_routed(proxy: &Proc, role: &str, want: &[&Proc]) {
    let mut want: Vec<String> = want.iter().map(|p| p.url.clone()).collect();
    want.sort();
    until(&format!("the proxy to route {role} to {want:?}"), DEADLINE, || async { routed(proxy, role).await == want }).await;
}

/// One completion through the proxy: its status.
async fn complete(proxy: &Proc) -> u16 {
    let (status, body) = post(
        &format!("{}/v1/completions", proxy.url),
        &json!({"model": "kvlease-synthetic", "prompt": "the lease holds", "max_tokens": 4}),
    )
    .await;
    assert!(status != 200 || !text_of(&body, false).is_empty(), "{body}");
    status
}

/// Requests through the proxy to `upstream` (a decode leg sent there), from its `/metrics`.
async fn decode_legs(proxy: &Proc, upstream: &str) -> f64 {
    metric(&proxy.url, &format!("kvlease_proxy_upstream_requests_total{{role=\"decode\",upstream=\"{upstream}\"}}")).await
}

/// A decoder started while the proxy runs joins the routing set and gets decode legs; the proxy
/// is not restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_decoder_started_mid_run_takes_traffic_without_restarting_the_proxy() {
    let etcd = EtcdServer::start().await;
    let p1 = engine("mid-p1", "kv_producer", &etcd.url, &[]);
    let d1 = engine("mid-d1", "kv_consumer", &etcd.url, &[]);
    let proxy = proxy(&etcd.url, Stdio::inherit());
    until_routed(&proxy, "prefill", &[&p1]).await;
    until_routed(&proxy, "decode", &[&d1]).await;
    assert_eq!(complete(&proxy).await, 200);

    let d2 = engine("mid-d2", "kv_consumer", &etcd.url, &[]);
    until_routed(&proxy, "decode", &[&d1, &d2]).await;
    for _ in 0..6 {
        assert_eq!(complete(&proxy).await, 200);
    }
    assert!(decode_legs(&proxy, &d2.url).await >= 1.0, "the new decoder got no decode leg");
    assert_eq!(etcd.keys().await.len(), 3, "p1, d1, d2 registered");
}

/// An engine killed with SIGKILL (no drain, no deregistration) leaves the routing set when its
/// etcd lease runs out; requests meanwhile go to the decoder left (the proxy's health checks and
/// retries cover the gap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_decoder_leaves_the_routing_set_within_the_etcd_lease_ttl() {
    let etcd = EtcdServer::start().await;
    let p1 = engine("kill-p1", "kv_producer", &etcd.url, &[]);
    let mut d1 = engine("kill-d1", "kv_consumer", &etcd.url, &[]);
    let d2 = engine("kill-d2", "kv_consumer", &etcd.url, &[]);
    let proxy = proxy(&etcd.url, Stdio::inherit());
    until_routed(&proxy, "prefill", &[&p1]).await;
    until_routed(&proxy, "decode", &[&d1, &d2]).await;

    d1.child.kill().expect("SIGKILL d1");
    let killed = tokio::time::Instant::now();
    for _ in 0..4 {
        assert_eq!(complete(&proxy).await, 200, "a request while d1 is dead but still registered");
    }
    until_routed(&proxy, "decode", &[&d2]).await;
    let gone = killed.elapsed();
    // The lease was last renewed at most TTL/3 before the kill; etcd expires it at most about a
    // second late and the proxy reads every 0.2 s. Generous for a loaded machine.
    let bound = Duration::from_secs(TTL.parse::<u64>().expect("ttl") + 5);
    assert!(gone <= bound, "d1 left the routing set {gone:?} after SIGKILL, over {bound:?}");
    assert!(!etcd.keys().await.iter().any(|k| k.ends_with("kill-d1")), "d1's registration expired");
    assert_eq!(complete(&proxy).await, 200);
}

/// SIGTERM: the engine deregisters before it starts turning requests away. Whenever its `/health`
/// first answers 503 (draining), its key is already gone from etcd; the request it had in flight
/// still completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_engine_deregisters_before_it_turns_requests_away() {
    let etcd = EtcdServer::start().await;
    let d1 = engine("drain-d1", "kv_consumer", &etcd.url, &["--decode-ms-per-token", "20"]);
    until("d1 registered", DEADLINE, || async { etcd.keys().await == [format!("{PREFIX}drain-d1")] }).await;

    // A local request of ~1.5 s keeps d1 draining (alive) after the signal.
    let url = format!("{}/v1/completions", d1.url);
    let in_flight = tokio::spawn(async move {
        post(&url, &json!({"model": "kvlease-synthetic", "prompt": "slow", "max_tokens": 75, "ignore_eos": true})).await
    });
    until("the request to be running on d1", DEADLINE, || async { metric(&d1.url, "kvlease_requests_running").await >= 1.0 }).await;
    d1.signal("TERM");
    let health = format!("{}/health", d1.url);
    until("d1 to answer /health 503 (draining)", DEADLINE, || async {
        let r = client().get(&health).timeout(Duration::from_secs(2)).send().await.expect("d1 stays up while its request runs");
        if r.status().as_u16() != 503 {
            return false;
        }
        assert!(etcd.keys().await.is_empty(), "d1 turned requests away while still registered");
        true
    })
    .await;
    let (status, body) = in_flight.await.expect("request task");
    assert_eq!(status, 200, "{body}");
}

/// etcd down: the proxy keeps routing to its last known set and says so in `/health` and
/// `kvlease_proxy_etcd_up`; the engines keep serving. First etcd hangs (SIGSTOP: its watch
/// connection stays open, silent), then it dies. etcd back (here without its data, the worst
/// case: every lease forgotten): the engines register again and the proxy follows them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_down_the_proxy_keeps_its_last_set_and_says_so_and_engines_register_again_when_it_returns() {
    let mut etcd = EtcdServer::start().await;
    let p1 = engine("down-p1", "kv_producer", &etcd.url, &[]);
    let d1 = engine("down-d1", "kv_consumer", &etcd.url, &[]);
    let proxy = proxy(&etcd.url, Stdio::inherit());
    until_routed(&proxy, "prefill", &[&p1]).await;
    until_routed(&proxy, "decode", &[&d1]).await;
    assert_eq!(metric(&proxy.url, "kvlease_proxy_etcd_up").await, 1.0);

    etcd.freeze();
    until("the proxy to notice a silent etcd", DEADLINE, || async { metric(&proxy.url, "kvlease_proxy_etcd_up").await == 0.0 }).await;
    etcd.kill();
    // Down for longer than the engines' lease: 15 failed reads, 0.2 s apart, are 3 s > TTL.
    until("the proxy to fail 15 reads of etcd", DEADLINE, || async {
        metric(&proxy.url, "kvlease_proxy_etcd_failures_total").await >= 15.0
    })
    .await;
    assert_eq!(metric(&proxy.url, "kvlease_proxy_etcd_up").await, 0.0);
    let health: Value = client().get(format!("{}/health", proxy.url)).send().await.expect("health").json().await.expect("json");
    assert!(health["etcd"]["status"].as_str().is_some_and(|s| s.starts_with("unreachable")), "{health}");
    assert_eq!((routed(&proxy, "prefill").await, routed(&proxy, "decode").await), (vec![p1.url.clone()], vec![d1.url.clone()]));
    assert_eq!(complete(&proxy).await, 200, "served through the last known set");

    etcd.spawn().await;
    // The etcd that came back is empty until the engines register again: meanwhile the proxy
    // must not drop them (it lets engines join, not leave, for a few seconds after etcd returns).
    until("p1 and d1 registered again, and the proxy reading etcd", DEADLINE, || async {
        let routing = (routed(&proxy, "prefill").await, routed(&proxy, "decode").await);
        assert_eq!(routing, (vec![p1.url.clone()], vec![d1.url.clone()]), "the routing set changed while the engines registered again");
        etcd.keys().await.len() == 2 && metric(&proxy.url, "kvlease_proxy_etcd_up").await == 1.0
    })
    .await;
    until_routed(&proxy, "prefill", &[&p1]).await;
    until_routed(&proxy, "decode", &[&d1]).await;
    let health: Value = client().get(format!("{}/health", proxy.url)).send().await.expect("health").json().await.expect("json");
    assert_eq!(health["etcd"]["status"], "ok", "{health}");
    assert_eq!(complete(&proxy).await, 200);
}

/// `--etcd` with several members: one that cannot be reached (first in the list here) is skipped
/// for the next, by engines and proxy alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_member_that_cannot_be_reached_is_skipped_for_the_next() {
    let etcd = EtcdServer::start().await;
    let members = format!("http://127.0.0.1:{},{}", free_port(), etcd.url);
    let p1 = engine("members-p1", "kv_producer", &members, &[]);
    let d1 = engine("members-d1", "kv_consumer", &members, &[]);
    let proxy = proxy(&members, Stdio::inherit());
    until_routed(&proxy, "prefill", &[&p1]).await;
    until_routed(&proxy, "decode", &[&d1]).await;
    assert_eq!(metric(&proxy.url, "kvlease_proxy_etcd_up").await, 1.0);
    assert_eq!(complete(&proxy).await, 200);
}

/// A registration that does not parse (outside input) is skipped with a warning naming its key;
/// the proxy routes to the well-formed ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_registration_is_skipped_with_a_warning_naming_its_key() {
    let etcd = EtcdServer::start().await;
    let c = etcd.client();
    let lease = c.grant(Duration::from_secs(60)).await.expect("grant");
    c.put(&format!("{PREFIX}junk"), b"not json", lease).await.expect("put");
    c.put(
        &format!("{PREFIX}bad-role"),
        br#"{"role":"router","url":"http://127.0.0.1:1","engine_id":"x","kv_addr":"127.0.0.1:2","tp_size":1}"#,
        lease,
    )
    .await
    .expect("put");
    let p1 = engine("junk-p1", "kv_producer", &etcd.url, &[]);
    let d1 = engine("junk-d1", "kv_consumer", &etcd.url, &[]);
    let log = std::env::temp_dir().join(format!("kvlease-membership-proxy-{}.log", std::process::id()));
    let proxy = proxy(&etcd.url, Stdio::from(std::fs::File::create(&log).expect("log file")));
    until_routed(&proxy, "prefill", &[&p1]).await;
    until_routed(&proxy, "decode", &[&d1]).await;
    assert_eq!(complete(&proxy).await, 200);
    until("warnings naming both keys", DEADLINE, || async {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        ["junk", "bad-role"]
            .iter()
            .all(|k| text.lines().any(|l| l.contains("malformed registration") && l.contains(&format!("{PREFIX}{k}"))))
    })
    .await;
    let _ = std::fs::remove_file(&log);
}
