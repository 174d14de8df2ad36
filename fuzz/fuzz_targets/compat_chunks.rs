#![no_main]
//! Fuzzes `tensorwire::fuzzing::compat_chunks` (skytorch chunk reassembly
//! and the torch.save decoder behind it).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tensorwire::fuzzing::compat_chunks(data));
