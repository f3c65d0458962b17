//! `kvlease load` against a real `kvlease serve`: 20 requests at concurrency 4 all succeed, the
//! summary line has every field, and an unreachable server makes the run fail with exit code 1.

mod common;
use common::*;
use std::process::Command;

fn load(url: &str, extra: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvlease"))
        .args(["load", "--url", url, "--requests", "20", "--concurrency", "4", "--timeout-secs", "20", "--json"])
        .args(extra)
        .output()
        .expect("run kvlease load");
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The numeric value of `key=` in the summary line.
fn field(line: &str, key: &str) -> f64 {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
        .parse()
        .unwrap_or_else(|e| panic!("{key} in {line:?}: {e}"))
}

#[test]
fn load_sends_all_requests_to_a_real_server_and_prints_the_summary() {
    let engine = Proc::serve("load-engine", &[]);
    for extra in [&[][..], &["--stream"][..]] {
        let (code, stdout, stderr) = load(&engine.url, extra);
        assert_eq!(code, Some(0), "{extra:?}: stdout {stdout:?} stderr {stderr:?}");
        let mut lines = stdout.lines();
        let summary = lines.next().expect("summary line");
        assert!(summary.starts_with("requests=20 ok=20 failed=0 seconds="), "{summary:?}");
        assert!(field(summary, "rps") > 0.0, "{summary:?}");
        let (p50, p99) = (field(summary, "p50_ms"), field(summary, "p99_ms"));
        assert!(p50 > 0.0 && p99 >= p50, "{summary:?}");
        // 20 answers of max_tokens (8) tokens each.
        assert!(field(summary, "out_tok_s") > 0.0, "{summary:?}");
        if extra.contains(&"--stream") {
            // vLLM's serving figures: time to first token, inter-token latency, time per output token.
            for f in ["ttft", "itl", "tpot"] {
                let (p50, p99) = (field(summary, &format!("{f}_p50_ms")), field(summary, &format!("{f}_p99_ms")));
                assert!(p50 >= 0.0 && p99 >= p50 && p50.is_finite(), "{f}: {summary:?}");
            }
            assert!(field(summary, "ttft_p50_ms") <= p50, "{summary:?}");
        } else {
            assert!(!summary.contains("ttft_"), "{summary:?}");
        }
        let json: serde_json::Value = serde_json::from_str(lines.next().expect("JSON line")).expect("JSON");
        assert_eq!((json["requests"].as_u64(), json["ok"].as_u64(), json["failed"].as_u64()), (Some(20), Some(20), Some(0)));
    }
}

#[test]
fn load_fails_with_exit_1_when_requests_fail() {
    // A port that was just free: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
    let (code, stdout, stderr) = load(&format!("http://127.0.0.1:{port}"), &[]);
    assert_eq!(code, Some(1), "stdout {stdout:?} stderr {stderr:?}");
    assert!(stdout.starts_with("requests=20 ok=0 failed=20 "), "{stdout:?}");
    assert!(stderr.contains("failures: connect=20"), "{stderr:?}");
}

/// Issue 13: `--csv` writes the run's per-second series: a header, then one row per second whose
/// counts add up to the run's.
#[test]
fn load_writes_its_per_second_series_as_csv() {
    let engine = Proc::serve("load-csv", &["--decode-ms-per-token", "20"]);
    let path = std::env::temp_dir().join(format!("kvlease-load-{}.csv", std::process::id()));
    let (code, stdout, stderr) = load(&engine.url, &["--csv", path.to_str().expect("utf-8 path"), "--max-tokens", "20"]);
    assert_eq!(code, Some(0), "stdout {stdout:?} stderr {stderr:?}");
    let text = std::fs::read_to_string(&path).expect("the CSV file");
    let _ = std::fs::remove_file(&path);
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("second,ok,failed,rps,out_tok_s,p50_ms,p99_ms"));
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    // 20 requests of 20 tokens at 20 ms each, 4 at a time: about two seconds.
    assert!(rows.len() >= 2, "a row per second: {text}");
    let ok: u64 = rows.iter().map(|r| r[1].parse::<u64>().expect("ok count")).sum();
    let failed: u64 = rows.iter().map(|r| r[2].parse::<u64>().expect("failed count")).sum();
    assert_eq!((ok, failed), (20, 0), "{text}");
    for r in rows.iter().filter(|r| r[1] != "0") {
        // The first token comes from the prefill step; the other 19 take a 20 ms step each.
        assert!(r[5].parse::<f64>().is_ok_and(|p50| p50 >= 380.0), "19 decode steps × 20 ms: {r:?}");
    }
}
