#![no_main]
//! Fuzzes `tensorwire::fuzzing::delta`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tensorwire::fuzzing::delta(data));
