#![no_main]
//! Fuzzes `tensorwire::fuzzing::mux_frames`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tensorwire::fuzzing::mux_frames(data));
