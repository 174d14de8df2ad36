//! A tensor server: stores what clients send, returns it by name, and runs a
//! compute function. Run it, then `cargo run --example client`.
//!
//! ```text
//! cargo run --example server -- tcp://127.0.0.1:7070
//! ```
use tensorwire::StoreService;
use tensorwire::{Server, Status, Tensor};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args().nth(1).unwrap_or_else(|| "tcp://127.0.0.1:7070".into());
    let server = Server::builder()
        .service(StoreService::default())
        .compute("normalize", |inputs| {
            let x = inputs.first().ok_or_else(|| Status::invalid_argument("normalize takes one tensor"))?;
            let v = x.to_vec::<f32>()?;
            let norm = v.iter().map(|a| a * a).sum::<f32>().sqrt().max(f32::EPSILON);
            Ok(vec![Tensor::from_vec(x.shape(), v.iter().map(|a| a / norm).collect::<Vec<_>>())?])
        })
        .build()
        .start([url])
        .await?;
    println!("serving on {}", server.url());
    tokio::signal::ctrl_c().await?;
    server.shutdown().await;
    Ok(())
}
