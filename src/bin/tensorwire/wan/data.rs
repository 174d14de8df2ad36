//! The data kinds of `tensorwire bench --link`: what each row sends.
//!
//! `bf16-trained` and `fp32-trained` are the weights of a small MLP
//! (in → hidden → hidden → classes, ReLU) really trained here with SGD for
//! a few hundred steps on a synthetic classification task (Gaussian class
//! centres seen through a fixed random projection), from Kaiming-uniform
//! initialisation; `bf16` is the trained fp32 weights rounded to nearest
//! even, as mixed-precision checkpoints store them. The delta row sends the
//! checkpoint after `delta_steps` more steps against the previous one.
//! `relu-activations` is the first hidden layer's output on a batch of
//! inputs (≈50% exact zeros), `int8-weights` the trained weights quantised
//! per tensor to int8 (symmetric, scale = max|w| / 127), `random` uniform
//! random bytes.

use std::fmt;

use tensorwire::{DType, Tensor};

/// One kind of data a row sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataKind {
    /// Uniform random bytes (incompressible).
    Random,
    /// The trained MLP's weights in bf16.
    Bf16Trained,
    /// The trained MLP's weights in fp32.
    Fp32Trained,
    /// ReLU outputs of the trained MLP's first layer (fp32, ≈50% zeros).
    ReluActivations,
    /// The trained weights quantised to int8.
    Int8Weights,
}

impl DataKind {
    /// Every kind, in table order.
    pub const ALL: [DataKind; 5] = [
        DataKind::Random,
        DataKind::Bf16Trained,
        DataKind::Fp32Trained,
        DataKind::ReluActivations,
        DataKind::Int8Weights,
    ];

    /// The name in output and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DataKind::Random => "random",
            DataKind::Bf16Trained => "bf16-trained",
            DataKind::Fp32Trained => "fp32-trained",
            DataKind::ReluActivations => "relu-activations",
            DataKind::Int8Weights => "int8-weights",
        }
    }
}

impl fmt::Display for DataKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DataKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        DataKind::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            format!("unknown data kind {s:?} (random, bf16-trained, fp32-trained, relu-activations, int8-weights)")
        })
    }
}

/// xorshift64*: fast, reproducible, good enough for weights and inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        // Box–Muller.
        let (u, v) = (self.uniform().max(1e-7), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
}

/// One dense layer, `w` row-major `[out][in]`.
struct Layer {
    w: Vec<f32>,
    b: Vec<f32>,
    n_in: usize,
    n_out: usize,
}

impl Layer {
    fn new(n_in: usize, n_out: usize, rng: &mut Rng) -> Self {
        let bound = (6.0 / n_in as f32).sqrt(); // Kaiming uniform for ReLU
        Self {
            w: (0..n_in * n_out).map(|_| (rng.uniform() * 2.0 - 1.0) * bound).collect(),
            b: vec![0.0; n_out],
            n_in,
            n_out,
        }
    }

    fn forward(&self, x: &[f32], batch: usize, relu: bool) -> Vec<f32> {
        let mut y = vec![0.0f32; batch * self.n_out];
        for bi in 0..batch {
            let xb = &x[bi * self.n_in..(bi + 1) * self.n_in];
            for o in 0..self.n_out {
                let v = dot(&self.w[o * self.n_in..(o + 1) * self.n_in], xb) + self.b[o];
                y[bi * self.n_out + o] = if relu { v.max(0.0) } else { v };
            }
        }
        y
    }

    /// Given dL/dy, returns dL/dx and applies the SGD step.
    fn backward(&mut self, x: &[f32], gy: &[f32], batch: usize, lr: f32) -> Vec<f32> {
        let mut gx = vec![0.0f32; batch * self.n_in];
        for o in 0..self.n_out {
            let row = o * self.n_in..(o + 1) * self.n_in;
            for bi in 0..batch {
                let g = gy[bi * self.n_out + o];
                if g != 0.0 {
                    axpy(g, &self.w[row.clone()], &mut gx[bi * self.n_in..(bi + 1) * self.n_in]);
                }
            }
            let mut gsum = 0.0;
            for bi in 0..batch {
                let g = gy[bi * self.n_out + o];
                if g != 0.0 {
                    axpy(-lr * g, &x[bi * self.n_in..(bi + 1) * self.n_in], &mut self.w[row.clone()]);
                    gsum += g;
                }
            }
            self.b[o] -= lr * gsum;
        }
        gx
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

fn axpy(k: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += k * xi;
    }
}

/// A small MLP and its synthetic task.
pub struct Mlp {
    layers: Vec<Layer>,
    rng: Rng,
    centres: Vec<f32>,
    classes: usize,
    n_in: usize,
    /// Steps trained so far.
    pub steps: usize,
}

const BATCH: usize = 8;

impl Mlp {
    /// `n_in → hidden → hidden → classes`, Kaiming-uniform initialised.
    pub fn new(n_in: usize, hidden: usize, classes: usize, seed: u64) -> Self {
        let mut rng = Rng(seed | 1);
        let layers = vec![
            Layer::new(n_in, hidden, &mut rng),
            Layer::new(hidden, hidden, &mut rng),
            Layer::new(hidden, classes, &mut rng),
        ];
        let centres = (0..classes * n_in).map(|_| rng.normal()).collect();
        Self { layers, rng, centres, classes, n_in, steps: 0 }
    }

    fn batch(&mut self, n: usize) -> (Vec<f32>, Vec<usize>) {
        let mut x = Vec::with_capacity(n * self.n_in);
        let mut y = Vec::with_capacity(n);
        for _ in 0..n {
            let c = (self.rng.next() % self.classes as u64) as usize;
            for i in 0..self.n_in {
                x.push(self.centres[c * self.n_in + i] + 1.5 * self.rng.normal());
            }
            y.push(c);
        }
        (x, y)
    }

    /// Trains `steps` SGD steps (batch 8, lr 0.01, softmax cross-entropy);
    /// returns the mean loss over these steps.
    pub fn train(&mut self, steps: usize) -> f32 {
        let lr = 0.01;
        let mut total = 0.0;
        for _ in 0..steps {
            let (x, y) = self.batch(BATCH);
            let h1 = self.layers[0].forward(&x, BATCH, true);
            let h2 = self.layers[1].forward(&h1, BATCH, true);
            let logits = self.layers[2].forward(&h2, BATCH, false);
            let mut g = vec![0.0f32; logits.len()];
            let mut loss = 0.0;
            for bi in 0..BATCH {
                let l = &logits[bi * self.classes..(bi + 1) * self.classes];
                let m = l.iter().copied().fold(f32::MIN, f32::max);
                let z: f32 = l.iter().map(|v| (v - m).exp()).sum();
                for (c, v) in l.iter().enumerate() {
                    let p = (v - m).exp() / z;
                    g[bi * self.classes + c] = (p - f32::from(u8::from(c == y[bi]))) / BATCH as f32;
                    if c == y[bi] {
                        loss -= p.max(1e-12).ln() / BATCH as f32;
                    }
                }
            }
            let mut g2 = self.layers[2].backward(&h2, &g, BATCH, lr);
            relu_grad(&mut g2, &h2);
            let mut g1 = self.layers[1].backward(&h1, &g2, BATCH, lr);
            relu_grad(&mut g1, &h1);
            self.layers[0].backward(&x, &g1, BATCH, lr);
            self.steps += 1;
            total += loss;
        }
        total / steps.max(1) as f32
    }

    /// All weights and biases, concatenated, as one fp32 tensor.
    pub fn weights_f32(&self) -> Tensor {
        let v: Vec<f32> = self.layers.iter().flat_map(|l| l.w.iter().chain(&l.b).copied()).collect();
        Tensor::from_vec([v.len()], v).expect("fp32 tensor")
    }

    /// ReLU activations of the first layer on `rows` inputs.
    pub fn activations(&mut self, rows: usize) -> Tensor {
        let (x, _) = self.batch(rows);
        let h = self.layers[0].forward(&x, rows, true);
        Tensor::from_vec([rows, self.layers[0].n_out], h).expect("fp32 tensor")
    }
}

fn relu_grad(g: &mut [f32], h: &[f32]) {
    for (gi, hi) in g.iter_mut().zip(h) {
        if *hi <= 0.0 {
            *gi = 0.0;
        }
    }
}

/// fp32 → bf16, rounding to nearest even (NaN kept a NaN).
pub fn to_bf16(t: &Tensor) -> Tensor {
    let v: Vec<u16> = t
        .to_vec::<f32>()
        .expect("fp32")
        .iter()
        .map(|x| {
            let b = x.to_bits();
            if x.is_nan() {
                return ((b >> 16) | 0x40) as u16;
            }
            ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
        })
        .collect();
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    Tensor::new(DType::BFloat16, [v.len()], bytes).expect("bf16 tensor")
}

/// Symmetric per-tensor int8 quantisation.
pub fn to_int8(t: &Tensor) -> Tensor {
    let v = t.to_vec::<f32>().expect("fp32");
    let scale = v.iter().fold(0.0f32, |m, x| m.max(x.abs())) / 127.0;
    let q: Vec<i8> = v.iter().map(|x| (x / scale).round().clamp(-127.0, 127.0) as i8).collect();
    Tensor::from_vec([q.len()], q).expect("int8 tensor")
}

/// `n` uniform random bytes.
pub fn random_bytes(n: usize, seed: u64) -> Tensor {
    let mut r = Rng(seed | 1);
    let v: Vec<u8> = (0..n.div_ceil(8)).flat_map(|_| r.next().to_le_bytes()).take(n).collect();
    Tensor::from_vec([n], v).expect("uint8 tensor")
}

/// An estimate of the best ratio any lossless coder of the XOR delta
/// `prev ^ next` can reach, element by element: the entropy of where each
/// element's highest changed bit lies, plus every bit below it, taken as
/// incompressible (the low mantissa bits SGD changes are noise-like). Dense
/// training moves every fp32 weight by a relative ~1e-4…1e-3, which leaves
/// 10–14 low bits changed per weight, so fp32 deltas cannot shrink ~10×;
/// bf16 keeps only 7 mantissa bits and most of its elements do not change.
/// Returns `None` for dtypes other than 2- and 4-byte floats.
pub fn xor_delta_limit(prev: &Tensor, next: &Tensor) -> Option<f64> {
    let size = match prev.dtype() {
        DType::Float32 => 4,
        DType::BFloat16 | DType::Float16 => 2,
        _ => return None,
    };
    let (a, b) = (prev.as_bytes().ok()?, next.as_bytes().ok()?);
    if a.len() != b.len() || a.is_empty() {
        return None;
    }
    // counts[k]: elements whose highest changed bit is bit k-1 (k = 0: unchanged).
    let mut counts = [0u64; 33];
    for (x, y) in a.chunks_exact(size).zip(b.chunks_exact(size)) {
        let mut w = [0u8; 4];
        for i in 0..size {
            w[i] = x[i] ^ y[i];
        }
        counts[(32 - u32::from_le_bytes(w).leading_zeros()) as usize] += 1;
    }
    let n = (a.len() / size) as f64;
    let bits: f64 = counts
        .iter()
        .enumerate()
        .filter(|(_, c)| **c > 0)
        .map(|(k, &c)| {
            let p = c as f64 / n;
            p * (-p.log2() + k.saturating_sub(1) as f64)
        })
        .sum();
    Some((size * 8) as f64 / bits.max(1e-9))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_lowers_the_loss_and_moves_the_weights() {
        let mut m = Mlp::new(32, 64, 4, 1);
        let w0 = m.weights_f32();
        let first = m.train(5);
        let last = m.train(400);
        assert!(last < first, "loss {first} -> {last}");
        let w1 = m.weights_f32();
        assert!(!w0.data_eq(&w1));
        let bf = to_bf16(&w1);
        assert_eq!(bf.nbytes() * 2, w1.nbytes());
        let a = m.activations(16);
        let zeros = a.to_vec::<f32>().unwrap().iter().filter(|v| **v == 0.0).count();
        assert!(zeros > 0 && zeros < a.numel(), "{zeros} zeros");
        assert_eq!(to_int8(&w1).dtype(), DType::Int8);
        assert_eq!(random_bytes(100, 3).nbytes(), 100);
    }

    #[test]
    fn the_xor_delta_limit_follows_the_changed_bits() {
        let t = |v: Vec<f32>| Tensor::from_vec([v.len()], v).unwrap();
        let base: Vec<f32> = (0..4096).map(|i| 1.0 + i as f32 / 4096.0).collect();
        // Every other element has its lowest bit flipped: one bit (changed or not) per element.
        let flipped: Vec<f32> =
            base.iter().enumerate().map(|(i, x)| f32::from_bits(x.to_bits() ^ (i as u32 & 1))).collect();
        let limit = xor_delta_limit(&t(base.clone()), &t(flipped)).unwrap();
        assert!((limit - 32.0).abs() < 1e-6, "{limit}");
        // The low 16 bits of every element change: the 15 below the highest count, as noise.
        let noisy: Vec<f32> = base.iter().map(|x| f32::from_bits(x.to_bits() ^ 0xffff)).collect();
        let limit = xor_delta_limit(&t(base.clone()), &t(noisy)).unwrap();
        assert!((limit - 32.0 / 15.0).abs() < 1e-6, "{limit}");
        assert_eq!(xor_delta_limit(&to_int8(&t(base.clone())), &to_int8(&t(base))), None);
    }
}
