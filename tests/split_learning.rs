//! The split-learning example trains across a real connection and its loss falls.

#[path = "../examples/split_learning.rs"]
#[allow(dead_code)]
mod example;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loss_falls_with_the_middle_layer_on_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let server = example::serve_middle(&format!("unix://{}", dir.path().join("sl.sock").display())).await.unwrap();
    let client = tensorwire::Client::connect(&server.url()).await.unwrap();
    let (start, end) = example::train(&client, 300).await.unwrap();
    assert!(end < start * 0.5, "loss {start} -> {end}");
    // Each step is one forward and one backward call.
    assert_eq!(client.statistics().requests, 600);
}
