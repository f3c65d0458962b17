//! What per-engine certificates (SPEC S6: mutual TLS on the tcp agent) cost a KV pull, next to
//! the plain tcp agent in the same run.
//!
//! `cargo run --release -p kvlease-transport --example tls_pull_bench`
//!
//! Two pairs of agents, P and D each on a one-thread runtime of its own (as two processes would
//! be): one pair plain, one pair with certificates of a CA made here. D pulls back to back, each
//! read awaited before the next, two sizes: 56 KiB (a 32-word prompt's 7 blocks of 8 KiB, the
//! common disaggregated read here) and 1 MiB (16 segments of 64 KiB). Plain and TLS alternate,
//! repetition by repetition; reported: median time per read and GB/s over the median repetition,
//! and TLS ÷ plain.

use kvlease_transport::tcp::{TcpAgent, TcpOptions};
use kvlease_transport::tls::{TransferTls, TransferTlsFlags};
use kvlease_transport::{Agent, AgentEvent, BlockArena, OpenGate, ReadOp, Segment};
use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::runtime::{Builder, Handle, Runtime};
use tokio::sync::mpsc;

const KIB: usize = 1024;
const BLOCK: usize = 64 * KIB;
const BLOCKS: u32 = 64;
const REPS: usize = 9;

/// A read shape: its name, segments (block, length) and reads per repetition.
struct Shape {
    name: &'static str,
    segments: Vec<(u32, u32)>,
    reads: usize,
}

fn shapes() -> Vec<Shape> {
    vec![
        Shape { name: "56 KiB (7 × 8 KiB)", segments: (0..7).map(|b| (b, 8 * KIB as u32)).collect(), reads: 4000 },
        Shape { name: "1 MiB (16 × 64 KiB)", segments: (0..16).map(|b| (b, BLOCK as u32)).collect(), reads: 600 },
    ]
}

fn runtime(name: &str) -> Runtime {
    Builder::new_multi_thread().worker_threads(1).thread_name(name).enable_all().build().unwrap()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A cluster CA in `dir`, and engine `id`'s certificate and key signed by it.
fn certificate(dir: &Path, ca: &(rcgen::Certificate, KeyPair), id: &str) -> TransferTls {
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.subject_alt_names.push(SanType::URI(format!("kvlease://engine/{id}").try_into().unwrap()));
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, &ca.0, &ca.1).unwrap();
    std::fs::write(dir.join(format!("{id}.pem")), cert.pem()).unwrap();
    std::fs::write(dir.join(format!("{id}.key")), key.serialize_pem()).unwrap();
    TransferTls::load(&TransferTlsFlags { cert: dir.join(format!("{id}.pem")), key: dir.join(format!("{id}.key")), ca: dir.join("ca.pem") })
        .unwrap()
}

async fn start(name: &str, rt: &Handle, tls: Option<TransferTls>) -> Arc<TcpAgent> {
    let (tx, mut rx) = mpsc::unbounded_channel::<AgentEvent>();
    let name = name.to_owned();
    let arena = BlockArena::new(BLOCKS, BLOCK);
    let options = TcpOptions { tls, ..TcpOptions::default() };
    let agent = rt.spawn(async move { TcpAgent::start_with(name, "127.0.0.1", arena, Arc::new(OpenGate), tx, options).await.unwrap() });
    rt.spawn(async move { while rx.recv().await.is_some() {} });
    agent.await.unwrap()
}

/// A connected pair, P and D on their runtimes; P's arena filled.
async fn pair(tag: &str, rt_p: &Handle, rt_d: &Handle, tls: Option<(TransferTls, TransferTls)>) -> (Arc<TcpAgent>, Arc<TcpAgent>) {
    let (p_tls, d_tls) = tls.map_or((None, None), |(p, d)| (Some(p), Some(d)));
    let p = start(&format!("p{tag}"), rt_p, p_tls).await;
    let d = start(&format!("d{tag}"), rt_d, d_tls).await;
    let (p_md, d_md) = (p.metadata(), d.metadata());
    let (p2, d2) = (Arc::clone(&p), Arc::clone(&d));
    let a = rt_p.spawn(async move { p2.add_peer(&d_md).await.map(|_| ()) });
    let b = rt_d.spawn(async move { d2.add_peer(&p_md).await.map(|_| ()) });
    a.await.unwrap().unwrap();
    b.await.unwrap().unwrap();
    for blk in 0..BLOCKS {
        // SAFETY: nothing else touches P's arena during the benchmark.
        unsafe { p.arena().copy_in(blk, 0, &vec![blk as u8; BLOCK]) };
    }
    (p, d)
}

/// `shape.reads` reads back to back on D's runtime; the time of the whole run.
async fn pull(d: &Arc<TcpAgent>, peer: &str, rt_d: &Handle, shape: &Shape) -> Duration {
    let d = Arc::clone(d);
    let peer = peer.to_owned();
    let segments: Vec<Segment> = shape
        .segments
        .iter()
        .map(|&(b, len)| Segment { remote_block: b, remote_offset: 0, local_block: b, local_offset: 0, len })
        .collect();
    let reads = shape.reads;
    rt_d.spawn(async move {
        let start = Instant::now();
        for _ in 0..reads {
            let op = ReadOp { lease_id: 1, segments: segments.clone(), notif: None, tag: Vec::new() };
            d.read(&peer, op).await.unwrap();
        }
        start.elapsed()
    })
    .await
    .unwrap()
}

fn main() {
    let dir = std::env::temp_dir().join(format!("kvlease-tls-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate().unwrap();
        (p.self_signed(&key).unwrap(), key)
    };
    std::fs::write(dir.join("ca.pem"), ca.0.pem()).unwrap();
    let tls = (certificate(&dir, &ca, "ptls"), certificate(&dir, &ca, "dtls"));

    let (rt_p, rt_d) = (runtime("bench-p"), runtime("bench-d"));
    let (p_rt, d_rt) = (rt_p.handle().clone(), rt_d.handle().clone());
    let orchestrator = Builder::new_current_thread().enable_all().build().unwrap();
    orchestrator.block_on(async move {
        let (_p, d_plain) = pair("plain", &p_rt, &d_rt, None).await;
        let (_pt, d_tls) = pair("tls", &p_rt, &d_rt, Some(tls)).await;
        println!("kvlease-transport tls_pull_bench: reads awaited one after the other, median of {REPS} repetitions");
        println!(
            "  {:<22} {:>16} {:>16} {:>10} {:>10} {:>8}",
            "read", "plain µs/read", "mTLS µs/read", "plain GB/s", "mTLS GB/s", "mTLS ÷ plain"
        );
        for shape in shapes() {
            // Warm up both paths.
            pull(&d_plain, "pplain", &d_rt, &shape).await;
            pull(&d_tls, "ptls", &d_rt, &shape).await;
            let (mut plain, mut tls) = (Vec::new(), Vec::new());
            for _ in 0..REPS {
                plain.push(pull(&d_plain, "pplain", &d_rt, &shape).await.as_secs_f64());
                tls.push(pull(&d_tls, "ptls", &d_rt, &shape).await.as_secs_f64());
            }
            let bytes = shape.segments.iter().map(|&(_, l)| l as f64).sum::<f64>() * shape.reads as f64;
            let (plain, tls) = (median(plain), median(tls));
            let per = |t: f64| t / shape.reads as f64 * 1e6;
            println!(
                "  {:<22} {:>16.1} {:>16.1} {:>10.2} {:>10.2} {:>7.2}×",
                shape.name,
                per(plain),
                per(tls),
                bytes / plain / 1e9,
                bytes / tls / 1e9,
                tls / plain
            );
        }
        let mut check = vec![0u8; BLOCK];
        // SAFETY: the reads are over; nothing writes D's arena.
        unsafe { d_tls.arena().copy_out(9, 0, &mut check) };
        assert!(check.iter().all(|&b| b == 9), "pulled bytes are P's");
    });
    drop(rt_p);
    drop(rt_d);
    let _ = std::fs::remove_dir_all(&dir);
}
