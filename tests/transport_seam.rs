//! The transport seam is real: a transport of the user's own (here an
//! in-process pipe, `tokio::io::duplex`, with tensorwire's multiplexer over
//! it) is handed to the client and the server, and every call mode runs over
//! it with the same client and server code as over a socket.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tensorwire::transport::mux::{self, QueuedWrite, Role, SocketInfo};
use tensorwire::transport::{
    AcceptError, ConnectError, Connection, Endpoint, ListenError, Listener, Scheme, Transport, TransportConfig,
    Transports,
};
use tensorwire::{Client, ClientConfig, DType, FetchRequest, Server, StoreService, Tensor};
use tokio::io::DuplexStream;
use tokio::sync::mpsc;

/// Pipes by name: `unix://@NAME` URLs reach the listener registered under NAME.
#[derive(Default)]
struct PipeTransport {
    listeners: Mutex<HashMap<String, mpsc::Sender<DuplexStream>>>,
    connects: std::sync::atomic::AtomicUsize,
}

fn info(transport: &'static str) -> SocketInfo {
    SocketInfo { peer: "pipe".into(), transport, local: true }
}

#[async_trait]
impl Transport for PipeTransport {
    fn schemes(&self) -> &'static [Scheme] {
        &[Scheme::Unix]
    }

    async fn connect(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> Result<Arc<dyn Connection>, ConnectError> {
        let tx = self.listeners.lock().unwrap().get(&endpoint.to_string()).cloned();
        let refused = || ConnectError::Io {
            endpoint: endpoint.to_string(),
            source: std::io::ErrorKind::ConnectionRefused.into(),
        };
        let tx = tx.ok_or_else(refused)?;
        let (mine, theirs) = tokio::io::duplex(1 << 20);
        tx.send(theirs).await.map_err(|_| refused())?;
        self.connects.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (rd, wr) = tokio::io::split(mine);
        let c = mux::establish(rd, QueuedWrite(wr), Role::Client, info("pipe"), config)
            .await
            .map_err(|e| ConnectError::Protocol { endpoint: endpoint.to_string(), reason: e.to_string() })?;
        Ok(c)
    }

    async fn listen(&self, endpoint: &Endpoint, config: &TransportConfig) -> Result<Box<dyn Listener>, ListenError> {
        let (tx, rx) = mpsc::channel(16);
        self.listeners.lock().unwrap().insert(endpoint.to_string(), tx);
        Ok(Box::new(PipeListener { rx, endpoint: endpoint.clone(), config: config.clone() }))
    }
}

struct PipeListener {
    rx: mpsc::Receiver<DuplexStream>,
    endpoint: Endpoint,
    config: TransportConfig,
}

#[async_trait]
impl Listener for PipeListener {
    async fn accept(&mut self) -> Result<Arc<dyn Connection>, AcceptError> {
        loop {
            let pipe = self.rx.recv().await.ok_or(AcceptError::Closed)?;
            let (rd, wr) = tokio::io::split(pipe);
            match mux::establish(rd, QueuedWrite(wr), Role::Server, info("pipe"), &self.config).await {
                Ok(c) => return Ok(c),
                Err(_) => continue,
            }
        }
    }

    fn local_endpoint(&self) -> Endpoint {
        self.endpoint.clone()
    }
}

#[tokio::test]
async fn a_transport_of_ones_own_carries_every_call_mode() {
    let pipes = Arc::new(PipeTransport::default());
    let url = "unix://@tensorwire-seam-test";
    let server = Server::builder()
        .transport(pipes.clone())
        .service(StoreService::default())
        .compute("double", |inputs| {
            let x = inputs[0].to_vec::<f32>()?;
            Ok(vec![Tensor::from_vec(inputs[0].shape(), x.iter().map(|v| v * 2.0).collect::<Vec<f32>>())?])
        })
        .build()
        .start([url])
        .await
        .unwrap();

    // A client without the transport finds no such socket: nothing went
    // through the built-in Unix transport.
    assert!(Client::connect(url).await.is_err());

    let cfg = ClientConfig { transports: Transports::default().with(pipes.clone()), ..Default::default() };
    let client = Client::connect_with(url, cfg).await.unwrap();
    assert_eq!(pipes.connects.load(std::sync::atomic::Ordering::Relaxed), 1);

    let big = tensorwire::builtins::random_tensor(DType::Float32, &[3 << 18], 9).unwrap().with_name("big");
    let summary = client.send(vec![big.clone()]).await.unwrap();
    assert_eq!(summary.received, 1);
    assert_eq!(summary.bytes, 3 << 20);
    let back = client.fetch(FetchRequest::name("big")).await.unwrap();
    assert!(back[0].data_eq(&big));

    let x = Tensor::from_vec([2, 2], vec![1.0f32, 2.0, 3.0, 4.0]).unwrap();
    let y = client.compute("double", vec![x]).await.unwrap();
    assert_eq!(y[0].as_slice::<f32>().unwrap(), &[2.0, 4.0, 6.0, 8.0]);

    let outs = client.exchange_all(vec![big.clone(), big.clone()]).await.unwrap();
    assert_eq!(outs.len(), 2);
    assert!(outs.iter().all(|t| t.data_eq(&big)));
    assert_eq!(client.service_info().await.unwrap().transports, vec!["unix".to_string()]);

    server.shutdown().await;
}
