#![no_main]
//! Fuzzes `tensorwire::fuzzing::jsonrpc` (the JSON-RPC envelope and the
//! params conversion: base64 tensors, safetensors, scalars).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tensorwire::fuzzing::jsonrpc(data));
