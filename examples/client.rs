//! A client for `examples/server.rs`: send a tensor, fetch it back, compute.
//!
//! ```text
//! cargo run --example client -- tcp://127.0.0.1:7070
//! ```
use tensorwire::{Client, Tensor};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args().nth(1).unwrap_or_else(|| "tcp://127.0.0.1:7070".into());
    let client = Client::connect(&url).await?;
    let x = Tensor::from_vec([2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])?.with_name("x");
    let summary = client.send(vec![x.clone()]).await?;
    println!("server: {}", summary.message);
    let back = client.fetch_one("x").await?;
    assert!(back.data_eq(&x));
    let y = client.compute("normalize", vec![x]).await?;
    println!("normalized: {:?}", y[0].as_slice::<f32>()?);
    println!("{:?}", client.statistics());
    Ok(())
}
