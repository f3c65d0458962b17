//! SPEC S3: everything listens on 127.0.0.1 unless `--host` says otherwise — the HTTP API, the
//! KV handshake side channel and the transfer agents of `kvlease serve`, and `kvlease proxy`.
//! Real processes; their listening sockets are read from the kernel (`/proc/<pid>/net/tcp{,6}`,
//! matched to the process's own socket descriptors), so a listener the code forgot is seen too.

mod common;

use common::Proc;
use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::process::{Command, Stdio};

/// The TCP sockets process `pid` listens on.
fn listeners(pid: u32) -> Vec<SocketAddr> {
    let inodes: HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the process's descriptors (Linux /proc)")
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let t = target.to_string_lossy().into_owned();
            Some(t.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let mut found = Vec::new();
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else { continue };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if cols.len() < 10 || cols[3] != "0A" || !inodes.contains(cols[9]) {
                continue;
            }
            found.push(parse_addr(cols[1]));
        }
    }
    found
}

/// `/proc/net/tcp{,6}`'s `HEXIP:HEXPORT`: the address in 32-bit words of host byte order.
fn parse_addr(s: &str) -> SocketAddr {
    let (ip, port) = s.split_once(':').expect("ip:port");
    let port = u16::from_str_radix(port, 16).expect("hex port");
    let words: Vec<u32> = (0..ip.len() / 8).map(|i| u32::from_str_radix(&ip[i * 8..i * 8 + 8], 16).expect("hex ip")).collect();
    let ip = match words[..] {
        [w] => IpAddr::V4(Ipv4Addr::from(w.to_le_bytes())),
        [a, b, c, d] => {
            let mut bytes = [0u8; 16];
            for (i, w) in [a, b, c, d].iter().enumerate() {
                bytes[i * 4..i * 4 + 4].copy_from_slice(&w.to_le_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => panic!("unexpected address {s}"),
    };
    SocketAddr::new(ip, port)
}

fn port_of(url: &str) -> u16 {
    url.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).unwrap_or_else(|| panic!("no port in {url}"))
}

/// Every listener of `pid` is on `ip`, and among them the HTTP port of `url`; returns them.
fn assert_all_on(pid: u32, ip: IpAddr, url: &str, at_least: usize) -> Vec<SocketAddr> {
    let found = listeners(pid);
    assert!(found.len() >= at_least, "expected at least {at_least} listeners, found {found:?}");
    for addr in &found {
        assert_eq!(addr.ip(), ip, "a listener on {addr}, not on {ip}: {found:?}");
    }
    assert!(found.iter().any(|a| a.port() == port_of(url)), "the HTTP port of {url} among {found:?}");
    found
}

/// SPEC S3: by default, `kvlease serve` listens only on 127.0.0.1: its HTTP API, its KV side
/// channel and its tcp transfer agent (one per rank: two here).
#[test]
fn s3_serve_listens_only_on_loopback_by_default() {
    let p = Proc::serve("s3-default", &["--tp-size", "2"]);
    let found = assert_all_on(p.child.id(), IpAddr::V4(Ipv4Addr::LOCALHOST), &p.url, 4);
    eprintln!("serve listeners: {found:?}");
}

/// SPEC S3: `--host` moves every listener of `serve`, the side channel and agents included, to
/// the address it names (127.0.0.2: loopback, so no secret is needed, but not the default).
#[test]
fn s3_serve_host_moves_every_listener() {
    let p = Proc::serve("s3-host", &["--host", "127.0.0.2", "--tp-size", "2"]);
    assert!(p.url.contains("127.0.0.2"), "{}", p.url);
    assert_all_on(p.child.id(), IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)), &p.url, 4);
}

/// SPEC S3: by default `kvlease proxy` listens only on 127.0.0.1.
#[test]
fn s3_proxy_listens_only_on_loopback_by_default() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvlease"))
        .args(["proxy", "--port", "0", "--log-level", "warn"])
        .args(["--prefiller-hosts", "127.0.0.1", "--prefiller-ports", "9", "--decoder-hosts", "127.0.0.1", "--decoder-ports", "9"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn kvlease proxy");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(common::DEADLINE);
    let checked = std::panic::catch_unwind(|| {
        let line = line.expect("the proxy's start-up line in time");
        let url = line.strip_prefix("kvlease proxy listening on ").unwrap_or_else(|| panic!("start-up line {line:?}")).trim();
        assert_all_on(child.id(), IpAddr::V4(Ipv4Addr::LOCALHOST), url, 1);
    });
    let _ = child.kill();
    let _ = child.wait();
    if let Err(panic) = checked {
        std::panic::resume_unwind(panic);
    }
}
