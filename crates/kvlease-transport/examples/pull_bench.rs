//! KV pull throughput of the tcp agent against a plain loopback socket copy measured in the
//! same run, and notification round-trip latency over the tcp agent.
//!
//! `cargo run --release -p kvlease-transport --example pull_bench`
//!
//! The sending side (P) and the receiving side (D) each run on their own one-thread tokio
//! runtime, as two engine processes would, for every measurement:
//! (a) plain socket copy: P's task writes N bytes, D's task reads them, 1 MiB per call, over one
//!     loopback connection with TCP_NODELAY; once with a single 1 MiB buffer each side (it stays
//!     in cache), once walking through 64 MiB buffers, the size of the arenas (b) moves between;
//! (b) agent pull: D reads P's arena, 64 MiB per read in 1 MiB segments, N bytes per repetition;
//! (c) notification round trip: D notifies P, P echoes, 2000 times.
//! Throughputs are the median of the repetitions.

use kvlease_transport::tcp::TcpAgent;
use kvlease_transport::{Agent, AgentEvent, BlockArena, OpenGate, ReadOp, Segment};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::{Builder, Handle, Runtime};
use tokio::sync::mpsc;

const MIB: usize = 1024 * 1024;
const TOTAL: usize = 256 * MIB;
const PER_READ: usize = 64 * MIB;
/// Size of each write and read of the plain socket copy.
const COPY_PIECE: usize = MIB;
const SEGMENT: usize = MIB;
const REPS: usize = 11;
const ROUND_TRIPS: usize = 2000;

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn runtime(name: &str) -> Runtime {
    Builder::new_multi_thread().worker_threads(1).thread_name(name).enable_all().build().unwrap()
}

/// A loopback connection, P's end and a source buffer on P's runtime, D's end and a
/// destination buffer on D's, each `span` bytes, moved in `COPY_PIECE` calls.
struct SocketCopy {
    p_end: Option<(TcpStream, Vec<u8>)>,
    d_end: Option<(TcpStream, Vec<u8>)>,
}

impl SocketCopy {
    async fn new(span: usize) -> SocketCopy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, server) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (tx, rx) = (client.unwrap(), server.unwrap().0);
        tx.set_nodelay(true).unwrap();
        rx.set_nodelay(true).unwrap();
        let src: Vec<u8> = (0..span).map(|i| i as u8).collect();
        SocketCopy { p_end: Some((tx, src)), d_end: Some((rx, vec![1u8; span])) }
    }

    /// Copies `TOTAL` bytes; the time is D's, from its first read to its last byte.
    async fn run(&mut self, p: &Handle, d: &Handle) -> Duration {
        let (mut tx, src) = self.p_end.take().unwrap();
        let (mut rx, mut dst) = self.d_end.take().unwrap();
        let writer = p.spawn(async move {
            for piece in src.chunks(COPY_PIECE).cycle().take(TOTAL / COPY_PIECE) {
                tx.write_all(piece).await.unwrap();
            }
            (tx, src)
        });
        let reader = d.spawn(async move {
            let start = Instant::now();
            let span = dst.len();
            for i in 0..TOTAL / COPY_PIECE {
                let at = (i * COPY_PIECE) % span;
                rx.read_exact(&mut dst[at..at + COPY_PIECE]).await.unwrap();
            }
            (start.elapsed(), rx, dst)
        });
        let (elapsed, rx, dst) = reader.await.unwrap();
        self.p_end = Some(writer.await.unwrap());
        self.d_end = Some((rx, std::hint::black_box(dst)));
        elapsed
    }
}

/// Starts an agent with a 64 MiB arena on the runtime `rt`.
async fn start(name: &str, rt: &Handle) -> (Arc<TcpAgent>, mpsc::UnboundedReceiver<AgentEvent>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let name = name.to_owned();
    let arena = BlockArena::new((PER_READ / SEGMENT) as u32, SEGMENT);
    let agent = rt.spawn(async move { TcpAgent::start(name, "127.0.0.1", arena, Arc::new(OpenGate), tx).await.unwrap() });
    (agent.await.unwrap(), rx)
}

fn full_read() -> ReadOp {
    let blocks = (PER_READ / SEGMENT) as u32;
    let segments =
        (0..blocks).map(|b| Segment { remote_block: b, remote_offset: 0, local_block: b, local_offset: 0, len: SEGMENT as u32 }).collect();
    ReadOp { lease_id: 1, segments, notif: None, tag: Vec::new() }
}

/// `TOTAL` bytes pulled by D from P in `PER_READ` reads, timed on D's runtime.
async fn agent_pull(d: &Arc<TcpAgent>, rt_d: &Handle) -> Duration {
    let d = Arc::clone(d);
    rt_d.spawn(async move {
        let start = Instant::now();
        for _ in 0..TOTAL / PER_READ {
            d.read("bench-p", full_read()).await.unwrap();
        }
        start.elapsed()
    })
    .await
    .unwrap()
}

fn main() {
    let run_start = Instant::now();
    let (rt_p, rt_d) = (runtime("bench-p"), runtime("bench-d"));
    let (p_rt, d_rt) = (rt_p.handle().clone(), rt_d.handle().clone());
    let orchestrator = Builder::new_current_thread().enable_all().build().unwrap();
    orchestrator.block_on(async move {
        let (p, mut p_events) = start("bench-p", &p_rt).await;
        let (d, mut d_events) = start("bench-d", &d_rt).await;
        let (p_md, d_md) = (p.metadata(), d.metadata());
        let (p2, d2) = (Arc::clone(&p), Arc::clone(&d));
        let p_adds = p_rt.spawn(async move { p2.add_peer(&d_md).await.map(|_| ()) });
        let d_adds = d_rt.spawn(async move { d2.add_peer(&p_md).await.map(|_| ()) });
        p_adds.await.unwrap().unwrap();
        d_adds.await.unwrap().unwrap();
        for blk in 0..(PER_READ / SEGMENT) as u32 {
            // SAFETY: nothing else touches P's arena during the benchmark.
            unsafe { p.arena().copy_in(blk, 0, &vec![blk as u8; SEGMENT]) };
        }

        // Warm up every path (page faults of fresh buffers, socket autotuning).
        let mut hot = SocketCopy::new(COPY_PIECE).await;
        let mut cold = SocketCopy::new(PER_READ).await;
        hot.run(&p_rt, &d_rt).await;
        cold.run(&p_rt, &d_rt).await;
        agent_pull(&d, &d_rt).await;

        let (mut socket_hot, mut socket_cold, mut agent) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..REPS {
            socket_hot.push(gbps(TOTAL, hot.run(&p_rt, &d_rt).await));
            socket_cold.push(gbps(TOTAL, cold.run(&p_rt, &d_rt).await));
            agent.push(gbps(TOTAL, agent_pull(&d, &d_rt).await));
        }
        let mut check = vec![0u8; SEGMENT];
        // SAFETY: the reads are over; nothing writes D's arena.
        unsafe { d.arena().copy_out(7, 0, &mut check) };
        assert!(check.iter().all(|&b| b == 7), "pulled bytes are P's");
        let (hot_gbps, cold_gbps, agent_gbps) = (median(socket_hot), median(socket_cold), median(agent));

        // P echoes every notification back to its sender.
        let echo_p = Arc::clone(&p);
        let echo = p_rt.spawn(async move {
            while let Some(e) = p_events.recv().await {
                if let AgentEvent::Notification { from, bytes } = e {
                    let _ = echo_p.send_notif(&from, bytes);
                }
            }
        });
        let d2 = Arc::clone(&d);
        let mut rtts = d_rt
            .spawn(async move {
                let mut rtts = Vec::with_capacity(ROUND_TRIPS);
                for i in 0..ROUND_TRIPS + 100 {
                    let start = Instant::now();
                    d2.send_notif("bench-p", (i as u64).to_le_bytes().to_vec()).unwrap();
                    match d_events.recv().await {
                        Some(AgentEvent::Notification { bytes, .. }) if bytes == (i as u64).to_le_bytes() => {}
                        other => panic!("unexpected {other:?}"),
                    }
                    if i >= 100 {
                        rtts.push(start.elapsed().as_secs_f64() * 1e6);
                    }
                }
                rtts
            })
            .await
            .unwrap();
        rtts.sort_by(f64::total_cmp);
        let (rtt_median, rtt_p99) = (rtts[rtts.len() / 2], rtts[rtts.len() * 99 / 100]);
        echo.abort();

        let mib = |n: usize| n / MIB;
        println!("kvlease-transport pull_bench: {} MiB per repetition, median of {REPS}", mib(TOTAL));
        println!("  (a) plain loopback socket copy, {} MiB writes and reads:", mib(COPY_PIECE));
        println!("      one {} MiB buffer each side (cache-hot)    {hot_gbps:6.2} GB/s", mib(COPY_PIECE));
        println!("      {} MiB buffers each side (as the arenas)   {cold_gbps:6.2} GB/s", mib(PER_READ));
        println!("  (b) tcp agent pull, {} MiB reads of {} MiB segments {agent_gbps:6.2} GB/s", mib(PER_READ), mib(SEGMENT));
        println!("      ratio (b)/(a) cache-hot                   {:6.1} %", 100.0 * agent_gbps / hot_gbps);
        println!("      ratio (b)/(a) arena-sized                 {:6.1} %", 100.0 * agent_gbps / cold_gbps);
        println!("  (c) notification round trip: median {rtt_median:.1} µs, p99 {rtt_p99:.1} µs over {ROUND_TRIPS}");
        println!("  total run time {:.1} s", run_start.elapsed().as_secs_f64());
    });
    drop(rt_p);
    drop(rt_d);
}
