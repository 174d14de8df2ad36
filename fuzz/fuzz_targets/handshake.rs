#![no_main]
//! Fuzzes `tensorwire::fuzzing::handshake`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tensorwire::fuzzing::handshake(data));
