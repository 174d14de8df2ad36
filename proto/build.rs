//! Compiles `proto/**/*.proto` with protox (no `protoc` binary needed) and
//! generates prost messages, plus tonic services when the `grpc` feature is on.
use std::{env, fs, path::PathBuf};

use prost::Message as _;

/// Large messages boxed inside `FrameHeader`, so a header stays small (it
/// is moved through channels and held in futures for every frame); chunks,
/// by far the most frequent frame, stay inline.
const BOXED: &[&str] = &[
    ".tensorwire.v1.FrameHeader.kind.hello",
    ".tensorwire.v1.FrameHeader.kind.welcome",
    ".tensorwire.v1.FrameHeader.kind.request",
    ".tensorwire.v1.FrameHeader.kind.reply",
    ".tensorwire.v1.Chunk.info",
];

const PROTOS: &[&str] = &[
    "tensorwire/v1/wire.proto",
    "tensorwire/v1/service.proto",
    "skytorch/torch/service.proto",
    "tensorwire/bench/v1/peer.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for p in PROTOS {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(PROTOS, ["."])?;
    let out = PathBuf::from(env::var("OUT_DIR")?);
    // Kept for gRPC server reflection (grpcurl list/describe): the services
    // a tensorwire server serves, not the bench's peer.
    let mut served = fds.clone();
    served.file.retain(|f| f.package() != "tensorwire.bench.v1");
    fs::write(out.join("descriptor.bin"), served.encode_to_vec())?;

    #[cfg(feature = "grpc")]
    {
        let mut b = tonic_prost_build::configure();
        for p in BOXED {
            b = b.boxed(p);
        }
        b.bytes(".").build_client(true).build_server(true).build_transport(false).compile_fds(fds)?;
    }
    #[cfg(not(feature = "grpc"))]
    {
        let mut c = prost_build::Config::new();
        for p in BOXED {
            c.boxed(p);
        }
        c.bytes(["."]).compile_fds(fds)?;
    }
    Ok(())
}
