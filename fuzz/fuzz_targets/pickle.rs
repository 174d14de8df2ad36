#![no_main]
//! Fuzzes `tensorwire::fuzzing::pickle`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tensorwire::fuzzing::pickle(data));
