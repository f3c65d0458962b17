//! Issue 22, over real `kvlease serve` processes on loopback: the handshake side channel under a
//! flood of strangers, and an operator's mistakes between engines — two live engines with one
//! `--engine-id`, a decoder of another model geometry. In each, no lease of P waits for its
//! expiry because D will not read it (SPEC O4), and a mistake is named in both logs and counted.

mod common;
use common::*;
use serde_json::{json, Value};
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Leases far longer than any test: a lease that ends in time was released, not expired.
const LEASE_S: f64 = 30.0;

/// A free loopback port (bound, then let go) for a side channel we must know in advance.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

/// A file for an engine's log, and the `Stdio` that writes to it.
fn log_file(name: &str) -> (std::path::PathBuf, Stdio) {
    let path = std::env::temp_dir().join(format!("kvlease-{name}-{}.log", std::process::id()));
    let file = std::fs::File::create(&path).expect("log file");
    (path, Stdio::from(file))
}

fn read_log(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn completion(prompt: &str, params: Option<&Value>) -> Value {
    let mut body = json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 4, "ignore_eos": true});
    if let Some(p) = params {
        body["kv_transfer_params"] = p.clone();
    }
    body
}

/// The prefill leg at `p`: its params for `prompt`.
async fn prefill(p: &Proc, prompt: &str) -> Value {
    let mut body = completion(prompt, Some(&json!({"do_remote_decode": true})));
    body["max_tokens"] = json!(1);
    let (status, v) = post(&format!("{}/v1/completions", p.url), &body).await;
    assert_eq!(status, 200, "{v}");
    v["kv_transfer_params"].clone()
}

/// The decode leg at `d` with P's params; the answer's text.
async fn decode(d: &Proc, prompt: &str, params: &Value) -> String {
    let (status, v) = post(&format!("{}/v1/completions", d.url), &completion(prompt, Some(params))).await;
    assert_eq!(status, 200, "{v}");
    text_of(&v, false)
}

/// Every P's leases are back to 0 within 2 s of the last answer, and none expired.
async fn nothing_pinned(ps: &[&Proc], what: &str) {
    let t0 = Instant::now();
    for p in ps {
        until(&format!("{what}: {} holds no lease", p.name), Duration::from_secs(2), || async {
            metric(&p.url, "kvlease_leases_active").await == 0.0
        })
        .await;
        assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"expired\"}").await, 0.0, "{what}: nothing expired");
    }
    assert!(t0.elapsed() <= Duration::from_secs(2), "{what}: {:?}", t0.elapsed());
}

/// Strangers on a port: `n` silent connections, each opened again as soon as the engine closes
/// it, until dropped. Counts the connections made.
struct Flood {
    stop: Arc<AtomicBool>,
    opened: Arc<AtomicUsize>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Flood {
    fn start(addr: SocketAddr, n: usize) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(AtomicUsize::new(0));
        let threads = (0..n)
            .map(|_| {
                let (stop, opened) = (stop.clone(), opened.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
                            std::thread::sleep(Duration::from_millis(10));
                            continue;
                        };
                        opened.fetch_add(1, Ordering::Relaxed);
                        let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
                        let mut buf = [0u8; 256];
                        // Silent: read what the engine says, answer nothing, until it closes.
                        while !stop.load(Ordering::Relaxed) {
                            match s.read(&mut buf) {
                                Ok(0) => break,
                                Ok(_) => {}
                                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                                Err(_) => break,
                            }
                        }
                    }
                })
            })
            .collect();
        Flood { stop, opened, threads }
    }

    fn opened(&self) -> usize {
        self.opened.load(Ordering::Relaxed)
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// SPEC D5, S2, P7, O4 (issue 22): 70 silent sockets on P's side channel, opened again as they
/// close, for 15 s, while a new decoder starts and requests flow through P to it. Strangers
/// that prove nothing hold their place for 2 s at most and are evicted by newcomers rather than
/// turning them away, so the decoder's handshake gets through: at most 10 % of requests are
/// recomputed, and P holds no lease 2 s after the last answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d5_s2_a_flood_of_silent_sockets_on_the_side_channel_does_not_keep_a_new_decoder_out() {
    let kv_port = free_port();
    let cfg = lease_config(LEASE_S);
    let p = Proc::serve("flood-p", &["--kv-transfer-config", &cfg, "--kv-port", &kv_port.to_string()]);
    let started = Instant::now();
    let flood = Flood::start(SocketAddr::from(([127, 0, 0, 1], kv_port)), 70);
    // Every stranger was closed once and came back: the flood is in its steady state.
    until("the flood to fill P's side channel, twice", DEADLINE, || async { flood.opened() >= 140 }).await;
    let d = Proc::serve("flood-d", &["--kv-transfer-config", &cfg]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    let url = format!("{}/v1/completions", proxy.url);
    // Requests spread over the rest of the 15 s, about as many as the 342.
    let mut pace = tokio::time::interval(Duration::from_millis(35));
    let mut sent = 0u32;
    while started.elapsed() < Duration::from_secs(15) && sent < 400 {
        pace.tick().await;
        let (status, v) = post(&url, &completion(&format!("request {sent} through the flood"), None)).await;
        assert_eq!(status, 200, "{v}");
        sent += 1;
    }
    let reopened = flood.opened();
    drop(flood);
    let recomputed = metric(&d.url, "kvlease_recomputed_requests_total").await;
    eprintln!("{sent} requests, {recomputed} recomputed; the flood opened {reopened} connections");
    assert!(sent >= 10, "only {sent} requests got through in 15 s");
    assert!(reopened > 70, "the strangers were closed and came back ({reopened} connections)");
    assert!(recomputed <= 0.1 * f64::from(sent), "{recomputed} of {sent} requests recomputed");
    nothing_pinned(&[&p], "after the flood").await;
}

/// SPEC O4, §3 (issue 22): two live P engines with one `--engine-id` (different incarnations,
/// different ports), both handing their params to one decoder. D does not flap between them: it
/// keeps reading from the first it linked to, recomputes the other's requests and releases their
/// leases at once over that engine's side channel. No lease waits for expiry on either P, and
/// the mistake is named in D's log and the other P's, and counted on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o4_two_live_engines_with_one_engine_id_pin_no_lease_and_are_named() {
    let cfg = lease_config(LEASE_S);
    let (p1_log, p1_out) = log_file("dup-p1");
    let (p2_log, p2_out) = log_file("dup-p2");
    let (d_log, d_out) = log_file("dup-d");
    let p1 = Proc::serve_logging_to("dup-p", &["--kv-transfer-config", &cfg, "--log-level", "warn"], p1_out);
    let p2 = Proc::serve_logging_to("dup-p", &["--kv-transfer-config", &cfg, "--log-level", "warn"], p2_out);
    let d = Proc::serve_logging_to("dup-d", &["--kv-transfer-config", &cfg, "--log-level", "warn"], d_out);
    // The first request links D to P1; then both hand out params, in turn.
    let rounds = 6;
    for i in 0..rounds {
        for p in [&p1, &p2] {
            let prompt = format!("round {i} from {}", p.url);
            let params = prefill(p, &prompt).await;
            let want = text_of(&post(&format!("{}/v1/completions", d.url), &completion(&prompt, None)).await.1, false);
            assert_eq!(decode(&d, &prompt, &params).await, want, "D7: the same answer, read or recomputed");
        }
    }
    nothing_pinned(&[&p1, &p2], "two engines with one id").await;
    // D kept P1: its requests were read, P2's recomputed (no flapping).
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, f64::from(rounds), "only the duplicate's are recomputed");
    assert_eq!(metric(&p1.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, f64::from(rounds));
    assert_eq!(metric(&p2.url, "kvlease_leases_released_total{reason=\"released\"}").await, f64::from(rounds));
    assert_eq!(metric(&d.url, "kvlease_side_channel_releases_total").await, f64::from(rounds));
    let refused = "kvlease_handshakes_refused_total{reason=\"duplicate_engine_id\"}";
    assert!(metric(&d.url, refused).await >= 1.0, "counted on D");
    assert!(metric(&p2.url, refused).await >= 1.0, "counted on the duplicate");
    let named = "two live engines claim engine id \"dup-p\"";
    let (d_says, p2_says) = (read_log(&d_log), read_log(&p2_log));
    assert!(d_says.contains(named), "D's log: {d_says}");
    assert!(p2_says.contains(named), "the duplicate's log: {p2_says}");
    assert!(!read_log(&p1_log).contains(named), "the engine D kept was told nothing");
    for f in [p1_log, p2_log, d_log] {
        let _ = std::fs::remove_file(f);
    }
}

/// SPEC O4, D5 (issue 22): a decoder of another model geometry (`--num-layers 4` against P's 2).
/// P refuses its handshake and tells it why in a reply it can read; both logs name the field
/// and both values (not "does it hold this cluster's secret?"), both count it, D recomputes and
/// releases each lease at once over P's side channel: none waits for expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o4_a_decoder_of_another_geometry_is_told_why_and_pins_no_lease() {
    let cfg = lease_config(LEASE_S);
    let (p_log, p_out) = log_file("geo-p");
    let (d_log, d_out) = log_file("geo-d");
    let p = Proc::serve_logging_to("geo-p", &["--kv-transfer-config", &cfg, "--log-level", "warn", "--num-layers", "2"], p_out);
    let d = Proc::serve_logging_to("geo-d", &["--kv-transfer-config", &cfg, "--log-level", "warn", "--num-layers", "4"], d_out);
    for i in 0..3 {
        let prompt = format!("geometry request {i}");
        let params = prefill(&p, &prompt).await;
        decode(&d, &prompt, &params).await;
    }
    nothing_pinned(&[&p], "a decoder of another geometry").await;
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, 3.0);
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"released\"}").await, 3.0);
    let refused = "kvlease_handshakes_refused_total{reason=\"geometry\"}";
    assert!(metric(&p.url, refused).await >= 1.0, "counted on P");
    assert!(metric(&d.url, refused).await >= 1.0, "counted on D");
    let named = "num_layers (--num-layers) differs: 2 on engine \"geo-p\", 4 on engine \"geo-d\"";
    let (p_says, d_says) = (read_log(&p_log), read_log(&d_log));
    assert!(p_says.contains(named), "P's log: {p_says}");
    assert!(d_says.contains(named), "D's log: {d_says}");
    assert!(!d_says.contains("does it hold this cluster's secret"), "no misleading hint: {d_says}");
    for f in [p_log, d_log] {
        let _ = std::fs::remove_file(f);
    }
}
