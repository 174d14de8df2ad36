#![no_main]
//! Fuzzes `tensorwire::fuzzing::zstd`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tensorwire::fuzzing::zstd(data));
