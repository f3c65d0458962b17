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
    let mut child = kvlease()
        .args(["serve", "--port", "0", "--engine-id", "cli-test", "--log-level", "warn"])
        .env_remove("KVLEASE_TRANSFER_SECRET")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvlease");
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
    ] {
        let out = kvlease().args(&args).output().expect("run kvlease");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
    }
}
