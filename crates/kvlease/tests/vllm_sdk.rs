//! Issue 9 "done when": the OpenAI Python SDK drives completions and chat, streaming and not,
//! with `stop`, `n`, `seed` and `logprobs`, through the proxy (P and D as real processes) and
//! against a local engine: every answer parses in the SDK's types and disaggregated answers equal
//! local ones (SPEC D7, §10). `scripts/test.sh` installs the SDK (`pip install openai`).

mod common;
use common::*;
use std::process::Command;

#[test]
fn openai_python_sdk_drives_completions_and_chat_disaggregated_equal_local() {
    let has_sdk = Command::new("python3").args(["-c", "import openai"]).status().is_ok_and(|s| s.success());
    assert!(has_sdk, "the OpenAI Python SDK is missing: run scripts/test.sh, or `python3 -m pip install openai`");
    let cfg = lease_config(30.0);
    let p = Proc::serve("sdk-p", &["--kv-transfer-config", &cfg]);
    let d = Proc::serve("sdk-d", &["--kv-transfer-config", &cfg]);
    let local = Proc::serve("sdk-local", &[]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sdk/openai_sdk.py");
    let out = Command::new("python3").arg(script).arg(&proxy.url).arg(&local.url).env("NO_PROXY", "*").output().expect("run python3");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "SDK script failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("openai sdk: ok"), "{stdout}");
}
