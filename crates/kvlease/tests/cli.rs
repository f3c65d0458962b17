//! The `kvlease` binary as scripts use it: the start-up line on stdout, a clean exit on SIGTERM
//! (SPEC S3: loopback by default), exit code 2 for a configuration refused at start-up.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(20);

fn kvlease() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvlease"))
}

/// Waits for the child's exit with a deadline (the child is killed if it overstays).
fn wait_exit(child: &mut std::process::Child) -> std::process::ExitStatus {
    let start = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!("kvlease did not exit within {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn serve_prints_its_startup_line_on_loopback_and_exits_0_on_sigterm() {
    let (mut child, line) = start_line(&["serve", "--port", "0", "--engine-id", "cli-test", "--log-level", "warn"], None);
    assert!(line.starts_with("kvlease serve listening on http://127.0.0.1:"), "{line:?}");
    assert!(line.contains("(engine cli-test, kv side channel 127.0.0.1:"), "{line:?}");

    let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(killed.success());
    let status = wait_exit(&mut child);
    assert_eq!(status.code(), Some(0), "graceful shutdown exits 0");
}

#[test]
fn refused_configuration_exits_2_with_a_message_naming_the_flag() {
    for (args, flag) in [
        (vec!["serve", "--tp-size", "3"], "--tp-size"),
        (vec!["serve", "--block-size", "0"], "--block-size"),
        (vec!["serve", "--kv-transfer-config", r#"{"kv_connector_extra_config": {"kv_lease_duration": 0}}"#], "kv_lease_duration"),
        (vec!["proxy", "--decoder-hosts", "a", "b", "--decoder-ports", "1", "2", "3"], "--decoder-hosts"),
        (vec!["proxy", "--threads", "0"], "--threads"),
    ] {
        let out = kvlease().args(&args).output().expect("run kvlease");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
    }
}

/// Starts `kvlease serve` with these arguments and environment; returns the child and its HTTP
/// address once the start-up line is out.
fn start_serve(args: &[&str], secret: Option<&str>) -> (std::process::Child, String) {
    let (child, line) = start_line(args, secret);
    let url = line.strip_prefix("kvlease serve listening on http://").unwrap_or_else(|| panic!("start-up line {line:?}"));
    let port = url.split_whitespace().next().and_then(|hp| hp.rsplit_once(':')).expect("host:port").1.to_string();
    (child, format!("127.0.0.1:{port}"))
}

/// Starts kvlease with these arguments and this cluster secret (or none); returns the child and
/// its start-up line.
fn start_line(args: &[&str], secret: Option<&str>) -> (std::process::Child, String) {
    let mut cmd = kvlease();
    cmd.args(args).env_remove("KVLEASE_TRANSFER_SECRET").stdout(Stdio::piped()).stderr(Stdio::piped());
    if let Some(s) = secret {
        cmd.env("KVLEASE_TRANSFER_SECRET", s);
    }
    let mut child = cmd.spawn().expect("spawn kvlease");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(DEADLINE).unwrap_or_else(|_| {
        let _ = child.kill();
        panic!("no start-up line within {DEADLINE:?}")
    });
    (child, line)
}

/// `GET /health` over a raw connection: (status line, body).
fn health(addr: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(DEADLINE)).expect("timeout");
    s.write_all(b"GET /health HTTP/1.1\r\nhost: kvlease\r\nconnection: close\r\n\r\n").expect("request");
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("response");
    let (head, body) = raw.split_once("\r\n\r\n").expect("head and body");
    (head.lines().next().unwrap_or_default().to_string(), body.to_string())
}

/// Stops the child with SIGTERM; returns its exit code and everything it wrote on stderr.
fn stop(mut child: std::process::Child) -> (Option<i32>, String) {
    use std::io::Read;
    let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(killed.success());
    let status = wait_exit(&mut child);
    let mut stderr = String::new();
    child.stderr.take().expect("stderr").read_to_string(&mut stderr).expect("stderr");
    (status.code(), stderr)
}

/// SPEC S3 (protected mode): without a cluster secret, `serve --host 0.0.0.0` refuses to start
/// with exit code 2 and a message naming --host, the secret's flag and --insecure.
#[test]
fn serve_beyond_loopback_without_a_secret_is_refused() {
    let out = kvlease()
        .args(["serve", "--host", "0.0.0.0", "--port", "0", "--engine-id", "exposed"])
        .env_remove("KVLEASE_TRANSFER_SECRET")
        .output()
        .expect("run kvlease");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for named in ["--host 0.0.0.0", "--kv-transfer-secret-file", "KVLEASE_TRANSFER_SECRET", "--insecure"] {
        assert!(stderr.contains(named), "the refusal names {named}: {stderr}");
    }
    assert!(out.stdout.is_empty(), "no start-up line: {:?}", String::from_utf8_lossy(&out.stdout));
}

/// SPEC S3: with `--insecure` the same engine starts, warns on stderr at start-up, and `/health`
/// stays 200 but says `"insecure": true`; with a secret it starts with a plain, empty 200.
#[test]
fn serve_insecure_starts_warns_and_health_says_so() {
    let (child, addr) = start_serve(&["serve", "--host", "0.0.0.0", "--port", "0", "--engine-id", "insecure", "--insecure"], None);
    let (status, body) = health(&addr);
    let (code, stderr) = stop(child);
    assert_eq!(status, "HTTP/1.1 200 OK");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
    assert_eq!(v, serde_json::json!({"status": "ok", "insecure": true}));
    assert_eq!(code, Some(0));
    assert!(stderr.contains("WARN") && stderr.contains("--insecure") && stderr.contains("without a cluster secret"), "{stderr}");

    let (child, addr) = start_serve(&["serve", "--host", "0.0.0.0", "--port", "0", "--engine-id", "secured"], Some("cli-secret"));
    let (status, body) = health(&addr);
    let (code, stderr) = stop(child);
    assert_eq!((status.as_str(), body.as_str(), code), ("HTTP/1.1 200 OK", "", Some(0)), "{stderr}");
    assert!(!stderr.contains("--insecure"), "{stderr}");
}

/// Issue "sizes validated at start-up": `--num-gpu-blocks 4000000000` (32 TB of KV) is refused at
/// once, exit code 2, naming the flag and the bytes it needs, instead of growing until the
/// machine dies; absurd scheduler sizes and HTTP limits are refused the same way.
#[test]
fn oversized_pool_and_absurd_sizes_are_refused_at_start_up() {
    for (args, named) in [
        (vec!["serve", "--num-gpu-blocks", "4000000000"], vec!["--num-gpu-blocks 4000000000", "bytes", "TiB"]),
        (vec!["serve", "--max-num-seqs", "100000000"], vec!["--max-num-seqs"]),
        (vec!["serve", "--max-model-len", "100000000"], vec!["--max-model-len"]),
        (vec!["serve", "--block-size", "65536"], vec!["--block-size"]),
        (vec!["serve", "--http-header-timeout", "0"], vec!["--http-header-timeout"]),
        (vec!["proxy", "--http-max-connections", "0"], vec!["--http-max-connections"]),
    ] {
        let mut child = kvlease().args(&args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("spawn kvlease");
        let status = wait_exit(&mut child);
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut stderr).expect("stderr");
        assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
        for n in named {
            assert!(stderr.contains(n), "{args:?} names {n}: {stderr}");
        }
    }
}

/// Issue 12: `kvlease sim --heartbeat-scale` prints, per size, kvlease's renewal traffic per P
/// beside vLLM's text heartbeat for the same leases (the counts themselves are proved in
/// kvlease-sim's tests/heartbeat_scale.rs).
#[test]
fn sim_heartbeat_scale_prints_kvlease_beside_vllm() {
    let out = kvlease()
        .args(["sim", "--heartbeat-scale", "100,300", "--scale-prefills", "2", "--scale-decoders", "4", "--scale-seconds", "10"])
        .output()
        .expect("kvlease sim");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("2 P, 4 D,"), "{text}");
    for live in ["100", "300"] {
        let row =
            text.lines().find(|l| l.trim_start().starts_with(&format!("{live} |"))).unwrap_or_else(|| panic!("no row for {live}: {text}"));
        assert!(row.contains('×'), "a vLLM ÷ kvlease ratio: {row}");
    }
    let bad = kvlease().args(["sim", "--heartbeat-scale", "0"]).output().expect("kvlease sim");
    assert!(!bad.status.success());
}

/// Bad input gets a clear error: a `kvlease sim` whose traffic the simulator cannot hold is
/// refused up front, naming the flags, instead of printing a table of zeros (its engines could
/// not start) or running for days.
#[test]
fn sim_refuses_traffic_it_cannot_hold_naming_the_flags() {
    let out = kvlease().args(["sim", "--rate", "10000000", "--seconds", "86400", "--sweep", "30"]).output().expect("kvlease sim");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--rate") && err.contains("--seconds") && err.contains("more than the simulator holds"), "{err}");
    assert!(out.stdout.is_empty(), "no table: {}", String::from_utf8_lossy(&out.stdout));
}

/// `kvlease sim` puts vLLM's lease beside fixed timeouts and kvlease's on the same traffic, and
/// runs several engines (`--prefills`, `--decoders`, `--routing`).
#[test]
fn sim_table_has_vllms_lease_and_runs_several_engines() {
    let chart = std::env::temp_dir().join(format!("kvlease-sim-{}.svg", std::process::id()));
    let out = kvlease()
        .args(["sim", "--seconds", "60", "--crash-at", "30", "--pause-at", "0", "--loss", "0"])
        .args(["--prefills", "2", "--decoders", "2", "--routing", "least-loaded", "--json", "--chart"])
        .arg(&chart)
        .output()
        .expect("kvlease sim");
    // The side-by-side chart: a panel per policy.
    let svg = std::fs::read_to_string(&chart).expect("the chart");
    let _ = std::fs::remove_file(&chart);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{svg}");
    for policy in ["fixed 480 s", "fixed 30 s", "vLLM lease 30 s", "lease 30 s"] {
        assert!(svg.contains(&format!(">{policy}<")), "no panel for {policy}");
    }
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("one JSON object per line")).collect();
    let names: Vec<&str> = lines.iter().filter_map(|l| l["policy"].as_str()).collect();
    assert_eq!(names, ["fixed 480 s", "fixed 30 s", "vLLM lease 30 s", "lease 30 s"]);
    for r in &lines {
        assert!(r["arrived"].as_u64().is_some_and(|n| n > 100), "arrivals go on after d0's crash: {r}");
    }
}

/// Issue 13: `kvlease sim --sweep --json` shows both failures the lease is chosen between — a
/// lease shorter than a decoder's silence frees live decoders' KV, a long one pins a crashed
/// decoder's blocks — and recommends the shortest lease that frees no live decoder's KV.
#[test]
fn sim_sweep_shows_the_trade_off_and_recommends_a_lease() {
    let out = kvlease()
        .args(["sim", "--seconds", "200", "--pause-at", "60", "--pause-secs", "5", "--crash-at", "150", "--loss", "0"])
        .args(["--sweep", "2,30", "--json"])
        .output()
        .expect("kvlease sim");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("one JSON object per line")).collect();
    let [short, long, pick] = lines.as_slice() else { panic!("two policies and a recommendation: {lines:?}") };
    assert_eq!(short["policy"], "lease 2 s");
    assert!(short["premature_frees"].as_u64().is_some_and(|n| n > 0), "a 5 s silence outlives E = 1.3 s: {short}");
    assert_eq!(long["premature_frees"], 0, "E = 20 s outlives it: {long}");
    for r in [short, long] {
        assert_eq!(r["garbage"], 0, "a lease never serves freed KV: {r}");
    }
    let dead = |r: &serde_json::Value| r["dead_block_seconds"].as_f64().expect("dead block·s");
    assert!(dead(long) > 5.0 * dead(short), "a long lease pins a crashed decoder's blocks longer: {short} {long}");
    assert_eq!(pick["recommended_kv_lease_duration"], 30.0);
}

/// Issue 24: `kvlease sim --push` runs push mode's core machines over seeds and prints one line
/// per seed and a total (the checks themselves are proved in kvlease-sim's tests/push.rs).
#[test]
fn sim_push_runs_the_seeds() {
    let out = kvlease().args(["sim", "--push", "--seed", "1", "--seeds", "3"]).output().expect("kvlease sim");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().filter(|l| l.starts_with("seed ") && l.ends_with(": ok")).count(), 3, "{text}");
    assert!(text.contains("3 seeds,"), "{text}");
    let both = kvlease().args(["sim", "--push", "--cluster"]).output().expect("kvlease sim");
    assert!(!both.status.success(), "one simulation at a time");
}
