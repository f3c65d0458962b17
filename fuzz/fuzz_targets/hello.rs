#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlease_fuzz::hello(data));
