//! Test hosts (issue #12): network namespaces joined by veth pairs to a bridge, each with its own
//! address, so P, D and the proxy talk over a real (virtual) wire, and faults are nftables rules
//! on a host's interface. Needs root, `ip` (iproute2), `nft` and `tc`; `scripts/test.sh`
//! installs nftables and sets `KVLEASE_REQUIRE_HOSTS=1`, elsewhere the tests skip loudly.
//!
//! Layout of a [`Net`] on slot `s` (0..200): bridge `kvh<s>-br` at 10.77.<s>.1/24 in the root
//! namespace (so the test process reaches every host), and per host `<h>` a namespace
//! `kvh<s>-<h>` whose `eth0` (10.77.<s>.<10+i>/24) is a veth whose peer `kvh<s>-<h>` sits on the
//! bridge. A slot is owned through `flock` on `/run/kvlease-hosts/slot-<s>.lock` (released by the
//! kernel however the owner dies), so harnesses in parallel tests and test binaries never share
//! one. Whoever takes a slot first sweeps what a dead owner left on it (its processes,
//! namespaces, bridge and veths), and the first harness of a test process sweeps every slot no
//! live process owns; [`Net`]'s `Drop` removes everything it made, after a panic too.

use std::fs::File;
use std::process::Command;

const SLOTS: u32 = 200;
const LOCK_DIR: &str = "/run/kvlease-hosts";

/// One host: a network namespace with one interface (`eth0`) and an address.
#[derive(Clone, Debug)]
pub struct Host {
    pub name: String,
    pub ns: String,
    pub addr: String,
}

/// A set of hosts on one bridge; torn down on drop.
pub struct Net {
    prefix: String,
    hosts: Vec<Host>,
    _slot: File,
}

/// Whether these tests can run here: root with `ip`, `nft` and `tc`. When
/// `KVLEASE_REQUIRE_HOSTS=1` (scripts/test.sh) a missing piece is a failure, else a loud skip.
pub fn available() -> bool {
    let root = Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    let tool = |t: &str| Command::new("sh").args(["-c", &format!("command -v {t}")]).output().is_ok_and(|o| o.status.success());
    let missing: Vec<&str> = [("root", root), ("ip", tool("ip")), ("nft", tool("nft")), ("tc", tool("tc"))]
        .into_iter()
        .filter(|(_, ok)| !ok)
        .map(|(w, _)| w)
        .collect();
    if missing.is_empty() {
        return true;
    }
    let msg = format!("multi-host tests need {missing:?} (scripts/test.sh installs nftables and runs them as root)");
    if std::env::var("KVLEASE_REQUIRE_HOSTS").is_ok_and(|v| v == "1") {
        panic!("KVLEASE_REQUIRE_HOSTS=1 but {msg}");
    }
    eprintln!("!!!!!!!! SKIPPED: {msg} !!!!!!!!");
    false
}

/// Runs a command, panicking with its output when it fails.
pub fn sh(args: &[&str]) -> String {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(out.status.success(), "{args:?} failed: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command, ignoring how it ends (for clean-up).
fn quiet(args: &[&str]) {
    let _ = Command::new(args[0]).args(&args[1..]).output();
}

/// Removes whatever carries `prefix` (`kvh<s>-`): processes in its namespaces, the namespaces
/// (which takes their veths along) and the bridge.
fn sweep(prefix: &str) {
    let list =
        Command::new("ip").args(["netns", "list"]).output().map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
    for ns in list.lines().filter_map(|l| l.split_whitespace().next()).filter(|n| n.starts_with(prefix)) {
        let pids = Command::new("ip")
            .args(["netns", "pids", ns])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        for pid in pids.split_whitespace() {
            quiet(&["kill", "-9", pid]);
        }
        quiet(&["ip", "netns", "del", ns]);
    }
    // A deleted namespace is destroyed asynchronously (later still while a socket lingers), and
    // its veths with it: delete our ends now, so the names are free for the slot's next owner.
    let links = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    for name in
        links.lines().filter_map(|l| l.split(": ").nth(1)).map(|n| n.split('@').next().unwrap_or(n)).filter(|n| n.starts_with(prefix))
    {
        quiet(&["ip", "link", "del", name]);
    }
}

/// Sweeps every slot no live process owns: what test runs that were killed (SIGKILL, a crash)
/// left behind, whichever slots they had. Once per test process.
fn sweep_stale() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let list = Command::new("ip")
            .args(["netns", "list"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let mut slots: Vec<u32> =
            list.lines().filter_map(|l| l.strip_prefix("kvh")?.split_once('-')?.0.parse().ok()).filter(|s| *s < SLOTS).collect();
        slots.dedup();
        for s in slots {
            let Ok(f) = File::options().create(true).truncate(false).write(true).open(format!("{LOCK_DIR}/slot-{s}.lock")) else {
                continue;
            };
            if f.try_lock().is_ok() {
                sweep(&format!("kvh{s}-"));
            }
        }
    });
}

impl Net {
    /// Hosts with these names (at most 200, each at most 8 characters), on a free slot.
    pub fn new(names: &[&str]) -> Net {
        std::fs::create_dir_all(LOCK_DIR).expect("lock dir");
        sweep_stale();
        let (slot, lock) = (0..SLOTS)
            .find_map(|s| {
                let f = File::options().create(true).truncate(false).write(true).open(format!("{LOCK_DIR}/slot-{s}.lock")).ok()?;
                f.try_lock().ok().map(|_| (s, f))
            })
            .expect("a free test-host slot");
        let prefix = format!("kvh{slot}-");
        sweep(&prefix); // what a dead owner of this slot left
        let bridge = format!("{prefix}br");
        let mut net = Net { prefix: prefix.clone(), hosts: Vec::new(), _slot: lock };
        sh(&["ip", "link", "add", &bridge, "type", "bridge"]);
        sh(&["ip", "addr", "add", &format!("10.77.{slot}.1/24"), "dev", &bridge]);
        sh(&["ip", "link", "set", &bridge, "up"]);
        for (i, name) in names.iter().enumerate() {
            assert!(name.len() <= 8, "host name {name} too long for an interface name");
            let ns = format!("{prefix}{name}");
            let addr = format!("10.77.{slot}.{}", 10 + i);
            sh(&["ip", "netns", "add", &ns]);
            // Registered before the veth exists, so a failure below still cleans this up.
            net.hosts.push(Host { name: name.to_string(), ns: ns.clone(), addr: addr.clone() });
            sh(&["ip", "link", "add", &ns, "type", "veth", "peer", "name", "eth0", "netns", &ns]);
            sh(&["ip", "link", "set", &ns, "master", &bridge, "up"]);
            sh(&["ip", "-n", &ns, "addr", "add", &format!("{addr}/24"), "dev", "eth0"]);
            sh(&["ip", "-n", &ns, "link", "set", "eth0", "up"]);
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
        }
        net
    }

    pub fn host(&self, name: &str) -> &Host {
        self.hosts.iter().find(|h| h.name == name).unwrap_or_else(|| panic!("no host {name}"))
    }

    /// Runs `nft` inside `host`'s namespace.
    fn nft(&self, host: &str, script: &str) {
        sh(&["ip", "netns", "exec", &self.host(host).ns, "nft", script]);
    }

    /// The fault table on `host` (created empty if absent): chains `out` and `in` hooked on
    /// output and input.
    fn fault_table(&self, host: &str) {
        self.nft(
            host,
            "add table inet kvfault\n\
             add chain inet kvfault out { type filter hook output priority 0; policy accept; }\n\
             add chain inet kvfault in { type filter hook input priority 0; policy accept; }",
        );
    }

    /// Drops `percent` % (at random, nftables `numgen random`) of the packets `from` sends to
    /// `to`, on `from`'s interface.
    pub fn lose(&self, from: &str, to: &str, percent: u32) {
        self.fault_table(from);
        let dst = self.host(to).addr.clone();
        let odds = if percent >= 100 { String::new() } else { format!("numgen random mod 100 < {percent} ") };
        self.nft(from, &format!("add rule inet kvfault out oifname \"eth0\" ip daddr {dst} {odds}drop"));
    }

    /// One-way partition: nothing `from` sends reaches `to` (the other way still works).
    pub fn cut_one_way(&self, from: &str, to: &str) {
        self.lose(from, to, 100);
    }

    /// Full partition between `a` and `b`, on `a`'s interface: both directions dropped.
    pub fn partition(&self, a: &str, b: &str) {
        self.fault_table(a);
        let peer = self.host(b).addr.clone();
        self.nft(
            a,
            &format!(
                "add rule inet kvfault out oifname \"eth0\" ip daddr {peer} drop\n\
                 add rule inet kvfault in iifname \"eth0\" ip saddr {peer} drop"
            ),
        );
    }

    /// Removes every fault rule on `host`.
    pub fn heal(&self, host: &str) {
        quiet(&["ip", "netns", "exec", &self.host(host).ns, "nft", "delete table inet kvfault"]);
    }

    /// Limits what `host` sends to `mbit` Mbit/s (`tc` token bucket on its interface), so a KV
    /// read takes long enough to cut the wire under it.
    pub fn throttle(&self, host: &str, mbit: u32) {
        let ns = self.host(host).ns.clone();
        sh(&[
            "ip",
            "netns",
            "exec",
            &ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            "eth0",
            "root",
            "tbf",
            "rate",
            &format!("{mbit}mbit"),
            "burst",
            "32kb",
            "latency",
            "2s",
        ]);
    }

    /// Bytes `host` has sent on its interface.
    pub fn tx_bytes(&self, host: &str) -> u64 {
        let out = sh(&["ip", "-n", &self.host(host).ns, "-s", "-j", "link", "show", "dev", "eth0"]);
        let v: serde_json::Value = serde_json::from_str(&out).expect("ip -j");
        v[0]["stats64"]["tx"]["bytes"].as_u64().expect("tx bytes")
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        sweep(&self.prefix);
    }
}
