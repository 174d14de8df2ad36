#![no_main]
//! Fuzzes `tensorwire::fuzzing::reassembly`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tensorwire::fuzzing::reassembly(data));
