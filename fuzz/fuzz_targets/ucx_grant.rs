#![no_main]
//! Fuzzes `tensorwire::fuzzing::ucx_grant`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tensorwire::fuzzing::ucx_grant(data));
