#![no_main]
//! Fuzzes `tensorwire::fuzzing::torch_load`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tensorwire::fuzzing::torch_load(data));
