//! Compiles `proto/**/*.proto` with protox (no `protoc` binary needed) and
//! generates prost messages, plus tonic services when the `grpc` feature is on.
use std::{env, fs, path::PathBuf};

use prost::Message as _;

const PROTOS: &[&str] = &["tensorwire/v1/wire.proto", "tensorwire/v1/service.proto", "skytorch/torch/service.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for p in PROTOS {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(PROTOS, ["."])?;
    let out = PathBuf::from(env::var("OUT_DIR")?);
    // Kept for gRPC server reflection (grpcurl list/describe).
    fs::write(out.join("descriptor.bin"), fds.encode_to_vec())?;

    if env::var_os("CARGO_FEATURE_GRPC").is_some() {
        #[cfg(feature = "grpc")]
        tonic_prost_build::configure()
            .bytes(".")
            .build_client(true)
            .build_server(true)
            .build_transport(false)
            .compile_fds(fds)?;
    } else {
        prost_build::Config::new().bytes(["."]).compile_fds(fds)?;
    }
    Ok(())
}
