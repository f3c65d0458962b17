//! Bytes per lease id in a heartbeat (SPEC §9), next to vLLM's text format:
//! `cargo run -p kvlease-core --example wire_size`.

use kvlease_core::wire::encode_heartbeat;

fn main() {
    for k in [100usize, 1_000] {
        for (what, ids) in [
            ("granted in a row", (5_000_000..5_000_000 + k as u64).collect::<Vec<u64>>()),
            ("every 3rd id", (0..k as u64).map(|i| 5_000_000 + 3 * i).collect()),
        ] {
            let mut buf = Vec::new();
            encode_heartbeat(123_456, &ids, &mut buf);
            println!("k = {k:>5}, {what:<17}: {:>5} bytes, {:.2} bytes/lease", buf.len(), buf.len() as f64 / k as f64);
        }
        // vLLM: "HB:" + ",".join(request_ids), ids like "cmpl-<32 hex>-0".
        let text = format!("HB:{}", (0..k).map(|i| format!("cmpl-{:032x}-0", i)).collect::<Vec<_>>().join(","));
        println!("k = {k:>5}, vLLM text        : {:>5} bytes, {:.2} bytes/lease", text.len(), text.len() as f64 / k as f64);
    }
}
