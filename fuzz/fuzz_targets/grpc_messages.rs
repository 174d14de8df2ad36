#![no_main]
//! Fuzzes `tensorwire::fuzzing::grpc_messages`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tensorwire::fuzzing::grpc_messages(data));
