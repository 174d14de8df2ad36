#![no_main]
//! Fuzzes `tensorwire::fuzzing::planes`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tensorwire::fuzzing::planes(data));
