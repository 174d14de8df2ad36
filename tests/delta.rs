//! Delta transfers over real sockets: `Client::send_delta` and
//! `Client::fetch_delta` against the store, bit-exact (CRC-32C both ends),
//! with wrong and missing bases failing with the base hash named.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use common::*;
use tensorwire::codecs::delta::ContentHash;
use tensorwire::{Client, ClientConfig, Code, Compression, CompressionMode, DType, Encoding, ServerConfig, Tensor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A bf16 "checkpoint" and the next one: 2% of the weights nudged.
fn checkpoints(n: usize) -> (Tensor, Tensor) {
    // Random bits (incompressible as a whole tensor), then one element in 50
    // changed by its lowest bit, as a training step changes weights.
    let old = tensorwire::builtins::random_tensor(DType::BFloat16, &[n], 7).unwrap();
    let mut bytes = old.to_contiguous_bytes().unwrap().to_vec();
    for e in bytes.chunks_mut(2).step_by(50) {
        e[0] ^= 1;
    }
    let old = old.with_name("w");
    let new = Tensor::new(DType::BFloat16, [n], bytes).unwrap().with_name("w");
    (old, new)
}

async fn client(url: &str) -> Client {
    let encoding =
        Encoding { compression: CompressionMode::Fixed(Compression::Zstd(3)), shuffle: true, ..Encoding::default() };
    Client::connect_with(url, ClientConfig { encoding, ..ClientConfig::default() }).await.unwrap()
}

/// A TCP relay in front of `upstream` counting the bytes the client sends.
async fn counting_relay(upstream: std::net::SocketAddr) -> (String, Arc<AtomicU64>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    // ?shm=0: the bytes must cross the relay, not a shared-memory upgrade.
    let url = format!("tcp://{}?shm=0", l.local_addr().unwrap());
    let up_bytes = Arc::new(AtomicU64::new(0));
    let counter = up_bytes.clone();
    tokio::spawn(async move {
        while let Ok((c, _)) = l.accept().await {
            let s = tokio::net::TcpStream::connect(upstream).await.unwrap();
            let ((mut cr, mut cw), (mut sr, mut sw)) = (c.into_split(), s.into_split());
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1 << 16];
                while let Ok(n) = cr.read(&mut buf).await {
                    if n == 0 || sw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    counter.fetch_add(n as u64, Ordering::Relaxed);
                }
            });
            tokio::spawn(async move { tokio::io::copy(&mut sr, &mut cw).await });
        }
    });
    (url, up_bytes)
}

async fn send_and_fetch_deltas(scheme: &str) {
    let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
    let (url, sent) = match scheme {
        "tcp" => {
            let ep = tensorwire_transports::Endpoint::parse(&server.url()).unwrap();
            let addr = ep.authority().parse().unwrap();
            let (u, s) = counting_relay(addr).await;
            (u, Some(s))
        }
        _ => (server.url(), None),
    };
    let c = client(&url).await;
    assert!(c.supports_delta().await.unwrap());
    let (v1, v2) = checkpoints(1 << 20);
    let wire = || sent.as_ref().map_or(0, |s| s.load(Ordering::Relaxed));
    let w0 = wire();
    c.send([v1.clone()]).await.unwrap();
    let whole = wire() - w0;

    // Send v2 as a delta against v1: the store holds v2, bit-exact, and
    // over TCP (bytes counted on the wire) it took 10x fewer bytes.
    c.send_delta(&v2, &v1).await.unwrap();
    let delta_bytes = wire() - whole - w0;
    assert!(delta_bytes * 10 <= whole, "delta {delta_bytes} bytes vs whole {whole}");
    let got = c.fetch_one("w").await.unwrap();
    assert_same(&got, &v2);
    assert_eq!(got.crc32c().unwrap(), v2.crc32c().unwrap());

    // Fetch as a delta from v1 (the base the store kept) and from v2 itself.
    for base in [&v1, &v2] {
        let got = c.fetch_delta("w", base).await.unwrap();
        assert_same(&got, &v2);
        assert_eq!(got.crc32c().unwrap(), v2.crc32c().unwrap());
        assert!(got.metadata().is_empty(), "{:?}", got.metadata());
    }

    // A wrong base: the server holds v2, not v1, as the current version.
    let (_, v3) = checkpoints(1 << 20);
    let e = c.send_delta(&v3, &v1).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    let h1 = ContentHash::of(&v1).unwrap().to_string();
    assert!(e.to_string().contains(&h1), "{e}");
    // Nothing changed.
    assert_same(&c.fetch_one("w").await.unwrap(), &v2);

    // A base the server does not have, and a name it does not have.
    let other = Tensor::zeros(DType::BFloat16, [1 << 20]).unwrap().with_name("w");
    let ho = ContentHash::of(&other).unwrap().to_string();
    let e = c.fetch_delta("w", &other).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.to_string().contains(&ho), "{e}");
    let fresh = v2.clone().with_name("nothing-here");
    let e = c.send_delta(&fresh, &v1).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.to_string().contains(&h1) && e.to_string().contains("none is held"), "{e}");
    // Mismatched dtype/shape never leave the client.
    let e = c.send_delta(&v2, &Tensor::zeros(DType::Float32, [4]).unwrap()).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_over_tcp() {
    send_and_fetch_deltas("tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_over_unix() {
    send_and_fetch_deltas("unix").await;
}

/// The store keeps the replaced version as a base only within its budget.
#[test]
fn bases_count_against_the_store_budget() {
    let store = tensorwire::StoreService::new(3 << 20);
    let t = |b: u8| Tensor::new(DType::UInt8, [1 << 20], vec![b; 1 << 20]).unwrap();
    store.put("a".into(), t(1)).unwrap();
    store.put("a".into(), t(2)).unwrap();
    assert_eq!(store.base_bytes(), 1 << 20);
    store.put("b".into(), t(3)).unwrap();
    assert_eq!(store.bytes() + store.base_bytes(), 3 << 20);
    // A third tensor needs the room: the base goes first, nothing stored does.
    store.put("c".into(), t(4)).unwrap();
    assert_eq!(store.base_bytes(), 0);
    assert_eq!(store.names(), ["a", "b", "c"]);
}
