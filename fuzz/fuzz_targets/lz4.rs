#![no_main]
//! Fuzzes `tensorwire::fuzzing::lz4`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tensorwire::fuzzing::lz4(data));
