use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tensorwire::builtins::builtin_functions;
use tensorwire::*;
#[tokio::main]
async fn main() {
    let scheme = std::env::args().nth(1).unwrap_or("tcp".into());
    let url = if scheme == "tcp" { "tcp://127.0.0.1:0".to_string() } else { "unix:///tmp/zzprobe.sock".to_string() };
    let mut b = Server::builder();
    for f in builtin_functions() { b = b.function(f); }
    let server = b.build().start([url]).await.unwrap();
    let client = Client::connect(&server.url()).await.unwrap();
    let done = Arc::new(AtomicU64::new(0));
    let d2 = done.clone();
    tokio::spawn(async move { loop { tokio::time::sleep(std::time::Duration::from_millis(500)).await; eprintln!("done {}", d2.load(Ordering::Relaxed)); } });
    let t = Tensor::zeros(DType::UInt8, [4096]).unwrap();
    let mut tasks = vec![];
    for _ in 0..64 {
        let (c, t, done) = (client.clone(), t.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..400 { c.compute("identity", vec![t.clone()]).await.unwrap(); done.fetch_add(1, Ordering::Relaxed); }
        }));
    }
    for t in tasks { t.await.unwrap(); }
    eprintln!("all done {}", done.load(Ordering::Relaxed));
}
