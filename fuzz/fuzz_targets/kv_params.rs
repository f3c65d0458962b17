#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlease_fuzz::kv_params(data));
