//! vLLM's command-line habits, before clap sees the arguments (issue 9): `-tp N` is
//! `--tp-size N`; flags of `vllm serve` that mean nothing for kvlease's synthetic engine are
//! accepted with one warning each (never silently); parallelism kvlease does not have
//! (`-pp`/`--pipeline-parallel-size`, `-dp`/`--data-parallel-size` above 1) is refused.
//! The README's vLLM section lists every flag here.

use crate::InvalidConfig;

/// `vllm serve` flags taking a value that change nothing here: accepted, one warning each.
pub const IGNORED_WITH_VALUE: &[(&str, &str)] = &[
    ("--gpu-memory-utilization", "the KV pool is --num-gpu-blocks"),
    ("--dtype", "the synthetic model's KV element size is --dtype-bytes"),
    ("--kv-cache-dtype", "the KV element size is --dtype-bytes"),
    ("--quantization", "the synthetic model has no weights"),
    ("--max-num-batched-tokens", "the synthetic scheduler prefills every admitted prompt in one step"),
    ("--swap-space", "there is no CPU swap"),
    ("--cpu-offload-gb", "there is no CPU offload"),
    ("--seed", "requests carry their own seed; without one each draws a random one"),
    ("--tokenizer", "the synthetic model has its own tokenizer (its words, else UTF-8 bytes)"),
    ("--tokenizer-mode", "the synthetic model has its own tokenizer (its words, else UTF-8 bytes)"),
    ("--revision", "the synthetic model has no weights"),
    ("--download-dir", "nothing is downloaded"),
    ("--load-format", "the synthetic model has no weights"),
    ("--uvicorn-log-level", "use --log-level"),
    ("--distributed-executor-backend", "ranks are in-process"),
    ("--block-allocator", "the block pool is kvlease's"),
];

/// `vllm serve` switches that change nothing here: accepted, one warning each.
pub const IGNORED_SWITCHES: &[(&str, &str)] = &[
    ("--trust-remote-code", "no model code is loaded"),
    ("--enforce-eager", "there are no CUDA graphs"),
    ("--disable-log-requests", "requests are logged at debug level only"),
    ("--enable-log-requests", "requests are logged at debug level only"),
    ("--disable-log-stats", "statistics are on /metrics"),
    ("--enable-prefix-caching", "there is no prefix cache"),
    ("--no-enable-prefix-caching", "there is no prefix cache"),
    ("--enable-chunked-prefill", "prefill is not chunked"),
    ("--no-enable-chunked-prefill", "prefill is not chunked"),
    ("--disable-custom-all-reduce", "there is no all-reduce"),
];

/// Parallelism kvlease does not have: only 1 is accepted.
const MUST_BE_ONE: &[&str] = &["--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp"];

/// Rewrites `serve`'s vLLM spellings; returns the arguments for clap and the warnings to log.
pub fn rewrite(args: Vec<String>) -> Result<(Vec<String>, Vec<String>), InvalidConfig> {
    if args.get(1).map(String::as_str) != Some("serve") {
        return Ok((args, Vec::new()));
    }
    let mut out = Vec::with_capacity(args.len());
    let mut notes = Vec::new();
    let mut it = args.into_iter();
    let mut rest_positional = false;
    while let Some(a) = it.next() {
        if rest_positional || a == "--" {
            rest_positional = true;
            out.push(a);
            continue;
        }
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with('-') => (f.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        if flag == "-tp" {
            out.push("--tp-size".into());
            out.extend(inline);
            continue;
        }
        if let Some((_, why)) = IGNORED_WITH_VALUE.iter().find(|(f, _)| *f == flag) {
            let value = match inline {
                Some(v) => v,
                None => it.next().ok_or_else(|| InvalidConfig(format!("{flag} needs a value")))?,
            };
            notes.push(format!("vLLM flag {flag} {value} accepted and ignored: {why}"));
            continue;
        }
        if let Some((_, why)) = IGNORED_SWITCHES.iter().find(|(f, _)| *f == flag) {
            notes.push(format!("vLLM flag {flag} accepted and ignored: {why}"));
            continue;
        }
        if MUST_BE_ONE.contains(&flag.as_str()) {
            let value = match inline {
                Some(v) => v,
                None => it.next().ok_or_else(|| InvalidConfig(format!("{flag} needs a value")))?,
            };
            if value.trim() != "1" {
                return Err(InvalidConfig(format!(
                    "{flag} {value}: kvlease has tensor parallelism only (--tp-size); pipeline and data parallelism must be 1"
                )));
            }
            continue;
        }
        out.push(a);
    }
    Ok((out, notes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn vllm_spellings_become_kvlease_flags_with_one_warning_each() {
        let (out, notes) =
            rewrite(args("kvlease serve m -tp 2 --dtype bfloat16 --gpu-memory-utilization=0.9 --enforce-eager -pp 1 --port 1")).unwrap();
        assert_eq!(out, args("kvlease serve m --tp-size 2 --port 1"));
        assert_eq!(notes.len(), 3, "{notes:?}");
        assert!(notes[0].contains("--dtype bfloat16"));
        assert!(rewrite(args("kvlease serve -pp 2")).unwrap_err().0.contains("pipeline"));
        assert!(rewrite(args("kvlease serve --dtype")).unwrap_err().0.contains("needs a value"));
        let proxy = args("kvlease proxy --dtype x");
        assert_eq!(rewrite(proxy.clone()).unwrap().0, proxy, "only serve is rewritten");
    }
}
