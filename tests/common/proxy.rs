//! A fault-injecting TCP relay for tests: clients connect to it, it
//! connects them to the real server and copies bytes both ways, and in one
//! direction of the first connection it corrupts a byte, truncates, resets,
//! stalls or delays at a chosen offset. Later connections pass untouched, so
//! a test can check that the next call works.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What goes wrong, and where (byte offset in the faulty direction).
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// Flip every bit of the byte at this offset.
    Corrupt(u64),
    /// Close both sockets cleanly after this many bytes.
    Truncate(u64),
    /// Reset both connections (RST) after this many bytes.
    Reset(u64),
    /// Forward this many bytes, then nothing more (the sockets stay open).
    Stall(u64),
    /// Sleep this long before forwarding each read.
    Delay(Duration),
}

/// Which way the fault applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// Client to server (sends).
    Up,
    /// Server to client (fetches).
    Down,
}

/// A running relay.
pub struct Proxy {
    /// Where clients connect.
    pub addr: SocketAddr,
    /// Connections accepted so far.
    pub connections: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    /// Relays to `upstream`, applying `fault` in `dir` on the first connection.
    pub async fn start(upstream: SocketAddr, fault: Fault, dir: Dir) -> Proxy {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let n = connections.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = l.accept().await {
                let first = n.fetch_add(1, Ordering::SeqCst) == 0;
                let Ok(server) = TcpStream::connect(upstream).await else { continue };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                let fault_for = |d: Dir| if first && d == dir { Some(fault) } else { None };
                tokio::spawn(pump(cr, sw, fault_for(Dir::Up)));
                tokio::spawn(pump(sr, cw, fault_for(Dir::Down)));
            }
        });
        Proxy { addr, connections, task }
    }

    /// `tcp://` URL of the relay.
    pub fn url(&self) -> String {
        format!("tcp://{}", self.addr)
    }
}

async fn pump(mut r: tokio::net::tcp::OwnedReadHalf, mut w: tokio::net::tcp::OwnedWriteHalf, fault: Option<Fault>) {
    let mut buf = vec![0u8; 64 << 10];
    let mut pos = 0u64;
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &mut buf[..n];
        let end = pos + n as u64;
        match fault {
            Some(Fault::Corrupt(at)) if (pos..end).contains(&at) => chunk[(at - pos) as usize] ^= 0xff,
            Some(Fault::Truncate(at) | Fault::Reset(at) | Fault::Stall(at)) if end > at => {
                let keep = (at.saturating_sub(pos)) as usize;
                let _ = w.write_all(&chunk[..keep]).await;
                match fault {
                    Some(Fault::Truncate(_)) => {
                        let _ = w.shutdown().await;
                    }
                    Some(Fault::Reset(_)) => {
                        let s = r.reunite(w).expect("halves of one socket");
                        let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
                        drop(s);
                    }
                    _ => std::future::pending::<()>().await,
                }
                return;
            }
            Some(Fault::Delay(d)) => tokio::time::sleep(d).await,
            _ => {}
        }
        if w.write_all(chunk).await.is_err() {
            break;
        }
        pos = end;
    }
    let _ = w.shutdown().await;
}
