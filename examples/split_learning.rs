//! Split learning (the split-learning seed): a 3-layer MLP cut in two places.
//! The client holds the first and last layers and the data; the server holds
//! the middle layer. Forward activations go to the server, gradients come
//! back; the server keeps each client's activations between its `forward`
//! and `backward` calls and updates its own weights. The loss falls.
//!
//! ```text
//! cargo run --release --example split_learning            # server and client in one process
//! ```
//! (To split across machines, run `serve_middle` on one and point `train` at it.)

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tensorwire::{Args, Client, Function, Output, Server, Status, Tensor};

const IN: usize = 4;
const H1: usize = 16;
const H2: usize = 16;
const OUT: usize = 1;
const BATCH: usize = 32;
const LR: f32 = 0.05;

/// A dense layer `y = W x + b` with plain SGD.
#[derive(Clone)]
struct Dense {
    w: Vec<f32>, // out × in, row-major
    b: Vec<f32>,
    n_in: usize,
    n_out: usize,
}

impl Dense {
    fn new(n_in: usize, n_out: usize, seed: &mut u64) -> Self {
        let scale = (2.0 / n_in as f32).sqrt();
        let w = (0..n_in * n_out).map(|_| scale * (rand01(seed) * 2.0 - 1.0)).collect();
        Self { w, b: vec![0.0; n_out], n_in, n_out }
    }

    /// `x`: batch × in → batch × out.
    fn forward(&self, x: &[f32]) -> Vec<f32> {
        let n = x.len() / self.n_in;
        let mut y = vec![0.0; n * self.n_out];
        for r in 0..n {
            for o in 0..self.n_out {
                let row = &self.w[o * self.n_in..(o + 1) * self.n_in];
                y[r * self.n_out + o] =
                    self.b[o] + row.iter().zip(&x[r * self.n_in..(r + 1) * self.n_in]).map(|(a, b)| a * b).sum::<f32>();
            }
        }
        y
    }

    /// Given the input and dL/dy, updates the weights and returns dL/dx.
    fn backward(&mut self, x: &[f32], dy: &[f32]) -> Vec<f32> {
        let n = x.len() / self.n_in;
        let mut dx = vec![0.0; n * self.n_in];
        let mut dw = vec![0.0; self.w.len()];
        let mut db = vec![0.0; self.n_out];
        for r in 0..n {
            for o in 0..self.n_out {
                let g = dy[r * self.n_out + o];
                db[o] += g;
                for i in 0..self.n_in {
                    dw[o * self.n_in + i] += g * x[r * self.n_in + i];
                    dx[r * self.n_in + i] += g * self.w[o * self.n_in + i];
                }
            }
        }
        for (w, g) in self.w.iter_mut().zip(&dw) {
            *w -= LR * g / n as f32;
        }
        for (b, g) in self.b.iter_mut().zip(&db) {
            *b -= LR * g / n as f32;
        }
        dx
    }
}

fn relu(v: &mut [f32]) {
    v.iter_mut().for_each(|x| *x = x.max(0.0));
}

/// dL/dz for z where y = relu(z), given dL/dy and y.
fn relu_grad(dy: &mut [f32], y: &[f32]) {
    for (g, &a) in dy.iter_mut().zip(y) {
        if a <= 0.0 {
            *g = 0.0;
        }
    }
}

fn rand01(s: &mut u64) -> f32 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    (*s >> 40) as f32 / (1u64 << 24) as f32
}

/// What the server keeps per client between forward and backward.
struct Saved {
    input: Vec<f32>,
    output: Vec<f32>,
}

/// The server's half: the middle layer and each client's saved activations.
pub fn middle_functions() -> Vec<Function> {
    let layer = Arc::new(Mutex::new(Dense::new(H1, H2, &mut 0x5eed_u64)));
    let saved: Arc<Mutex<HashMap<String, Saved>>> = Arc::default();
    let (l1, s1) = (layer.clone(), saved.clone());
    let forward = Function::new("middle.forward", move |c| {
        let client = c
            .args
            .get("client")
            .and_then(|v| v.as_str())
            .ok_or_else(|| Status::invalid_argument("needs client=ID"))?
            .to_string();
        let h1 = c.inputs.first().ok_or_else(|| Status::invalid_argument("needs the activations"))?.to_vec::<f32>()?;
        let mut h2 = l1.lock().unwrap().forward(&h1);
        relu(&mut h2);
        let n = h2.len() / H2;
        s1.lock().unwrap().insert(client, Saved { input: h1, output: h2.clone() });
        Ok(Tensor::from_vec([n, H2], h2)?.into())
    });
    let backward = Function::new("middle.backward", move |c| {
        let client =
            c.args.get("client").and_then(|v| v.as_str()).ok_or_else(|| Status::invalid_argument("needs client=ID"))?;
        let mut g = c.inputs.first().ok_or_else(|| Status::invalid_argument("needs the gradient"))?.to_vec::<f32>()?;
        let s = saved
            .lock()
            .unwrap()
            .remove(client)
            .ok_or_else(|| Status::failed_precondition(format!("no forward pass saved for {client}")))?;
        relu_grad(&mut g, &s.output);
        let dx = layer.lock().unwrap().backward(&s.input, &g);
        let n = dx.len() / H1;
        Ok(Output::tensors(vec![Tensor::from_vec([n, H1], dx)?]))
    });
    vec![forward, backward]
}

/// The client's half: trains for `steps` on a synthetic regression task
/// (targets from a fixed random "teacher" function); returns the mean loss
/// of the first and the last 20 steps.
pub async fn train(client: &Client, steps: usize) -> Result<(f32, f32), Box<dyn std::error::Error>> {
    let mut seed = 42u64;
    let mut first = Dense::new(IN, H1, &mut seed);
    let mut last = Dense::new(H2, OUT, &mut seed);
    let id = Args::new().with("client", format!("trainer-{}", std::process::id()));
    let mut losses = Vec::with_capacity(steps);
    for step in 0..steps {
        let x: Vec<f32> = (0..BATCH * IN).map(|_| rand01(&mut seed) * 2.0 - 1.0).collect();
        let y: Vec<f32> = x.chunks(IN).map(|r| (r[0] * 2.0).sin() + 0.5 * r[1] * r[2] - r[3]).collect();
        // Forward: layer 1 here, layer 2 on the server, layer 3 here.
        let mut h1 = first.forward(&x);
        relu(&mut h1);
        let h2 = client.call("middle.forward", vec![Tensor::from_vec([BATCH, H1], h1.clone())?], id.clone()).await?;
        let h2 = h2.tensors[0].to_vec::<f32>()?;
        let out = last.forward(&h2);
        let loss = out.iter().zip(&y).map(|(o, t)| (o - t) * (o - t)).sum::<f32>() / BATCH as f32;
        losses.push(loss);
        // Backward: layer 3 here, layer 2 on the server, layer 1 here.
        let d_out: Vec<f32> = out.iter().zip(&y).map(|(o, t)| 2.0 * (o - t)).collect();
        let d_h2 = last.backward(&h2, &d_out);
        let d_h1 = client.call("middle.backward", vec![Tensor::from_vec([BATCH, H2], d_h2)?], id.clone()).await?;
        let mut d_h1 = d_h1.tensors[0].to_vec::<f32>()?;
        relu_grad(&mut d_h1, &h1);
        first.backward(&x, &d_h1);
        if step % 100 == 0 {
            println!("step {step:4}  loss {loss:.4}");
        }
    }
    let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
    Ok((mean(&losses[..20]), mean(&losses[steps - 20..])))
}

/// Serves the middle layer on `url` until stopped.
pub async fn serve_middle(url: &str) -> Result<tensorwire::RunningServer, tensorwire::ServeError> {
    let mut b = Server::builder();
    for f in middle_functions() {
        b = b.function(f);
    }
    b.build().start([url]).await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args().nth(1).unwrap_or_else(|| "tcp://127.0.0.1:0".into());
    let server = serve_middle(&url).await?;
    let client = Client::connect(&server.url()).await?;
    let (start, end) = train(&client, 400).await?;
    println!("loss: first 20 steps {start:.4}, last 20 steps {end:.4}");
    let s = client.statistics();
    println!("{} calls, p50 {:.3} ms, server time {:.3} ms/call", s.requests, s.latency_p50_ms, s.avg_server_time_ms);
    if end >= start * 0.5 {
        return Err(format!("the loss did not fall enough: {start} -> {end}").into());
    }
    server.shutdown().await;
    Ok(())
}
