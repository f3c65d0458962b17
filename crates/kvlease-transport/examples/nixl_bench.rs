//! The nixl backend against the tcp backend, measured in one run on the same machine: KV pull
//! throughput and notification round-trip latency, so the choice of backend rests on numbers.
//!
//! ```text
//! NIXL_LIB_DIR=$(scripts/install-nixl.sh)
//! LD_LIBRARY_PATH=$NIXL_LIB_DIR UCX_TLS=tcp UCX_TCP_TX_SEG_SIZE=64k UCX_TCP_RX_SEG_SIZE=64k \
//!   cargo run --release -p kvlease-transport --features nixl --example nixl_bench
//! ```
//!
//! (UCX's segment sizes matter for NIXL's throughput over TCP; leave them out to see UCX's
//! defaults.) Per backend:
//! (a) pull: D reads P's arena, 64 MiB per read in 1 MiB segments, 256 MiB per repetition,
//!     median GB/s of several repetitions (after one warm-up repetition, which for NIXL also
//!     pays the first READ's connection wire-up, reported separately);
//! (b) notification round trip: D notifies P, P echoes, 2000 times after 100 warm-up ones;
//!     median and p99;
//! (c) idle CPU: the process's utime + stime over 3 s with both agents idle, as % of one core
//!     (two agents: an engine's share is about half).
//!
//! The NIXL agents' polling can be set for experiments: `NIXL_BENCH_REPLY_POLL_US`,
//! `NIXL_BENCH_REPLY_WINDOW_US`, `NIXL_BENCH_ACTIVE_POLL_US`, `NIXL_BENCH_IDLE_POLL_US`,
//! `NIXL_BENCH_XFER_POLL_US`, `NIXL_BENCH_PROGRESS_DELAY_US` (defaults: `NixlOptions::default()`).

use kvlease_transport::nixl::{self, NixlAgent, NixlOptions};
use kvlease_transport::tcp::TcpAgent;
use kvlease_transport::{Agent, AgentEvent, BlockArena, OpenGate, ReadOp, Segment};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

const MIB: usize = 1024 * 1024;
const TOTAL: usize = 256 * MIB;
const PER_READ: usize = 64 * MIB;
const SEGMENT: usize = MIB;
const REPS: usize = 7;
const ROUND_TRIPS: usize = 2000;
const WARM_UP_TRIPS: usize = 100;
const BLOCKS: u32 = (PER_READ / SEGMENT) as u32;

type Events = mpsc::UnboundedReceiver<AgentEvent>;

struct Pair {
    p: Arc<dyn Agent>,
    p_events: Events,
    d: Arc<dyn Agent>,
    d_events: Events,
}

struct Results {
    start: Duration,
    first_read: Duration,
    gbps: f64,
    rtt_median_us: f64,
    rtt_p99_us: f64,
    idle_cpu_pct: f64,
}

/// `NixlOptions::default()` with the polling overridden from `NIXL_BENCH_*` variables.
fn nixl_options(secret: Option<Vec<u8>>) -> NixlOptions {
    let us = |var: &str, default: Duration| {
        std::env::var(var).ok().and_then(|v| v.parse::<u64>().ok()).map(Duration::from_micros).unwrap_or(default)
    };
    let d = NixlOptions::default();
    NixlOptions {
        secret,
        reply_poll: us("NIXL_BENCH_REPLY_POLL_US", d.reply_poll),
        reply_window: us("NIXL_BENCH_REPLY_WINDOW_US", d.reply_window),
        active_poll: us("NIXL_BENCH_ACTIVE_POLL_US", d.active_poll),
        idle_poll: us("NIXL_BENCH_IDLE_POLL_US", d.idle_poll),
        xfer_poll: us("NIXL_BENCH_XFER_POLL_US", d.xfer_poll),
        progress_delay_us: std::env::var("NIXL_BENCH_PROGRESS_DELAY_US").ok().and_then(|v| v.parse().ok()).unwrap_or(d.progress_delay_us),
        ..d
    }
}

/// This process's utime + stime, in seconds.
fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces): utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<f64> = rest.split_whitespace().map(|x| x.parse().unwrap_or(0.0)).collect();
    let hz = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse::<f64>().ok())
        .unwrap_or(100.0);
    (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) / hz
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn nixl_pair() -> Result<Pair, String> {
    let (p_tx, p_events) = mpsc::unbounded_channel();
    let (d_tx, d_events) = mpsc::unbounded_channel();
    let arena = || BlockArena::new(BLOCKS, SEGMENT);
    // With a secret, as deployed: every notification is sealed and opened (SPEC S2).
    let secret = || Some(b"bench secret".to_vec());
    let p = NixlAgent::start_with("bench-nixl-p".into(), arena(), Arc::new(OpenGate), p_tx, nixl_options(secret()))
        .await
        .map_err(|e| e.to_string())?;
    let d = NixlAgent::start_with("bench-nixl-d".into(), arena(), Arc::new(OpenGate), d_tx, nixl_options(secret()))
        .await
        .map_err(|e| e.to_string())?;
    Ok(Pair { p, p_events, d, d_events })
}

async fn tcp_pair() -> Result<Pair, String> {
    let (p_tx, p_events) = mpsc::unbounded_channel();
    let (d_tx, d_events) = mpsc::unbounded_channel();
    let arena = || BlockArena::new(BLOCKS, SEGMENT);
    let p = TcpAgent::start("bench-tcp-p".into(), "127.0.0.1", arena(), Arc::new(OpenGate), p_tx).await.map_err(|e| e.to_string())?;
    let d = TcpAgent::start("bench-tcp-d".into(), "127.0.0.1", arena(), Arc::new(OpenGate), d_tx).await.map_err(|e| e.to_string())?;
    Ok(Pair { p, p_events, d, d_events })
}

fn full_read() -> ReadOp {
    let segments =
        (0..BLOCKS).map(|b| Segment { remote_block: b, remote_offset: 0, local_block: b, local_offset: 0, len: SEGMENT as u32 }).collect();
    ReadOp { lease_id: 1, segments, notif: None, tag: Vec::new() }
}

async fn pull(pair: &Pair) -> Result<Duration, String> {
    let start = Instant::now();
    for _ in 0..TOTAL / PER_READ {
        pair.d.read(pair.p.name(), full_read()).await.map_err(|e| e.to_string())?;
    }
    Ok(start.elapsed())
}

async fn run(label: &str, start_pair: impl std::future::Future<Output = Result<Pair, String>>) -> Result<Results, String> {
    let t = Instant::now();
    let mut pair = start_pair.await?;
    let start = t.elapsed();
    let (p_md, d_md) = (pair.p.metadata(), pair.d.metadata());
    let (a, b) = tokio::join!(pair.p.add_peer(&d_md), pair.d.add_peer(&p_md));
    a.map_err(|e| e.to_string())?;
    b.map_err(|e| e.to_string())?;
    for blk in 0..BLOCKS {
        // SAFETY: nothing else touches P's arena during the benchmark.
        unsafe { pair.p.arena().copy_in(blk, 0, &vec![blk as u8 ^ 0x5a; SEGMENT]) };
    }
    let t = Instant::now();
    pair.d
        .read(pair.p.name(), ReadOp { lease_id: 1, segments: full_read().segments[..1].to_vec(), notif: None, tag: Vec::new() })
        .await
        .map_err(|e| e.to_string())?;
    let first_read = t.elapsed();
    pull(&pair).await?; // warm-up (page faults of the fresh arenas)
    let mut runs = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        runs.push(gbps(TOTAL, pull(&pair).await?));
    }
    let mut check = vec![0u8; SEGMENT];
    // SAFETY: the reads are over; nothing writes D's arena.
    unsafe { pair.d.arena().copy_out(7, 0, &mut check) };
    if !check.iter().all(|&b| b == 7 ^ 0x5a) {
        return Err(format!("{label}: pulled bytes are not P's"));
    }

    // P echoes every notification back to its sender.
    let echo_p = Arc::clone(&pair.p);
    let mut p_events = std::mem::replace(&mut pair.p_events, mpsc::unbounded_channel().1);
    let echo = tokio::spawn(async move {
        while let Some(e) = p_events.recv().await {
            if let AgentEvent::Notification { from, bytes } = e {
                let _ = echo_p.send_notif(&from, bytes);
            }
        }
    });
    let mut rtts = Vec::with_capacity(ROUND_TRIPS);
    for i in 0..ROUND_TRIPS + WARM_UP_TRIPS {
        let msg = (i as u64).to_le_bytes().to_vec();
        let t = Instant::now();
        pair.d.send_notif(pair.p.name(), msg.clone()).map_err(|e| e.to_string())?;
        match tokio::time::timeout(Duration::from_secs(5), pair.d_events.recv()).await {
            Ok(Some(AgentEvent::Notification { bytes, .. })) if bytes == msg => {}
            other => return Err(format!("{label}: unexpected {other:?} waiting for echo {i}")),
        }
        if i >= WARM_UP_TRIPS {
            rtts.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    echo.abort();
    rtts.sort_by(f64::total_cmp);
    // Idle: past the agents' active linger, nothing sent.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (c0, t0) = (cpu_secs(), Instant::now());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle_cpu_pct = (cpu_secs() - c0) / t0.elapsed().as_secs_f64() * 100.0;
    Ok(Results {
        start,
        first_read,
        gbps: median(runs),
        rtt_median_us: rtts[rtts.len() / 2],
        rtt_p99_us: rtts[rtts.len() * 99 / 100],
        idle_cpu_pct,
    })
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| "(unset)".into())
}

#[tokio::main]
async fn main() {
    if !nixl::available() {
        eprintln!("nixl_bench: {}", nixl::UNAVAILABLE);
        std::process::exit(2);
    }
    let nixl = match run("nixl", nixl_pair()).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("nixl_bench: nixl: {e}");
            std::process::exit(1);
        }
    };
    let tcp = match run("tcp", tcp_pair()).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("nixl_bench: tcp: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "kvlease-transport nixl_bench (UCX_TLS={} UCX_TCP_TX_SEG_SIZE={} UCX_TCP_RX_SEG_SIZE={})",
        env("UCX_TLS"),
        env("UCX_TCP_TX_SEG_SIZE"),
        env("UCX_TCP_RX_SEG_SIZE")
    );
    println!(
        "  pull: {} MiB reads of {} MiB segments, {} MiB per repetition, median of {REPS}",
        PER_READ / MIB,
        SEGMENT / MIB,
        TOTAL / MIB
    );
    println!("  notification round trip: {ROUND_TRIPS} after {WARM_UP_TRIPS} warm-up");
    println!("  nixl polling: {:?}", nixl_options(None));
    println!("  backend  start     first 1 MiB read  pull GB/s  rtt median µs  rtt p99 µs  idle CPU % (both agents)");
    for (label, r) in [("nixl", &nixl), ("tcp", &tcp)] {
        println!(
            "  {label:<7} {:>6.0} ms {:>13.1} ms {:>10.2} {:>14.1} {:>11.1} {:>10.2}",
            r.start.as_secs_f64() * 1e3,
            r.first_read.as_secs_f64() * 1e3,
            r.gbps,
            r.rtt_median_us,
            r.rtt_p99_us,
            r.idle_cpu_pct
        );
    }
}
