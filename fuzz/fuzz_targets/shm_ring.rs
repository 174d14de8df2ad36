#![no_main]
//! Fuzzes `tensorwire::fuzzing::shm_ring`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tensorwire::fuzzing::shm_ring(data));
