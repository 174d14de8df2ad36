#![no_main]
//! Fuzzes `tensorwire::fuzzing::safetensors_load`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tensorwire::fuzzing::safetensors_load(data));
