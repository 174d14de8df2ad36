//! Sends the same tensor many times under one name to a storing server
//! (`tensorwire serve`), which replaces it each time: the steady-traffic
//! case of the receive pool. Prints the throughput of each tenth of the
//! run; read the server's peak RSS (`VmHWM` in `/proc/PID/status`) after.
//!
//! ```text
//! tensorwire serve --listen tcp://127.0.0.1:7070 &
//! cargo run --release --example recv_rss -- tcp://127.0.0.1:7070 100 268435456
//! ```
use std::time::Instant;

use tensorwire::builtins::random_tensor;
use tensorwire::{Client, DType};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or_else(|| "tcp://127.0.0.1:7070".into());
    let count: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(100);
    let size: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(256 << 20);
    let client = Client::connect(&url).await?;
    let t = random_tensor(DType::UInt8, &[size], 1)?.with_name("x");
    let tenth = (count / 10).max(1);
    let mut start = Instant::now();
    for i in 1..=count {
        client.send(vec![t.clone()]).await?;
        if i % tenth == 0 {
            let gib = (tenth * size) as f64 / f64::from(1u32 << 30);
            println!("{i:>5} tensors: {:.2} GiB/s over the last {tenth}", gib / start.elapsed().as_secs_f64());
            start = Instant::now();
        }
    }
    let info = client.service_info().await?;
    println!(
        "server: memory used {} B, receive pool hits {} misses {} idle {} B",
        info.memory_used, info.recv_pool_hits, info.recv_pool_misses, info.recv_pool_idle_bytes
    );
    Ok(())
}
